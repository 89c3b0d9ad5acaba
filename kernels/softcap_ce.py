"""Cross-entropy of softcapped logits, per row: z = cap * tanh(logits / cap),
loss = logsumexp(z) - z[target]. The kernels do the vocabulary-wide work (the logsumexp forward,
softmax(z) * (1 - tanh^2) backward) one 128-row tile at a time in SBUF, so neither the softmax nor
the capped logits are ever written to HBM; the per-row target terms are a gather in PyTorch.
Because |z| <= cap, exp(z - cap) can neither overflow nor underflow to zero (cap = 15 gives at
least e^-30), so the kernel needs no running maximum: logsumexp(z) = cap + log(sum(exp(z - cap))).

Kernel limits: logits [N, V] with N % (128 * cores) == 0 (the physical cores of the logical core
share the 128-row tiles evenly) and V <= 8192 (the backward holds four tiles of V elements per
partition: at most 128 KiB of the 224 KiB SBUF); logits bf16 or fp32; cap <= 40 (so e^(-2 cap)
stays a normal fp32). Loss and logsumexp are fp32; the gradient has the logits' dtype.
"""
from __future__ import annotations

import torch

from kernels.common import HAS_NKI, PARTITIONS, launch, nisa, nki, nl, pick_kernel

MAX_VOCAB = 8192
MAX_CAP = 40.0
REFERENCE_CHUNK_ROWS = 1024  # the reference works on this many rows at a time, to bound its memory


def softcap_ce_forward_reference(logits: torch.Tensor, targets: torch.Tensor, cap: float):
    """(loss [N], lse [N]) in fp32 (float64 for float64 logits)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
    lse = torch.empty_like(loss)
    for r0 in range(0, logits.shape[0], REFERENCE_CHUNK_ROWS):
        z = cap * torch.tanh(logits[r0:r0 + REFERENCE_CHUNK_ROWS].to(dtype) / cap)
        lse[r0:r0 + REFERENCE_CHUNK_ROWS] = torch.logsumexp(z, dim=-1)
        picked = z.gather(1, targets[r0:r0 + REFERENCE_CHUNK_ROWS, None]).squeeze(1)
        loss[r0:r0 + REFERENCE_CHUNK_ROWS] = lse[r0:r0 + REFERENCE_CHUNK_ROWS] - picked
    return loss, lse


def softcap_ce_backward_reference(logits, targets, lse, grad_loss, cap: float) -> torch.Tensor:
    """dlogits = grad * (softmax(z) - onehot(target)) * (1 - tanh(logits / cap)^2)."""
    dtype = lse.dtype
    dlogits = torch.empty_like(logits)
    for r0 in range(0, logits.shape[0], REFERENCE_CHUNK_ROWS):
        sl = slice(r0, r0 + REFERENCE_CHUNK_ROWS)
        t = torch.tanh(logits[sl].to(dtype) / cap)
        p = torch.exp(cap * t - lse[sl, None])
        p.scatter_add_(1, targets[sl, None], -torch.ones_like(p[:, :1]))
        dlogits[sl] = (p * grad_loss[sl, None].to(dtype) * (1 - t * t)).to(logits.dtype)
    return dlogits


if HAS_NKI:
    @nki.jit
    def softcap_lse_kernel(logits, cap):
        """lse [N, 1] fp32 = logsumexp(cap * tanh(logits / cap)) for logits [N, V] in HBM."""
        n, v = logits.shape
        lse_out = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()  # this core's share of the 128-row tiles
        for i in nl.affine_range(tiles):
            r = nl.ds((nl.program_id(0) * tiles + i) * PARTITIONS, PARTITIONS)
            raw = nl.ndarray((PARTITIONS, v), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=raw, src=logits[r, :])
            z = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=z, op=nl.tanh, data=raw, scale=1.0 / cap)
            nisa.tensor_scalar(dst=z, data=z, op0=nl.multiply, operand0=cap, op1=nl.subtract, operand1=cap)  # z - cap
            # The fused row sum goes through ScalarE's reduce registers: reset_reduce zeroes them and
            # sums this tile. The default, reduce_cmd.idle, leaves them alone, and reduce_res would
            # read whatever an earlier instruction left there.
            sumexp = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=z, op=nl.exp, data=z, reduce_op=nl.add, reduce_res=sumexp,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
            lse = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=lse, op=nl.log, data=sumexp)
            nisa.tensor_scalar(dst=lse, data=lse, op0=nl.add, operand0=cap)
            nisa.dma_copy(dst=lse_out[r, :], src=lse)
        return lse_out

    @nki.jit
    def softcap_softmax_grad_kernel(logits, lse, grad_loss, cap):
        """grad * softmax(z) * (1 - tanh^2), [N, V] in the logits' dtype, for logits [N, V] and
        lse, grad_loss [N, 1] (fp32) in HBM. The target's -1 term is added by the caller."""
        n, v = logits.shape
        out = nl.ndarray((n, v), dtype=logits.dtype, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()  # this core's share of the 128-row tiles
        for i in nl.affine_range(tiles):
            r = nl.ds((nl.program_id(0) * tiles + i) * PARTITIONS, PARTITIONS)
            raw = nl.ndarray((PARTITIONS, v), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=raw, src=logits[r, :])
            neg_lse = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=neg_lse, src=lse[r, :])
            nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0)
            g = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=g, src=grad_loss[r, :])
            t = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=t, op=nl.tanh, data=raw, scale=1.0 / cap)
            p = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=p, op=nl.exp, data=t, bias=neg_lse, scale=cap)  # softmax(z) = exp(cap t - lse)
            nisa.tensor_scalar(dst=p, data=p, op0=nl.multiply, operand0=g)
            nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.multiply)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)  # 1 - t^2
            d_tile = nl.ndarray((PARTITIONS, v), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=d_tile, data1=p, data2=t, op=nl.multiply)
            nisa.dma_copy(dst=out[r, :], src=d_tile)
        return out


def capped_target_logits(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(z[target], tanh(logits[target] / cap)) per row, fp32: the per-row terms the kernels leave out."""
    t = torch.tanh(logits.gather(1, targets[:, None]).squeeze(1).float() / cap)
    return cap * t, t


class SoftcapCrossEntropyFunction(torch.autograd.Function):
    """Per-row softcapped cross-entropy; kernels (use_kernel=True, neuron tensors) or reference."""

    @staticmethod
    def forward(ctx, logits, targets, cap: float, use_kernel: bool):
        if use_kernel:
            lse = launch(softcap_lse_kernel, logits.contiguous(), cap)[:, 0]
            loss = lse - capped_target_logits(logits, targets, cap)[0]
        else:
            loss, lse = softcap_ce_forward_reference(logits, targets, cap)
        ctx.save_for_backward(logits, targets, lse)
        ctx.cap, ctx.use_kernel = cap, use_kernel
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse = ctx.saved_tensors
        if ctx.use_kernel:
            dlogits = launch(softcap_softmax_grad_kernel, logits.contiguous(), lse[:, None].contiguous(),
                             grad_loss.float()[:, None].contiguous(), ctx.cap)
            _, t = capped_target_logits(logits, targets, ctx.cap)
            dlogits.scatter_add_(1, targets[:, None], (-grad_loss.float() * (1 - t * t))[:, None].to(dlogits.dtype))
        else:
            dlogits = softcap_ce_backward_reference(logits, targets, lse, grad_loss, ctx.cap)
        return dlogits, None, None, None


def kernel_fits(logits: torch.Tensor, cap: float = 15.0) -> bool:
    return logits.dim() == 2 and logits.shape[0] % PARTITIONS == 0 and logits.shape[1] <= MAX_VOCAB \
        and logits.dtype in (torch.bfloat16, torch.float32) and 0 < cap <= MAX_CAP


def softcap_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    """Loss per row (fp32) of logits [N, V] (before the softcap) against targets [N]."""
    use = pick_kernel("softcap_ce", logits, kernel_fits(logits, cap), f"logits {tuple(logits.shape)} "
                      f"{logits.dtype} with cap {cap} do not fit (rows % {PARTITIONS}, vocab <= {MAX_VOCAB}, "
                      f"bf16/fp32, cap <= {MAX_CAP})", logits.shape[0])
    return SoftcapCrossEntropyFunction.apply(logits, targets, cap, use)
