"""Fused RMSNorm without a learned scale: y = x / sqrt(mean(x^2) + eps) over the last dimension.

Kernel limits: x viewed as [N, D] rows with N % (128 * cores) == 0 (128-row tiles on the SBUF
partitions, shared evenly by the physical cores of the logical core) and D <= 4096 (four fp32
tiles of D floats per partition); x bf16 or fp32. Statistics are fp32; y has x's dtype. The
forward also returns rstd [N, 1] (fp32), which the backward reuses.
eps defaults to torch.finfo(x.dtype).eps, as F.rms_norm's does.
"""
from __future__ import annotations

import torch

from kernels.common import HAS_NKI, PARTITIONS, launch, nisa, nki, nl, pick_kernel, rows

MAX_WIDTH = 4096


def rmsnorm_forward_reference(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) with rstd = 1 / sqrt(mean(x^2) + eps), shape [..., 1], in fp32 (or x's dtype if wider)."""
    xf = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype), rstd


def rmsnorm_backward_reference(x: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dx = rstd * (g - x * rstd^2 * mean(g * x))."""
    xf = x.float() if x.dtype != torch.float64 else x
    gf = grad.to(xf.dtype)
    dot = (gf * xf).mean(dim=-1, keepdim=True)
    return (rstd * gf - xf * rstd.pow(3) * dot).to(x.dtype)


if HAS_NKI:
    @nki.jit
    def rmsnorm_forward_kernel(x, eps):
        """y, rstd for x [N, D] in HBM; N % (128 * cores) == 0, D <= MAX_WIDTH."""
        n, d = x.shape
        y = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
        rstd_out = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()  # this core's share of the 128-row tiles
        for i in nl.affine_range(tiles):
            r = nl.ds((nl.program_id(0) * tiles + i) * PARTITIONS, PARTITIONS)
            x_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_tile, src=x[r, :])
            xf = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=xf, src=x_tile)
            sq = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=sq, data1=xf, data2=xf, op=nl.multiply)
            ss = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=ss, op=nl.add, data=sq, axis=(1,))
            ms = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=ms, data=ss, op0=nl.multiply, operand0=1.0 / d, op1=nl.add, operand1=eps)
            inv = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv, data=ms)
            rstd = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=rstd, op=nl.sqrt, data=inv)
            y_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=y_tile, data=xf, op0=nl.multiply, operand0=rstd)
            nisa.dma_copy(dst=y[r, :], src=y_tile)
            nisa.dma_copy(dst=rstd_out[r, :], src=rstd)
        return y, rstd_out

    @nki.jit
    def rmsnorm_backward_kernel(x, rstd, grad):
        """dx for x, grad [N, D] and rstd [N, 1] (fp32) in HBM; N % (128 * cores) == 0, D <= MAX_WIDTH."""
        n, d = x.shape
        dx = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()  # this core's share of the 128-row tiles
        for i in nl.affine_range(tiles):
            r = nl.ds((nl.program_id(0) * tiles + i) * PARTITIONS, PARTITIONS)
            x_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_tile, src=x[r, :])
            g_tile = nl.ndarray((PARTITIONS, d), dtype=grad.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_tile, src=grad[r, :])
            rstd_tile = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=rstd_tile, src=rstd[r, :])
            xf = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=xf, src=x_tile)
            gf = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=gf, src=g_tile)
            work = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=work, data1=gf, data2=xf, op=nl.multiply)
            dot = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=dot, op=nl.add, data=work, axis=(1,))
            r2 = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=r2, data1=rstd_tile, data2=rstd_tile, op=nl.multiply)
            coef = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=coef, data=dot, op0=nl.multiply, operand0=1.0 / d, op1=nl.multiply,
                                      operand1=r2)  # mean(g * x) * rstd^2
            nisa.tensor_scalar(dst=work, data=xf, op0=nl.multiply, operand0=coef)
            nisa.tensor_tensor(dst=work, data1=gf, data2=work, op=nl.subtract)
            dx_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=dx_tile, data=work, op0=nl.multiply, operand0=rstd_tile)
            nisa.dma_copy(dst=dx[r, :], src=dx_tile)
        return dx


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm whose forward and backward run as the NKI kernels (use_kernel=True, neuron
    tensors) or as the PyTorch reference (use_kernel=False, any device)."""

    @staticmethod
    def forward(ctx, x, eps: float, use_kernel: bool):
        if use_kernel:
            y, rstd = launch(rmsnorm_forward_kernel, rows(x, x.shape[-1]), eps)
            y, rstd = y.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1)
        else:
            y, rstd = rmsnorm_forward_reference(x, eps)
        ctx.save_for_backward(x, rstd)
        ctx.use_kernel = use_kernel
        return y

    @staticmethod
    def backward(ctx, grad):
        x, rstd = ctx.saved_tensors
        if ctx.use_kernel:
            d = x.shape[-1]
            dx = launch(rmsnorm_backward_kernel, rows(x, d), rows(rstd, 1), rows(grad, d)).reshape(x.shape)
        else:
            dx = rmsnorm_backward_reference(x, rstd, grad)
        return dx, None, None


def kernel_fits(x: torch.Tensor) -> bool:
    return (x.numel() // x.shape[-1]) % PARTITIONS == 0 and x.shape[-1] <= MAX_WIDTH \
        and x.dtype in (torch.bfloat16, torch.float32)


def rms_norm(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension; the NKI kernel for neuron tensors it takes."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    use = pick_kernel("rmsnorm", x, kernel_fits(x), f"shape {tuple(x.shape)} {x.dtype} does not fit "
                      f"(rows % {PARTITIONS}, width <= {MAX_WIDTH}, bf16/fp32)", x.numel() // x.shape[-1])
    return RMSNormFunction.apply(x, eps, use)
