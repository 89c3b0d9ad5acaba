"""Rotary embedding fused with the RMSNorm that follows it (QK-norm):
y = rms_norm(rotate(x)), rotate(x) = [x1 * cos + x2 * sin, x2 * cos - x1 * sin] on the two
halves of each head. The backward recomputes the rotation and the norm statistics from x.

Shapes: x [B, T, H, D]; cos, sin broadcastable to [T, D/2] (train.py keeps them [1, T, 1, D/2]).
Kernel limits: T % 128 == 0 (a 128-row tile covers 128 positions of one sequence, so it reads one
slice of cos and sin), B * T / 128 tiles shared evenly by the physical cores of the logical core,
H * D <= 4096 (fp32 working tiles per partition), D even; x bf16 or fp32.
eps defaults to torch.finfo(x.dtype).eps, as F.rms_norm's does.
"""
from __future__ import annotations

import torch

from kernels.common import HAS_NKI, PARTITIONS, launch, nisa, nki, nl, pick_kernel

MAX_ROW_WIDTH = 4096


def _tables(cos: torch.Tensor, sin: torch.Tensor, T: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cos.reshape(-1, half)[:T], sin.reshape(-1, half)[:T]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated, in fp32 (float64 for float64 x); cos, sin [T, D/2]."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    c, s = cos[None, :, None, :].to(xf.dtype), sin[None, :, None, :].to(xf.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1)


def rope_qknorm_forward_reference(x, cos, sin, eps: float) -> torch.Tensor:
    z = rotate(x, *_tables(cos, sin, x.shape[1], x.shape[-1] // 2))
    return (z * torch.rsqrt(z.square().mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def rope_qknorm_backward_reference(x, cos, sin, grad, eps: float) -> torch.Tensor:
    c, s = _tables(cos, sin, x.shape[1], x.shape[-1] // 2)
    z = rotate(x, c, s)
    rstd = torch.rsqrt(z.square().mean(dim=-1, keepdim=True) + eps)
    g = grad.to(z.dtype)
    dz = rstd * g - z * rstd.pow(3) * (g * z).mean(dim=-1, keepdim=True)
    dz1, dz2 = dz.chunk(2, dim=-1)
    c, s = c[None, :, None, :].to(z.dtype), s[None, :, None, :].to(z.dtype)
    return torch.cat([dz1 * c - dz2 * s, dz1 * s + dz2 * c], dim=-1).to(x.dtype)


if HAS_NKI:
    def _rotated_tile(x, cos, sin, r0, heads, eps):
        """Load rows r0..r0+127 of x and rotate each head; returns (z [P, H*D] fp32, rstd [P, H]
        fp32: each head's 1/rms). A helper traced into the kernels that call it (no @nki.jit)."""
        width = x.shape[1]
        T, half = cos.shape
        d = 2 * half
        t0 = r0 % T  # a tile's 128 rows are 128 consecutive positions of one sequence
        x_tile = nl.ndarray((PARTITIONS, width), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_tile, src=x[nl.ds(r0, PARTITIONS), :])
        cos_t = nl.ndarray((PARTITIONS, half), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=cos_t, src=cos[nl.ds(t0, PARTITIONS), :])
        sin_t = nl.ndarray((PARTITIONS, half), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sin_t, src=sin[nl.ds(t0, PARTITIONS), :])
        z = nl.ndarray((PARTITIONS, width), dtype=nl.float32, buffer=nl.sbuf)
        rstd = nl.ndarray((PARTITIONS, heads), dtype=nl.float32, buffer=nl.sbuf)
        tmp = nl.ndarray((PARTITIONS, half), dtype=nl.float32, buffer=nl.sbuf)
        sq = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
        ms = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
        for h in range(heads):
            x1, x2 = x_tile[:, h * d:h * d + half], x_tile[:, h * d + half:(h + 1) * d]
            z1, z2 = z[:, h * d:h * d + half], z[:, h * d + half:(h + 1) * d]
            nisa.tensor_tensor(dst=z1, data1=x1, data2=cos_t, op=nl.multiply)
            nisa.tensor_tensor(dst=tmp, data1=x2, data2=sin_t, op=nl.multiply)
            nisa.tensor_tensor(dst=z1, data1=z1, data2=tmp, op=nl.add)
            nisa.tensor_tensor(dst=z2, data1=x2, data2=cos_t, op=nl.multiply)
            nisa.tensor_tensor(dst=tmp, data1=x1, data2=sin_t, op=nl.multiply)
            nisa.tensor_tensor(dst=z2, data1=z2, data2=tmp, op=nl.subtract)
            nisa.tensor_tensor(dst=sq, data1=z[:, h * d:(h + 1) * d], data2=z[:, h * d:(h + 1) * d], op=nl.multiply)
            nisa.tensor_reduce(dst=ms, op=nl.add, data=sq, axis=(1,))
            nisa.tensor_scalar(dst=ms, data=ms, op0=nl.multiply, operand0=1.0 / d, op1=nl.add, operand1=eps)
            nisa.reciprocal(dst=ms, data=ms)
            nisa.activation(dst=rstd[:, h:h + 1], op=nl.sqrt, data=ms)
        return z, rstd, cos_t, sin_t

    @nki.jit
    def rope_qknorm_forward_kernel(x, cos, sin, heads, eps):
        """y [N, H*D] for x [N, H*D] (rows = (batch, position)), cos, sin [T, D/2]; T % 128 == 0,
        N % (128 * cores) == 0."""
        n, width = x.shape
        d = 2 * cos.shape[1]
        y = nl.ndarray((n, width), dtype=x.dtype, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()  # this core's share of the 128-row tiles
        for i in nl.affine_range(tiles):
            r0 = (nl.program_id(0) * tiles + i) * PARTITIONS
            z, rstd, _, _ = _rotated_tile(x, cos, sin, r0, heads, eps)
            y_tile = nl.ndarray((PARTITIONS, width), dtype=x.dtype, buffer=nl.sbuf)
            for h in range(heads):
                nisa.tensor_scalar(dst=y_tile[:, h * d:(h + 1) * d], data=z[:, h * d:(h + 1) * d],
                                   op0=nl.multiply, operand0=rstd[:, h:h + 1])
            nisa.dma_copy(dst=y[nl.ds(r0, PARTITIONS), :], src=y_tile)
        return y

    @nki.jit
    def rope_qknorm_backward_kernel(x, cos, sin, grad, heads, eps):
        """dx [N, H*D] for x, grad [N, H*D], cos, sin [T, D/2]; T % 128 == 0, N % (128 * cores) == 0."""
        n, width = x.shape
        half = cos.shape[1]
        d = 2 * half
        dx = nl.ndarray((n, width), dtype=x.dtype, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()  # this core's share of the 128-row tiles
        for i in nl.affine_range(tiles):
            r0 = (nl.program_id(0) * tiles + i) * PARTITIONS
            z, rstd, cos_t, sin_t = _rotated_tile(x, cos, sin, r0, heads, eps)
            g_tile = nl.ndarray((PARTITIONS, width), dtype=grad.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_tile, src=grad[nl.ds(r0, PARTITIONS), :])
            gf = nl.ndarray((PARTITIONS, width), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=gf, src=g_tile)
            work = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            dot = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            coef = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            tmp = nl.ndarray((PARTITIONS, half), dtype=nl.float32, buffer=nl.sbuf)
            dx_tile = nl.ndarray((PARTITIONS, width), dtype=x.dtype, buffer=nl.sbuf)
            for h in range(heads):
                zh, gh, r = z[:, h * d:(h + 1) * d], gf[:, h * d:(h + 1) * d], rstd[:, h:h + 1]
                # dz = rstd * (g - z * rstd^2 * mean(g * z)), written over gh
                nisa.tensor_tensor(dst=work, data1=gh, data2=zh, op=nl.multiply)
                nisa.tensor_reduce(dst=dot, op=nl.add, data=work, axis=(1,))
                nisa.tensor_tensor(dst=coef, data1=r, data2=r, op=nl.multiply)
                nisa.scalar_tensor_tensor(dst=coef, data=dot, op0=nl.multiply, operand0=1.0 / d, op1=nl.multiply,
                                          operand1=coef)
                nisa.tensor_scalar(dst=work, data=zh, op0=nl.multiply, operand0=coef)
                nisa.tensor_tensor(dst=gh, data1=gh, data2=work, op=nl.subtract)
                nisa.tensor_scalar(dst=gh, data=gh, op0=nl.multiply, operand0=r)
                # the inverse rotation: dx1 = dz1 cos - dz2 sin, dx2 = dz1 sin + dz2 cos
                d1, d2 = gh[:, 0:half], gh[:, half:d]
                o1, o2 = dx_tile[:, h * d:h * d + half], dx_tile[:, h * d + half:(h + 1) * d]
                nisa.tensor_tensor(dst=work[:, 0:half], data1=d1, data2=cos_t, op=nl.multiply)
                nisa.tensor_tensor(dst=tmp, data1=d2, data2=sin_t, op=nl.multiply)
                nisa.tensor_tensor(dst=o1, data1=work[:, 0:half], data2=tmp, op=nl.subtract)
                nisa.tensor_tensor(dst=work[:, 0:half], data1=d1, data2=sin_t, op=nl.multiply)
                nisa.tensor_tensor(dst=tmp, data1=d2, data2=cos_t, op=nl.multiply)
                nisa.tensor_tensor(dst=o2, data1=work[:, 0:half], data2=tmp, op=nl.add)
            nisa.dma_copy(dst=dx[nl.ds(r0, PARTITIONS), :], src=dx_tile)
        return dx


class RopeQKNormFunction(torch.autograd.Function):
    """rms_norm(rotate(x)); kernels (use_kernel=True, neuron tensors) or the reference."""

    @staticmethod
    def forward(ctx, x, cos, sin, eps: float, use_kernel: bool):
        B, T, H, D = x.shape
        c, s = _tables(cos, sin, T, D // 2)
        ctx.save_for_backward(x, c, s)
        ctx.eps, ctx.use_kernel = eps, use_kernel
        if use_kernel:
            y = launch(rope_qknorm_forward_kernel, x.reshape(B * T, H * D).contiguous(), c.float().contiguous(),
                       s.float().contiguous(), H, eps)
            return y.reshape(x.shape)
        return rope_qknorm_forward_reference(x, c, s, eps)

    @staticmethod
    def backward(ctx, grad):
        x, c, s = ctx.saved_tensors
        B, T, H, D = x.shape
        if ctx.use_kernel:
            dx = launch(rope_qknorm_backward_kernel, x.reshape(B * T, H * D).contiguous(), c.float().contiguous(),
                        s.float().contiguous(), grad.reshape(B * T, H * D).contiguous(), H, ctx.eps).reshape(x.shape)
        else:
            dx = rope_qknorm_backward_reference(x, c, s, grad, ctx.eps)
        return dx, None, None, None, None


def kernel_fits(x: torch.Tensor) -> bool:
    B, T, H, D = x.shape
    return T % PARTITIONS == 0 and D % 2 == 0 and H * D <= MAX_ROW_WIDTH and x.dtype in (torch.bfloat16, torch.float32)


def rope_qknorm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """rms_norm(rotate(x)) for x [B, T, H, D]; the NKI kernels for neuron tensors they take."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    use = pick_kernel("rope_qknorm", x, kernel_fits(x), f"x {tuple(x.shape)} {x.dtype} does not fit "
                      f"(T % {PARTITIONS}, H*D <= {MAX_ROW_WIDTH}, bf16/fp32)", x.shape[0] * x.shape[1])
    return RopeQKNormFunction.apply(x, cos, sin, eps, use)
