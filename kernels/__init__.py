"""NKI kernels for the baseline's hot spots, each with a PyTorch reference of the same signature
and an autograd Function. train.py routes an op here with its --nki-* flag, on the neuron device.

    rmsnorm.rms_norm(x, eps=None)                       fused RMSNorm (no learned scale)
    softcap_ce.softcap_cross_entropy(logits, targets, cap)   per-row loss of softcapped logits
    rope_qknorm.rope_qknorm(x, cos, sin, eps=None)      rotary embedding fused with QK RMSNorm

Every module has the same shape, the one train.py's inline relu^2 kernel has: a reference forward
and backward in PyTorch, the NKI kernels (when `nki` imports), an autograd Function that runs one
or the other, and a public op that picks the kernel for neuron tensors whose shape it takes.
kernels/common.py holds what they share: the launcher (one kernel instance per physical core of the
rank's logical core, NEURON_LOGICAL_NC_CONFIG) and the choice between kernel and reference.
"""
