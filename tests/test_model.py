"""train.py's model and devices sections: the chunked training loss against the plain path (value,
gradient, memory, torch.compile through the gpu preset) and the CPU matmul peak."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import REPO

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

TINY = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "24"]
VOCAB = 512  # a small head keeps the tests fast; the kit's tokenizer has 8192


def plain_loss(h, weight, targets, cap):
    """The loss as the plain path computes it: full fp32 logits, softcap, F.cross_entropy."""
    return F.cross_entropy(cap * torch.tanh((h @ weight.T).float() / cap), targets)


def tiny_gpt(argv=(), vocab=VOCAB, dtype="fp32") -> T.GPT:
    """A GPT whose blocks all carry gradient (init_weights starts them at the identity)."""
    torch.manual_seed(0)
    model = T.build_model(T.model_config(T.parse_command_line([*TINY, *argv])[0], vocab_size=vocab), dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.05)
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.02)
            block.mlp.c_proj.weight.normal_(0, 0.02)
    return model


def loss_and_grads(model, step_model, idx, targets, chunked: bool):
    model.zero_grad(set_to_none=True)
    model.chunked_loss = chunked
    loss = step_model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_chunked_loss_passes_gradcheck_in_float64(monkeypatch):
    monkeypatch.setattr(T, "LOSS_CHUNKS", 3)  # 13 rows: slices of 5, 5 and 3
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 6, dtype=torch.float64, generator=g).requires_grad_()
    weight = torch.randn(11, 6, dtype=torch.float64, generator=g).requires_grad_()
    targets = torch.randint(0, 11, (13,), generator=g)
    loss = T.chunked_softcap_cross_entropy(h, weight, targets, 3.0, torch.float64)
    assert loss.dtype == torch.float64
    assert torch.allclose(loss, F.cross_entropy(3.0 * torch.tanh(h @ weight.T / 3.0), targets), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: T.chunked_softcap_cross_entropy(a, b, targets, 3.0, torch.float64),
                                    (h, weight))


def test_chunked_loss_equals_the_plain_path_on_the_gpt_in_fp32(monkeypatch):
    monkeypatch.setattr(T, "LOSS_CHUNKS", 5)  # 3 x 24 rows: four slices of 15, the last one of 12
    model = tiny_gpt()
    idx = torch.randint(0, VOCAB, (3, 25), generator=torch.Generator().manual_seed(1))
    plain, plain_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:], chunked=False)
    chunked, chunked_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:], chunked=True)
    assert plain.dtype == chunked.dtype == torch.float32
    assert torch.allclose(chunked, plain, rtol=1e-6, atol=0)
    for name, g in plain_grads.items():  # fp32 rounding relative to each gradient's scale
        assert torch.allclose(chunked_grads[name], g, rtol=0, atol=1e-5 * g.abs().max().item()), name
        assert g.abs().max() > 0, name  # every parameter took part
    # The scorer's forward (no targets) returns the softcapped logits whatever the flag says.
    with torch.no_grad():
        logits = model(idx[:, :-1])
        model.chunked_loss = False
        assert torch.equal(logits, model(idx[:, :-1]))
    assert logits.shape == (3, 24, VOCAB) and logits.dtype == torch.float32


def test_chunked_loss_in_bf16_matches_the_plain_path_to_bf16_rounding(monkeypatch):
    monkeypatch.setattr(T, "LOSS_CHUNKS", 5)
    model = tiny_gpt(dtype="bf16")
    idx = torch.randint(0, VOCAB, (3, 25), generator=torch.Generator().manual_seed(2))
    plain, plain_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:], chunked=False)
    chunked, chunked_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:], chunked=True)
    assert torch.allclose(chunked, plain, rtol=1e-5, atol=0)
    for name, g in plain_grads.items():
        # The head's weight gradient is rounded to bf16 per chunk instead of once for the batch.
        assert torch.allclose(chunked_grads[name], g, rtol=0, atol=2**-7 * g.abs().max().item()), name


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("chunked", [False, True], ids=["plain", "chunked"])
def test_only_the_plain_loss_builds_logits_of_the_whole_batch(monkeypatch, chunked):
    monkeypatch.setattr(T, "LOSS_CHUNKS", 6)
    rows, width, vocab = 96, 8, 300
    h = torch.randn(rows, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    with LargestTensor() as largest:
        loss = T.chunked_softcap_cross_entropy(h, weight, targets, 15.0, torch.float32) if chunked \
            else plain_loss(h, weight, targets, 15.0)
        loss.backward()
    assert largest.numel == (16 * vocab if chunked else rows * vocab)


def test_chunked_loss_without_gradients(monkeypatch):
    monkeypatch.setattr(T, "LOSS_CHUNKS", 3)
    h, weight = torch.randn(20, 8), torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (20,))
    with torch.no_grad():
        loss = T.chunked_softcap_cross_entropy(h, weight, targets, 15.0, torch.float32)
    assert not loss.requires_grad
    assert torch.allclose(loss, plain_loss(h, weight, targets, 15.0), rtol=1e-6, atol=0)
    # Only the weight needs a gradient: the forward still takes it.
    T.chunked_softcap_cross_entropy(h, weight, targets, 15.0, torch.float32).backward()
    expected = weight.detach().clone().requires_grad_()
    plain_loss(h, expected, targets, 15.0).backward()
    assert torch.allclose(weight.grad, expected.grad, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_gpu_preset_compiles_the_model_and_the_compiled_loss_equals_eager(monkeypatch):
    """The gpu preset's code path (torch.compile with the device's backend) on CPU, shapes shrunk."""
    monkeypatch.setattr(T, "LOSS_CHUNKS", 3)  # 2 x 24 rows: slices of 16
    recipe, options, _ = T.parse_command_line(["--preset", "gpu", *TINY, "--device-batch-size", "2",
                                               "--total-batch-size", "48"])
    assert options.compile and options.chunked_loss
    assert recipe.total_batch_size % (recipe.device_batch_size * recipe.seq_len) == 0
    profile = T.device_profile("cpu", "fp32")
    model = tiny_gpt()
    compiled = torch.compile(model, backend=profile.compile_backend, dynamic=False)  # as train() does
    idx = torch.randint(0, VOCAB, (2, 25), generator=torch.Generator().manual_seed(3))
    eager, eager_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:], chunked=False)
    got, got_grads = loss_and_grads(model, compiled, idx[:, :-1], idx[:, 1:], chunked=True)
    assert torch.allclose(got, eager, rtol=1e-5, atol=0)
    for name, g in eager_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=0, atol=1e-4 * g.abs().max().item()), name


def test_cpu_peak_is_the_best_single_thread_call_times_the_threads(monkeypatch):
    """Interference only slows a call: the fastest call of each size counts, run on one thread, and the
    thread count is put back."""
    threads = torch.get_num_threads()
    seen_threads, durations = [], iter([1.0, 0.004, 0.002])  # seconds per timed call; the first one interrupted
    clock = [0.0]

    def fake_matmul(a, b, out):
        seen_threads.append(torch.get_num_threads())
        clock[0] += next(durations) if len(seen_threads) > 1 else 0.0  # the first (warm-up) call is untimed

    monkeypatch.setattr(T.torch, "matmul", fake_matmul)
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(T, "cpu_threads", lambda: 3)
    peak = T.measure_matmul_flops(torch.float32, sizes=(64,), seconds=0.0)
    assert seen_threads == [1] * (1 + T.CPU_PEAK_MIN_CALLS)  # the warm-up call, then the timed ones
    assert peak == pytest.approx(3 * 2 * 64**3 / 0.002)
    assert torch.get_num_threads() == threads


def test_cpu_profile_says_how_the_peak_was_measured():
    profile = T.device_profile("cpu", "fp32")
    assert profile.peak_flops > 1e9 and profile.compute_dtype is None
    assert "1-thread fp32 matmul" in profile.peak_source and f"x {T.cpu_threads()} threads" in profile.peak_source


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_auto_dtype_on_a_cpu_is_bf16_only_where_onednn_has_fast_bf16(monkeypatch, fast_bf16):
    """A CPU without AVX-512 BF16 or AMX runs bf16 matmuls tens of times slower than fp32 (README,
    "Benchmarks"), so `--dtype auto` trains in fp32 there; an explicit --dtype is always obeyed."""
    monkeypatch.setattr(T.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: fast_bf16)
    assert T.compute_dtype_for("cpu") is (torch.bfloat16 if fast_bf16 else None)
    assert T.compute_dtype_for("cpu", "bf16") is torch.bfloat16
    assert T.compute_dtype_for("cpu", "fp32") is None
    assert T.device_profile("cpu", "auto", peak_tflops=1.0).compute_dtype is (torch.bfloat16 if fast_bf16 else None)
