"""train.py's model and devices sections: the training loss (what the scorer reads, an edit to it, torch.compile
through the gpu preset) and the CPU matmul peak."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

TINY = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "24"]
VOCAB = 512  # a small head keeps the tests fast; the kit's tokenizer has 8192


def tiny_gpt(argv=(), vocab=VOCAB, dtype="fp32") -> T.GPT:
    """A GPT whose blocks all carry gradient: what init_weights starts at zero (each block the identity) is drawn."""
    torch.manual_seed(0)
    model = T.build_model(T.model_config(T.parse_command_line([*TINY, *argv])[0], vocab_size=vocab), dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.05)
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.02)
    return model


def loss_and_grads(model, step_model, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = step_model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)}


def test_the_scorer_reads_softcapped_logits_and_the_kits_loss_is_their_cross_entropy():
    """The scorer's forward returns fp32 logits within the softcap; training_loss, as the kit ships it, is the
    cross-entropy the scorer computes from them (an auxiliary term, in training_loss or the forward, changes the
    loss on purpose: the kit's training_loss is compared on its own, the model's only when it is the kit's)."""
    model = tiny_gpt()
    idx = torch.randint(0, VOCAB, (3, 25), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx[:, :-1])
    assert logits.shape == (3, 24, VOCAB) and logits.dtype == torch.float32 and logits.abs().max() <= 15.0
    raw = 8 * torch.randn(3, 24, VOCAB, generator=torch.Generator().manual_seed(2))
    if T.kernel_loss_difference(T.training_loss) < 1e-5:  # the kit's loss: the softcap cross-entropy
        expected = F.cross_entropy(T.softcap(raw, 15.0).flatten(0, 1), idx[:, 1:].flatten())
        assert torch.allclose(T.training_loss(raw, idx[:, 1:], 15.0), expected, rtol=1e-6, atol=0)


def test_an_auxiliary_term_in_training_loss_changes_what_the_default_run_minimises(monkeypatch):
    """The loss a participant sees is the loss that runs: a term added in training_loss (here a z-loss on the
    logits) changes the training loss of the model's forward and every gradient that reaches it."""
    model = tiny_gpt()
    idx = torch.randint(0, VOCAB, (3, 25), generator=torch.Generator().manual_seed(1))
    base, base_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:])
    kit_loss = T.training_loss

    def with_z_loss(logits, targets, cap):
        return kit_loss(logits, targets, cap) + 0.1 * torch.logsumexp(logits.float(), -1).square().mean()

    monkeypatch.setattr(T, "training_loss", with_z_loss)
    edited, edited_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:])
    assert edited > base + 1.0
    assert not torch.allclose(edited_grads["lm_head.weight"], base_grads["lm_head.weight"])
    assert not torch.allclose(edited_grads["wte.weight"], base_grads["wte.weight"])


@pytest.mark.slow
def test_gpu_preset_compiles_the_model_and_the_compiled_loss_equals_eager():
    """The gpu preset's code path (torch.compile with the device's backend) on CPU, shapes shrunk."""
    recipe, options, _ = T.parse_command_line(["--preset", "gpu", *TINY, "--device-batch-size", "2",
                                               "--total-batch-size", "48"])
    assert options.compile
    assert recipe.total_batch_size % (recipe.device_batch_size * recipe.seq_len) == 0
    profile = T.device_profile("cpu", "fp32")
    model = tiny_gpt()
    compiled = torch.compile(model, backend=profile.compile_backend, dynamic=False)  # as train() does
    idx = torch.randint(0, VOCAB, (2, 25), generator=torch.Generator().manual_seed(3))
    eager, eager_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:])
    got, got_grads = loss_and_grads(model, compiled, idx[:, :-1], idx[:, 1:])
    assert torch.allclose(got, eager, rtol=1e-5, atol=0)
    for name, g in eager_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=0, atol=1e-4 * g.abs().max().item()), name
        assert g.abs().max() > 0, name  # every parameter took part


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
    """A CPU without AVX-512 BF16 or AMX runs bf16 matmuls tens of times slower than fp32
    (docs/presets-and-benchmarks.md, "Benchmarks"), so `--dtype auto` trains in fp32 there; an explicit --dtype is
    always obeyed."""
    monkeypatch.setattr(T.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: fast_bf16)
    assert T.compute_dtype_for("cpu") is (torch.bfloat16 if fast_bf16 else None)
    assert T.compute_dtype_for("cpu", "bf16") is torch.bfloat16
    assert T.compute_dtype_for("cpu", "fp32") is None
    assert T.device_profile("cpu", "auto", peak_tflops=1.0).compute_dtype is (torch.bfloat16 if fast_bf16 else None)
