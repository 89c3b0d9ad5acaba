"""kernels/ and train.py's inline relu^2 kernel.

- Each PyTorch reference matches the eager composition of PyTorch ops (value and float64 gradient).
- Each NKI kernel, forward and backward, runs on CPU through the public op (the launcher, the choice
  of kernel or reference, the autograd Function) and matches its reference: grids 1 and 2, fp32 and
  bf16, shapes the kernels take and shapes that fall back. The kernels execute on the NKI emulator
  (tests/nki_emulator.py), which the `kit` fixture installs as the `nki` package before importing
  the kernel modules; with the real nki installed they run on `nki.simulate` (NKI_SIMULATOR=1).
- The same comparisons run on a Trainium machine (tests marked `neuron`, skipped elsewhere), at
  the logical core count the process was started with:
      NEURON_LOGICAL_NC_CONFIG=1 python -m pytest -q -m neuron tests/test_kernels.py
      NEURON_LOGICAL_NC_CONFIG=2 python -m pytest -q -m neuron tests/test_kernels.py
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import nki_emulator
from helpers import REPO
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
    assert not common.pick_kernel("rmsnorm", x, True, "", 256)
    assert rmsnorm.kernel_fits(x) and not rmsnorm.kernel_fits(torch.randn(3, 64))
    assert softcap_ce.kernel_fits(torch.randn(256, 8192)) and not softcap_ce.kernel_fits(torch.randn(256, 8193))
    assert rope_qknorm.kernel_fits(torch.randn(1, 256, 5, 128)) and not rope_qknorm.kernel_fits(torch.randn(1, 100, 5, 128))


def keep_ops(monkeypatch, train_module) -> dict:
    """The ops a --nki-* flag may replace, as they are now; put back after the test whatever is bound."""
    ops = {op: getattr(train_module, op) for op in train_module.KERNEL_OPS.values()}
    for op, fn in ops.items():
        monkeypatch.setattr(train_module, op, fn)
    return ops


def test_train_py_binds_each_flags_kernel_in_place_of_its_op_and_cpu_tensors_run_the_reference(monkeypatch):
    plain = keep_ops(monkeypatch, T)
    x = torch.randn(4, 8)
    assert torch.equal(T.norm(x), F.rms_norm(x, (8,)))  # unbound: the PyTorch op
    options = T.RunOptions(nki_rmsnorm=True, nki_softcap_ce=True, nki_rope_qknorm=True, nki_relu2=True)
    T.bind_kernels(options)
    assert {op for op, fn in plain.items() if getattr(T, op) is not fn} == set(T.KERNEL_OPS.values())
    assert T.norm is rmsnorm.rms_norm and T.rope_qknorm is rope_qknorm.rope_qknorm
    assert T.relu_squared is T.relu_squared_nki
    assert T.training_loss.args == (softcap_ce.softcap_cross_entropy,)
    assert torch.allclose(T.norm(x), F.rms_norm(x, (8,)), atol=1e-6)  # a CPU tensor takes the reference
    assert torch.equal(T.relu_squared(x), F.relu(x).square())


# --- the launch: logical core count, nki version, flags ---------------------------------------------

@pytest.mark.parametrize("value, cores", [("1", 1), ("2", 2), ("4", None), ("", None), (None, None)])
def test_logical_core_count_comes_from_the_environment(monkeypatch, value, cores):
    if value is None:
        monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    else:
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", value)
    if cores is None:
        with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG is .* set to 1 or 2"):
            common.logical_core_count()
    else:
        assert common.logical_core_count() == cores


@pytest.mark.parametrize("version, ok", [("0.4.0", True), ("0.5.0b1", True), ("0.7.2", True), ("0.3.0", False),
                                         ("0.8.0", False), ("0.0.1", False), ("unknown", False), (None, False)])
def test_nki_versions_outside_the_checked_range_are_refused(version, ok):
    problem = common.nki_version_problem(version)
    assert (problem is None) == ok
    if not ok:
        assert "nki 0.4 to 0.7" in problem


# --- kernels vs references: the shared comparisons ----------------------------------------------------
# Tolerances: the largest absolute difference from the fp32 PyTorch reference on the same inputs, over
# the largest |reference| (at least 1). fp32 outputs: 1e-4, for sums taken in another order; bf16
# outputs: 2e-2, a few roundings to bf16's 8 significant bits. The loss of softcap_ce is fp32 either way.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _close(got, want, dtype):
    diff = (got.detach().float().cpu() - want.float().cpu()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert diff <= TOLERANCE[dtype] * scale, f"max abs diff {diff} > {TOLERANCE[dtype]} x {scale}"


def _grad(y, x, g):
    return torch.autograd.grad(y, x, g)[0]


def relu2_case(shape, dtype):
    x, g = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)

    def run(kit, dev):
        xd = x.to(dev).requires_grad_()
        y = kit.train.relu_squared_nki(xd)
        return y, _grad(y, xd, g.to(dev))
    return run, [(T.relu2_forward_reference(x.float()), dtype),
                 (T.relu2_backward_reference(x.float(), g.float()), dtype)]


def rmsnorm_case(shape, dtype, eps=1e-6):
    x, g = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)

    def run(kit, dev):
        xd = x.to(dev).requires_grad_()
        y = kit.rmsnorm.rms_norm(xd, eps)
        return y, _grad(y, xd, g.to(dev))
    y, rstd = rmsnorm.rmsnorm_forward_reference(x.float(), eps)
    return run, [(y, dtype), (rmsnorm.rmsnorm_backward_reference(x.float(), rstd, g.float()), dtype)]


def softcap_ce_case(shape, dtype, cap=15.0):
    n, v = shape
    logits, targets, g = (torch.randn(n, v) * 8).to(dtype), torch.randint(0, v, (n,)), torch.rand(n)

    def run(kit, dev):
        ld = logits.to(dev).requires_grad_()
        loss = kit.softcap_ce.softcap_cross_entropy(ld, targets.to(dev), cap)
        return loss, _grad(loss, ld, g.to(dev))
    loss, lse = softcap_ce.softcap_ce_forward_reference(logits.float(), targets, cap)
    return run, [(loss, torch.float32), (softcap_ce.softcap_ce_backward_reference(logits.float(), targets, lse, g, cap),
                                         dtype)]


def rope_qknorm_case(shape, dtype, eps=1e-6):
    B, T_, H, D = shape
    x, g = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    cos, sin = T.rotary_tables(T_, D, 10000.0)

    def run(kit, dev):
        xd = x.to(dev).requires_grad_()
        y = kit.rope_qknorm.rope_qknorm(xd, cos.to(dev), sin.to(dev), eps)
        return y, _grad(y, xd, g.to(dev))
    return run, [(rope_qknorm.rope_qknorm_forward_reference(x.float(), cos, sin, eps), dtype),
                 (rope_qknorm.rope_qknorm_backward_reference(x.float(), cos, sin, g.float(), eps), dtype)]


CASES = {"relu2": relu2_case, "rmsnorm": rmsnorm_case, "softcap_ce": softcap_ce_case, "rope_qknorm": rope_qknorm_case}


def check(kit, op: str, shape, dtype, device: str) -> None:
    """The op's forward output and input gradient on `device` match the fp32 reference on CPU."""
    torch.manual_seed(0)
    run, want = CASES[op](shape, dtype)
    for got, (ref, tol_dtype) in zip(run(kit, device), want):
        assert got.shape == ref.shape
        _close(got, ref, tol_dtype)


SHAPES = [  # op, shape, the grids (logical core counts) whose kernels take it; others fall back
    ("relu2", (2, 128, 48), (1, 2)),
    ("relu2", (128, 40), (1,)),  # one 128-row tile: no even split over two cores
    ("relu2", (3, 50, 16), ()),  # 150 rows
    ("relu2", (128, 8200), ()),  # wider than RELU2_MAX_WIDTH
    ("rmsnorm", (256, 64), (1, 2)),
    ("rmsnorm", (2, 192, 96), (1,)),  # three tiles
    ("rmsnorm", (130, 64), ()),
    ("rmsnorm", (128, 4097), ()),
    ("softcap_ce", (256, 320), (1, 2)),
    ("softcap_ce", (384, 100), (1,)),
    ("softcap_ce", (100, 50), ()),
    ("softcap_ce", (128, 8193), ()),
    ("rope_qknorm", (2, 128, 3, 16), (1, 2)),
    ("rope_qknorm", (1, 128, 2, 16), (1,)),
    ("rope_qknorm", (1, 5, 2, 6), ()),
    ("rope_qknorm", (1, 128, 33, 128), ()),  # H * D over MAX_ROW_WIDTH
]


# --- the kernels on CPU: the emulator, or nki.simulate when the real nki is installed ----------------

def _real_nki():
    try:
        import nki
    except ImportError:
        return None
    return nki if hasattr(nki, "simulate") and not getattr(nki, "EMULATED", False) else None


REAL_NKI = _real_nki()
KIT_PACKAGES = ("nki", "kernels")


def _kit_namespace(mods, train_module):
    return types.SimpleNamespace(common=mods["kernels.common"], rmsnorm=mods["kernels.rmsnorm"],
                                 softcap_ce=mods["kernels.softcap_ce"], rope_qknorm=mods["kernels.rope_qknorm"],
                                 train=train_module, nki=mods["nki"], nl=mods["nki.language"], nisa=mods["nki.isa"])


@pytest.fixture(scope="module")
def emulated_kit():
    """The kernel modules and train.py, imported anew with the emulator as `nki` (so HAS_NKI is
    true and the @nki.jit kernels exist), then taken out of sys.modules again: (kit, modules)."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in KIT_PACKAGES}
    try:
        sys.modules.update(nki_emulator.modules())
        for name in ("kernels.common", "kernels.rmsnorm", "kernels.softcap_ce", "kernels.rope_qknorm"):
            importlib.import_module(name)
        spec = importlib.util.spec_from_file_location("train_on_nki_emulator", REPO / "train.py")
        train_module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = train_module
        spec.loader.exec_module(train_module)
        mods = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] in KIT_PACKAGES}
    finally:
        sys.modules.pop("train_on_nki_emulator", None)
        for name in [n for n in sys.modules if n.split(".")[0] in KIT_PACKAGES]:
            del sys.modules[name]
        sys.modules.update(saved)
    assert train_module.HAS_NKI and mods["kernels.common"].HAS_NKI
    return _kit_namespace(mods, train_module), mods


@pytest.fixture
def kit(request, monkeypatch):
    """The kit with kernels that run on CPU tensors, for one test. The emulated modules go back into
    sys.modules for the test, since train.py imports kernels/ lazily."""
    if REAL_NKI is not None:  # this branch needs AWS's nki package; it has not run where that is missing
        monkeypatch.setenv("NKI_SIMULATOR", "1")
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
        mods = {name: importlib.import_module(name) for name in ("nki", "nki.language", "nki.isa", "kernels.common",
                                                                   "kernels.rmsnorm", "kernels.softcap_ce",
                                                                   "kernels.rope_qknorm")}
        the_kit = _kit_namespace(mods, T)
    else:
        the_kit, mods = request.getfixturevalue("emulated_kit")
        for name, mod in mods.items():
            monkeypatch.setitem(sys.modules, name, mod)
    for module in (the_kit.common, the_kit.train):  # train.py's copy of the helpers, and kernels/common.py
        monkeypatch.setattr(module, "KERNEL_DEVICE", "cpu")
        monkeypatch.setattr(module, "_NOTICES", set())
    keep_ops(monkeypatch, the_kit.train)
    return the_kit


def launches() -> int:
    return len(nki_emulator.LAUNCHES)


@pytest.mark.parametrize("grid", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op, shape, takes", SHAPES, ids=[f"{op}-{'x'.join(map(str, s))}" for op, s, _ in SHAPES])
def test_kernels_match_their_references_on_cpu(kit, monkeypatch, capsys, op, shape, takes, dtype, grid):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(grid))
    before = launches()
    check(kit, op, shape, dtype, "cpu")
    notices = capsys.readouterr().out
    if grid in takes:
        assert "notice:" not in notices
        if REAL_NKI is None:  # forward and backward, each one launch of `grid` instances
            assert [r["grid"] for r in nki_emulator.LAUNCHES[before:]] == [grid, grid]
    else:
        assert "using the PyTorch reference" in notices and op in notices
        assert launches() == before


@pytest.mark.skipif(REAL_NKI is not None, reason="nki.simulate does not model SBUF capacity")
@pytest.mark.parametrize("op, shape", [("relu2", (128, 8192)), ("rmsnorm", (128, 4096)), ("softcap_ce", (128, 8192)),
                                       ("rope_qknorm", (1, 128, 32, 128))])
def test_kernels_at_their_width_limits_fit_the_sbuf_budget(kit, monkeypatch, op, shape):
    """The widest shape each kernel takes runs within SBUF_BUDGET_BYTES per partition (the emulator
    itself refuses more than trn2's 224 KiB)."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    before = launches()
    check(kit, op, shape, torch.float32, "cpu")
    records = nki_emulator.LAUNCHES[before:]
    assert len(records) == 2 and max(r["sbuf_peak"] for r in records) <= kit.common.SBUF_BUDGET_BYTES


def softcap_lse_kernel_without_reduce_cmd(nki, nl, nisa):
    """kernels/softcap_ce.py's softcap_lse_kernel with two mistakes a kernel author can make, to show that the
    comparison above catches them: its fused sum passes no reduce_cmd, so the default (idle) leaves ScalarE's
    registers alone and reduce_res reads stale values; and it does not split the row tiles over the cores."""
    PARTITIONS = 128

    @nki.jit
    def softcap_lse_kernel(logits, cap):
        n, v = logits.shape
        lse_out = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        for i in nl.affine_range(n // PARTITIONS):
            r0 = i * PARTITIONS
            raw = nl.ndarray((PARTITIONS, v), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=raw, src=logits[r0:r0 + PARTITIONS])
            z = nl.ndarray((PARTITIONS, v), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=z, op=nl.tanh, data=raw, scale=1.0 / cap)
            nisa.tensor_scalar(dst=z, data=z, op0=nl.multiply, operand0=cap, op1=nl.subtract, operand1=cap)
            sumexp = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=z, op=nl.exp, data=z, reduce_op=nl.add, reduce_res=sumexp)
            lse = nl.ndarray((PARTITIONS, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=lse, op=nl.log, data=sumexp)
            nisa.tensor_scalar(dst=lse, data=lse, op0=nl.add, operand0=cap)
            nisa.dma_copy(dst=lse_out[r0:r0 + PARTITIONS], src=lse)
        return lse_out
    return softcap_lse_kernel


def test_the_softcap_ce_comparison_fails_on_a_kernel_that_reads_stale_sums(kit, monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")  # (the broken kernel has no row split either)
    check(kit, "softcap_ce", (256, 320), torch.float32, "cpu")  # the kit's kernel passes ...
    broken_kernel = softcap_lse_kernel_without_reduce_cmd(kit.nki, kit.nl, kit.nisa)
    monkeypatch.setattr(kit.softcap_ce, "softcap_lse_kernel", broken_kernel)
    with pytest.raises(AssertionError, match="max abs diff"):  # ... and the same check fails on the broken one
        check(kit, "softcap_ce", (256, 320), torch.float32, "cpu")


@pytest.mark.skipif(REAL_NKI is not None, reason="the race check is the emulator's")
def test_a_kernel_without_the_row_split_is_caught_on_two_cores(kit, monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    broken_kernel = softcap_lse_kernel_without_reduce_cmd(kit.nki, kit.nl, kit.nisa)
    monkeypatch.setattr(kit.softcap_ce, "softcap_lse_kernel", broken_kernel)
    with pytest.raises(nki_emulator.EmulatorError, match="both write"):
        check(kit, "softcap_ce", (256, 320), torch.float32, "cpu")


CONFIG = T.model_config(T.parse_command_line(["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
                                               "--seq-len", "32"])[0])


def softcap_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    """The loss --nki-softcap-ce computes, written out here: the tests of the flag put it in place of train.py's
    training_loss, which a participant's edit (a z-loss, say) changes."""
    logits = cap * torch.tanh(logits.float() / cap)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def bound(train_module, plain: dict) -> set[str]:
    """The ops that have a kernel bound in their place."""
    return {op for op, fn in plain.items() if getattr(train_module, op) is not fn}


def test_setup_kernels_stops_clearly_when_a_kernel_cannot_run(kit, monkeypatch):
    monkeypatch.setattr(kit.train, "training_loss", softcap_cross_entropy)
    plain = {op: getattr(kit.train, op) for op in kit.train.KERNEL_OPS.values()}
    options = T.RunOptions(nki_rmsnorm=True, nki_softcap_ce=True)  # ops every model calls
    with pytest.raises(SystemExit, match="--nki-rmsnorm --nki-softcap-ce run NKI kernels, which need the neuron device"):
        kit.train.setup_kernels(options, "cpu", CONFIG)
    with pytest.raises(SystemExit, match="--compile with --nki-rmsnorm --nki-softcap-ce: .* drop --compile"):
        kit.train.setup_kernels(T.RunOptions(nki_rmsnorm=True, nki_softcap_ce=True, compile=True), "neuron", CONFIG)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG is None"):
        kit.train.setup_kernels(options, "neuron", CONFIG)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setattr(kit.common, "installed_nki_version", lambda: "0.3.0")
    with pytest.raises(SystemExit, match="nki 0.3.0 is installed"):
        kit.train.setup_kernels(options, "neuron", CONFIG)
    with pytest.raises(RuntimeError, match="nki 0.3.0 is installed"):
        kit.rmsnorm.rms_norm(torch.randn(256, 64))
    assert bound(kit.train, plain) == set()
    monkeypatch.setattr(kit.common, "installed_nki_version", lambda: "0.4.0")
    kit.train.setup_kernels(options, "neuron", CONFIG)
    assert bound(kit.train, plain) == {"norm", "training_loss"}
    kit.train.setup_kernels(T.RunOptions(), "cpu", CONFIG)  # no flag: nothing to check


def test_a_kernel_flag_whose_op_the_model_never_calls_is_one_clear_error(kit, monkeypatch):
    """Replacing relu^2 by SwiGLU, or the loss by another function, leaves a --nki-* flag nothing to replace: an
    error (before the device checks, so on any machine), never a flag that silently does nothing."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    plain = {op: getattr(kit.train, op) for op in kit.train.KERNEL_OPS.values()}
    kit_forward = kit.train.GPT.forward

    def own_loss(self, idx, targets=None, **kwargs):  # a participant's loss, written in the forward itself
        logits = kit_forward(self, idx, **kwargs)
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    monkeypatch.setattr(kit.train.GPT, "forward", own_loss)
    with pytest.raises(SystemExit, match=r"--nki-softcap-ce replaces training_loss\(\), which this model never "
                                         "calls"):
        kit.train.setup_kernels(T.RunOptions(nki_softcap_ce=True), "cpu", CONFIG)
    monkeypatch.setattr(kit.train.GPT, "forward", kit_forward)

    def without_relu2(self, x):  # a participant's MLP that calls no relu_squared (a SwiGLU, say; here: nothing)
        return 0 * x

    monkeypatch.setattr(kit.train.MLP, "forward", without_relu2)
    with pytest.raises(SystemExit, match=r"--nki-relu2 replaces relu_squared\(\), which this model never calls"):
        kit.train.setup_kernels(T.RunOptions(nki_relu2=True), "neuron", CONFIG)
    assert kit.train.forward_on_meta(CONFIG).ops == {"norm", "rope_qknorm", "training_loss"}
    assert bound(kit.train, plain) == set()


def test_train_py_and_kernels_common_share_one_vocabulary(kit, monkeypatch, capsys):
    """train.py's copy of the kernel helpers (it may run without kernels/) matches kernels/common.py: the same
    names, constants and decisions of pick_kernel, the same launch and logical core count."""
    names = ("HAS_NKI", "PARTITIONS", "KERNEL_DEVICE", "notice_once", "logical_core_count", "launch", "pick_kernel")
    assert all(hasattr(kit.train, n) and hasattr(kit.common, n) for n in names)
    assert (kit.train.HAS_NKI, kit.train.PARTITIONS) == (kit.common.HAS_NKI, kit.common.PARTITIONS)
    monkeypatch.setattr(kit.common, "installed_nki_version", lambda: "0.4.0")
    for cores in ("1", "2"):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", cores)
        assert kit.train.logical_core_count() == kit.common.logical_core_count() == int(cores)
        for x, fits, rows in ((torch.randn(256, 8), True, 256), (torch.randn(128, 8), True, 128),
                              (torch.randn(256, 8), False, 256), (torch.randn(256, 8, device="meta"), True, 256)):
            assert kit.train.pick_kernel("op", x, fits, "why", rows) == kit.common.pick_kernel("op", x, fits, "why", rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines and len(lines) % 2 == 0 and lines[::2] == lines[1::2]  # each notice said alike by both, once each


def test_the_inline_relu2_kernel_needs_nothing_from_kernels(kit, monkeypatch):
    """train.py's kernel stands alone, as the template it is: with kernels/ unimportable (a train.py
    copied into the organisers' kit), --nki-relu2 sets up and the kernel pair runs."""
    if "relu_squared" not in kit.train.forward_on_meta(CONFIG).ops:
        pytest.skip("this train.py's model calls no relu_squared: --nki-relu2 has nothing to replace")
    for name in [n for n in sys.modules if n.split(".")[0] == "kernels"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kernels", None)  # `import kernels...` now raises ImportError
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    plain = {op: getattr(kit.train, op) for op in kit.train.KERNEL_OPS.values()}
    kit.train.setup_kernels(T.RunOptions(nki_relu2=True), "neuron", CONFIG)
    assert bound(kit.train, plain) == {"relu_squared"}
    before = launches()
    check(kit, "relu2", (2, 128, 48), torch.float32, "cpu")
    if REAL_NKI is None:
        assert [r["grid"] for r in nki_emulator.LAUNCHES[before:]] == [2, 2]
    with pytest.raises(ImportError):
        kit.train.setup_kernels(T.RunOptions(nki_relu2=True, nki_rmsnorm=True), "neuron", CONFIG)


def test_the_training_loss_runs_the_softcap_ce_kernels_and_equals_the_recipes(kit, monkeypatch, capsys):
    """--nki-softcap-ce binds the kernel pair in place of training_loss: the model's loss and gradients equal
    the recipe's own function's."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setattr(kit.train, "training_loss", softcap_cross_entropy)
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 256, 320, generator=g)).requires_grad_()  # 512 rows: a tile per core each
    targets = torch.randint(0, 320, (2, 256), generator=g)
    before = launches()
    loss = kit.train.nki_kernel("nki_softcap_ce")(logits, targets, 15.0)
    loss.backward()
    assert "notice:" not in capsys.readouterr().out
    if REAL_NKI is None:  # the forward and the backward kernel
        assert [r["grid"] for r in nki_emulator.LAUNCHES[before:]] == [2, 2]
    recipe_logits = logits.detach().clone().requires_grad_()
    recipe = kit.train.training_loss(recipe_logits, targets, 15.0)
    recipe.backward()
    assert torch.allclose(loss, recipe, rtol=1e-5, atol=0)
    assert torch.allclose(logits.grad, recipe_logits.grad, rtol=0, atol=1e-5 * recipe_logits.grad.abs().max().item())


def test_the_softcap_ce_flag_refuses_a_training_loss_it_does_not_compute(kit, monkeypatch):
    """An auxiliary term edited into training_loss would be silently dropped by the kernel: an error instead."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    kit_loss = softcap_cross_entropy
    monkeypatch.setattr(kit.train, "training_loss",
                        lambda logits, targets, cap: kit_loss(logits, targets, cap) + 1e-4 * logits.float().square().mean())
    with pytest.raises(SystemExit, match="--nki-softcap-ce computes the softcap cross-entropy, and this train.py's "
                                         "training_loss computes something else"):
        kit.train.setup_kernels(T.RunOptions(nki_softcap_ce=True), "neuron", CONFIG)
    assert kit.train.kernel_loss_difference(kit_loss) < 1e-6


# --- the same comparisons on a Trainium machine --------------------------------------------------------

def _neuron_available() -> bool:
    try:
        return common.HAS_NKI and T.detect_device_type() == "neuron"
    except Exception:
        return False


neuron = pytest.mark.skipif(not _neuron_available(), reason="needs a Trainium (neuron) device and nki")
DEVICE_SHAPES = [  # the baseline's shapes, at the default width (640) and vocabulary (8192)
    ("relu2", (8, 256, 2560), (1, 2)),
    ("rmsnorm", (4, 256, 640), (1, 2)),
    ("softcap_ce", (512, 8192), (1, 2)),
    ("rope_qknorm", (2, 256, 5, 128), (1, 2)),
]


@pytest.mark.neuron
@neuron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op, shape, takes", DEVICE_SHAPES + SHAPES,
                         ids=[f"{op}-{'x'.join(map(str, s))}" for op, s, _ in DEVICE_SHAPES + SHAPES])
def test_kernels_match_their_references_on_trainium(monkeypatch, capsys, op, shape, takes, dtype):
    grid = common.logical_core_count()  # fixed for the process: run once per NEURON_LOGICAL_NC_CONFIG
    monkeypatch.setattr(common, "_NOTICES", set())
    monkeypatch.setattr(T, "_NOTICES", set())
    device_kit = types.SimpleNamespace(common=common, rmsnorm=rmsnorm, softcap_ce=softcap_ce, rope_qknorm=rope_qknorm,
                                       train=T)
    check(device_kit, op, shape, dtype, "neuron")
    notices = capsys.readouterr().out
    assert ("using the PyTorch reference" in notices) == (grid not in takes), notices
