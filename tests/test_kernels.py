"""kernels/: each PyTorch reference matches the eager composition of PyTorch ops (value and float64
gradient), including shapes the kernels cannot take; on a Trainium machine, each NKI kernel matches
its reference (tests marked `neuron`, skipped elsewhere)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO  # noqa: F401  (puts the repository on sys.path)
from kernels import common, rmsnorm, rope_qknorm, softcap_ce
import train as T


def eager_softcap_ce(logits, targets, cap):
    z = cap * torch.tanh(logits / cap)
    return F.cross_entropy(z, targets, reduction="none")


# --- references vs eager, on CPU ----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 64), (3, 5, 7), (2, 130, 33)])  # the last two do not fit the kernel
def test_rmsnorm_reference_matches_eager(shape):
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    eps = 1e-6
    ref = rmsnorm.RMSNormFunction.apply(x, eps, False)
    eager = F.rms_norm(x, (shape[-1],), eps=eps)
    assert torch.allclose(ref, eager, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    assert torch.allclose(torch.autograd.grad(ref, x, g)[0], torch.autograd.grad(eager, x, g)[0], rtol=1e-10, atol=1e-12)
    small = x.detach().reshape(-1, shape[-1])[:6].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rmsnorm.RMSNormFunction.apply(t, eps, False), (small,))
    x32 = x.detach().float()
    assert torch.allclose(rmsnorm.rms_norm(x32), F.rms_norm(x32, (shape[-1],)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n, v", [(256, 512), (7, 100)])
def test_softcap_ce_reference_matches_eager(n, v, monkeypatch):
    monkeypatch.setattr(softcap_ce, "REFERENCE_CHUNK_ROWS", 100)  # exercise the chunking
    logits = (torch.randn(n, v, dtype=torch.float64) * 10).requires_grad_()
    targets = torch.randint(0, v, (n,))
    ref = softcap_ce.SoftcapCrossEntropyFunction.apply(logits, targets, 15.0, False)
    eager = eager_softcap_ce(logits, targets, 15.0)
    assert torch.allclose(ref, eager, rtol=1e-12, atol=1e-12)
    g = torch.rand(n, dtype=torch.float64)
    assert torch.allclose(torch.autograd.grad(ref, logits, g)[0], torch.autograd.grad(eager, logits, g)[0],
                          rtol=1e-10, atol=1e-12)
    small = logits[:9, :17].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: softcap_ce.SoftcapCrossEntropyFunction.apply(t, targets[:9] % 17, 15.0,
                                                                                             False), (small,))


@pytest.mark.parametrize("B, T_, H, D", [(2, 128, 3, 16), (1, 5, 2, 6)])  # the second does not fit the kernel
def test_rope_qknorm_reference_matches_eager(B, T_, H, D):
    x = torch.randn(B, T_, H, D, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in T.rotary_tables(T_ + 3, D, 10000.0))  # longer tables, as in the model
    eps = 1e-6
    ref = rope_qknorm.RopeQKNormFunction.apply(x, cos, sin, eps, False)
    eager = F.rms_norm(T.apply_rotary(x, cos[:, :T_], sin[:, :T_]), (D,), eps=eps)
    assert torch.allclose(ref, eager, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    assert torch.allclose(torch.autograd.grad(ref, x, g)[0], torch.autograd.grad(eager, x, g)[0], rtol=1e-10, atol=1e-12)
    small = x[:1, :4].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rope_qknorm.RopeQKNormFunction.apply(t, cos, sin, eps, False), (small,))


def test_ops_use_the_reference_off_the_neuron_device():
    x = torch.randn(256, 64)
    assert not common.pick_kernel("rmsnorm", x, True, "")
    assert rmsnorm.kernel_fits(x) and not rmsnorm.kernel_fits(torch.randn(3, 64))
    assert softcap_ce.kernel_fits(torch.randn(256, 8192)) and not softcap_ce.kernel_fits(torch.randn(256, 8193))
    assert rope_qknorm.kernel_fits(torch.randn(1, 256, 5, 128)) and not rope_qknorm.kernel_fits(torch.randn(1, 100, 5, 128))


def test_train_py_routes_ops_only_for_neuron_tensors(monkeypatch):
    calls = []
    monkeypatch.setitem(T.KERNELS, "rmsnorm", lambda x: calls.append(x) or x)
    x = torch.randn(4, 8)
    assert torch.equal(T.norm(x), F.rms_norm(x, (8,)))  # a CPU tensor takes the eager path
    assert calls == []
    hp = T.Hyperparameters(nki_rmsnorm=True, nki_softcap_ce=True, nki_rope_qknorm=True, nki_relu2=True)
    monkeypatch.setattr(T, "KERNELS", {})
    T.enable_kernels(hp)
    assert set(T.KERNELS) == {"relu2", "rmsnorm", "rope_qknorm", "softcap_ce"}
    assert T.KERNELS["softcap_ce"] is softcap_ce.softcap_cross_entropy


# --- kernels vs references, on a Trainium machine ------------------------------------------------

def _neuron_available() -> bool:
    try:
        return common.HAS_NKI and T.detect_device_type() == "neuron"
    except Exception:
        return False


neuron = pytest.mark.skipif(not _neuron_available(), reason="needs a Trainium (neuron) device and nki")
# Tolerances (max abs difference vs the fp32 PyTorch reference on the same inputs): fp32 kernels
# compute in fp32 like the reference, 1e-4 relative to the output scale; bf16 kernels round their
# output to bf16 (8 bits of mantissa), 2e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _close(kernel_out, ref_out, dtype):
    diff = (kernel_out.float().cpu() - ref_out.float().cpu()).abs().max().item()
    scale = max(1.0, ref_out.float().abs().max().item())
    assert diff <= TOLERANCE[dtype] * scale, f"max abs diff {diff} > {TOLERANCE[dtype]} x {scale}"


@pytest.mark.neuron
@neuron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_kernel_matches_reference(dtype):
    x = torch.randn(512, 2560, dtype=dtype)
    g = torch.randn_like(x)
    xn = x.to("neuron").requires_grad_()
    y = T.ReLUSquared.apply(xn, True)
    (dx,) = torch.autograd.grad(y, xn, g.to("neuron"))
    _close(y, T.relu2_forward_reference(x.float()), dtype)
    _close(dx, T.relu2_backward_reference(x.float(), g.float()), dtype)


@pytest.mark.neuron
@neuron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_kernel_matches_reference(dtype):
    x, g = torch.randn(4, 256, 640, dtype=dtype), torch.randn(4, 256, 640, dtype=dtype)
    xn = x.to("neuron").requires_grad_()
    y = rmsnorm.RMSNormFunction.apply(xn, 1e-6, True)
    (dx,) = torch.autograd.grad(y, xn, g.to("neuron"))
    ref_y, rstd = rmsnorm.rmsnorm_forward_reference(x.float(), 1e-6)
    _close(y, ref_y, dtype)
    _close(dx, rmsnorm.rmsnorm_backward_reference(x.float(), rstd, g.float()), dtype)


@pytest.mark.neuron
@neuron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_ce_kernel_matches_reference(dtype):
    logits = (torch.randn(512, 8192) * 8).to(dtype)
    targets = torch.randint(0, 8192, (512,))
    g = torch.rand(512)
    ln = logits.to("neuron").requires_grad_()
    loss = softcap_ce.SoftcapCrossEntropyFunction.apply(ln, targets.to("neuron"), 15.0, True)
    (dl,) = torch.autograd.grad(loss, ln, g.to("neuron"))
    ref_loss, lse = softcap_ce.softcap_ce_forward_reference(logits.float(), targets, 15.0)
    _close(loss, ref_loss, torch.float32)  # the loss is fp32 either way
    _close(dl, softcap_ce.softcap_ce_backward_reference(logits.float(), targets, lse, g, 15.0), dtype)


@pytest.mark.neuron
@neuron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qknorm_kernel_matches_reference(dtype):
    B, T_, H, D = 2, 256, 5, 128
    x, g = torch.randn(B, T_, H, D, dtype=dtype), torch.randn(B, T_, H, D, dtype=dtype)
    cos, sin = T.rotary_tables(T_, D, 10000.0)
    xn = x.to("neuron").requires_grad_()
    y = rope_qknorm.RopeQKNormFunction.apply(xn, cos.to("neuron"), sin.to("neuron"), 1e-6, True)
    (dx,) = torch.autograd.grad(y, xn, g.to("neuron"))
    _close(y, rope_qknorm.rope_qknorm_forward_reference(x.float(), cos, sin, 1e-6), dtype)
    _close(dx, rope_qknorm.rope_qknorm_backward_reference(x.float(), cos, sin, g.float(), 1e-6), dtype)
