"""Cross-entropy of softcapped logits, per row: z = cap * tanh(logits / cap),
loss = logsumexp(z) - z[target]. The backward recomputes the softmax from the logits and the
saved logsumexp, so neither the softmax nor the capped logits are ever written to HBM.

Kernel limits: logits [N, V] with N % 128 == 0 and V <= 8192 (five fp32 tiles of V floats per
partition: 160 KiB of the 224 KiB SBUF); logits bf16 or fp32; targets are passed to the kernel
as fp32 [N, 1], exact for V < 2^24. Loss and logsumexp are fp32 [N, 1]; the gradient has the
logits' dtype.
"""
from __future__ import annotations

import torch

from kernels.common import HAS_NKI, PARTITIONS, nisa, nki, nl, pick_kernel

MAX_VOCAB = 8192
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
    def _load_rows(logits, targets, r0):
        """Rows r0..r0+127 of the logits and their targets, in SBUF (a helper traced into the kernels)."""
        raw = nl.ndarray((PARTITIONS, logits.shape[1]), dtype=logits.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=raw, src=logits[r0:r0 + PARTITIONS])
        target = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=target, src=targets[r0:r0 + PARTITIONS])
        return raw, target

    def _column_ids(v):
        """0..v-1 along the free dimension of every partition, fp32 (compared with the targets)."""
        columns = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=columns, pattern=[[1, v]], offset=0, channel_multiplier=0)
        return columns

    @nki.jit
    def softcap_ce_forward_kernel(logits, targets, cap):
        """loss, lse [N, 1] fp32 for logits [N, V] and targets [N, 1] (fp32) in HBM."""
        n, v = logits.shape
        loss = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        lse_out = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        columns = _column_ids(v)
        for i in nl.affine_range(n // PARTITIONS):
            r0 = i * PARTITIONS
            raw, target = _load_rows(logits, targets, r0)
            z = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=z, op=nl.tanh, data=raw, scale=1.0 / cap)
            nisa.tensor_scalar(dst=z, data=z, op0=nl.multiply, operand0=cap)  # z = cap * tanh(logits / cap)
            zmax = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=zmax, op=nl.maximum, data=z, axis=(1,))
            neg_max = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg_max, data=zmax, op0=nl.multiply, operand0=-1.0)
            expz = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            sumexp = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=expz, op=nl.exp, data=z, bias=neg_max, scale=1.0, reduce_op=nl.add,
                            reduce_res=sumexp)
            lse = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=lse, op=nl.log, data=sumexp)
            nisa.tensor_tensor(dst=lse, data1=lse, data2=zmax, op=nl.add)
            onehot = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=onehot, data=columns, op0=nl.equal, operand0=target)
            nisa.tensor_tensor(dst=onehot, data1=onehot, data2=z, op=nl.multiply)
            picked = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=picked, op=nl.add, data=onehot, axis=(1,))  # z[target]
            row_loss = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=row_loss, data1=lse, data2=picked, op=nl.subtract)
            nisa.dma_copy(dst=loss[r0:r0 + PARTITIONS], src=row_loss)
            nisa.dma_copy(dst=lse_out[r0:r0 + PARTITIONS], src=lse)
        return loss, lse_out

    @nki.jit
    def softcap_ce_backward_kernel(logits, targets, lse, grad_loss, cap):
        """dlogits [N, V] for logits [N, V], targets, lse, grad_loss [N, 1] (fp32) in HBM."""
        n, v = logits.shape
        dlogits = nl.ndarray((n, v), dtype=logits.dtype, buffer=nl.shared_hbm)
        columns = _column_ids(v)
        for i in nl.affine_range(n // PARTITIONS):
            r0 = i * PARTITIONS
            raw, target = _load_rows(logits, targets, r0)
            row_lse = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=row_lse, src=lse[r0:r0 + PARTITIONS])
            g = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=g, src=grad_loss[r0:r0 + PARTITIONS])
            t = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=t, op=nl.tanh, data=raw, scale=1.0 / cap)
            neg_lse = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg_lse, data=row_lse, op0=nl.multiply, operand0=-1.0)
            p = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=p, op=nl.exp, data=t, bias=neg_lse, scale=cap)  # softmax(z) = exp(cap*t - lse)
            onehot = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=onehot, data=columns, op0=nl.equal, operand0=target)
            nisa.tensor_tensor(dst=p, data1=p, data2=onehot, op=nl.subtract)
            nisa.tensor_scalar(dst=p, data=p, op0=nl.multiply, operand0=g)
            nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.multiply)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)  # 1 - t^2
            d_tile = nl.ndarray((PARTITIONS, v), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=d_tile, data1=p, data2=t, op=nl.multiply)
            nisa.dma_copy(dst=dlogits[r0:r0 + PARTITIONS], src=d_tile)
        return dlogits


class SoftcapCrossEntropyFunction(torch.autograd.Function):
    """Per-row softcapped cross-entropy; kernels (use_kernel=True, neuron tensors) or reference."""

    @staticmethod
    def forward(ctx, logits, targets, cap: float, use_kernel: bool):
        if use_kernel:
            loss, lse = softcap_ce_forward_kernel(logits.contiguous(), targets.float()[:, None].contiguous(), cap)
            loss, lse = loss[:, 0], lse[:, 0]
        else:
            loss, lse = softcap_ce_forward_reference(logits, targets, cap)
        ctx.save_for_backward(logits, targets, lse)
        ctx.cap, ctx.use_kernel = cap, use_kernel
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse = ctx.saved_tensors
        if ctx.use_kernel:
            dlogits = softcap_ce_backward_kernel(logits.contiguous(), targets.float()[:, None].contiguous(),
                                                 lse[:, None].contiguous(), grad_loss.float()[:, None].contiguous(),
                                                 ctx.cap)
        else:
            dlogits = softcap_ce_backward_reference(logits, targets, lse, grad_loss, ctx.cap)
        return dlogits, None, None, None


def kernel_fits(logits: torch.Tensor) -> bool:
    return logits.dim() == 2 and logits.shape[0] % PARTITIONS == 0 and logits.shape[1] <= MAX_VOCAB \
        and logits.dtype in (torch.bfloat16, torch.float32)


def softcap_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    """Loss per row (fp32) of logits [N, V] (before the softcap) against targets [N]."""
    use = pick_kernel("softcap_ce", logits, kernel_fits(logits), f"logits {tuple(logits.shape)} {logits.dtype} do "
                      f"not fit (rows % {PARTITIONS}, vocab <= {MAX_VOCAB}, bf16/fp32)")
    return SoftcapCrossEntropyFunction.apply(logits, targets, cap, use)
