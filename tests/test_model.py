"""train.py's model and devices sections: the training loss (what the scorer reads, an edit to it, torch.compile
through the gpu preset) and a CPU's dtype and peak, measured."""
from __future__ import annotations

import json
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
    profile = T.device_profile("cpu", "fp32", peak_tflops=1.0)
    model = tiny_gpt()
    compiled = torch.compile(model, backend=profile.compile_backend, dynamic=False)  # as train() does
    idx = torch.randint(0, VOCAB, (2, 25), generator=torch.Generator().manual_seed(3))
    eager, eager_grads = loss_and_grads(model, model, idx[:, :-1], idx[:, 1:])
    got, got_grads = loss_and_grads(model, compiled, idx[:, :-1], idx[:, 1:])
    assert torch.allclose(got, eager, rtol=1e-5, atol=0)
    for name, g in eager_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=0, atol=1e-4 * g.abs().max().item()), name
        assert g.abs().max() > 0, name  # every parameter took part


def test_a_cpu_matmul_is_timed_by_its_best_single_thread_call(monkeypatch):
    """Interference only slows a call: the fastest timed call of each matmul counts, on one thread, and the thread
    count is put back; a slow call is not repeated past CPU_MATMUL_SECONDS."""
    threads = torch.get_num_threads()
    seen_threads, clock = [], [0.0]
    durations = iter([0.5, 0.004, 0.002, 0.003, 0.005, 2.0])  # seconds per timed call; the first one interrupted

    def fake_matmul(a, b, out):
        seen_threads.append(torch.get_num_threads())
        clock[0] += next(durations)

    monkeypatch.setattr(T.torch, "matmul", fake_matmul)
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    assert T.time_matmuls([(64, 32, 16)], torch.float32) == pytest.approx(0.002)
    assert seen_threads == [1] * T.CPU_MATMUL_CALLS and torch.get_num_threads() == threads
    assert T.time_matmuls([(64, 32, 16)], torch.float32) == 2.0 and len(seen_threads) == T.CPU_MATMUL_CALLS + 1


def test_the_matmuls_are_the_models_own(monkeypatch):
    config = T.model_config(T.parse_command_line(["--preset", "cpu"])[0])
    assert T.model_matmuls(config, 16 * 256) == [(4096, 192, 768), (4096, 768, 192), (4096, 192, 8192)]
    assert T.model_matmuls(config, 8 * 2048)[0][0] == T.CPU_MATMUL_MAX_ROWS


def fake_cpu(monkeypatch, bf16_seconds: float, fp32_seconds: float = 0.2) -> list:
    """time_matmuls as a machine whose matmuls take these seconds; returns the list of dtypes it timed."""
    timed = []

    def fake(shapes, dtype):
        timed.append(dtype)
        return bf16_seconds if dtype == torch.bfloat16 else fp32_seconds
    monkeypatch.setattr(T, "time_matmuls", fake)
    return timed


@pytest.mark.parametrize("bf16_seconds, expected", [(0.08, torch.bfloat16), (0.27, None), (0.2, None)])
def test_auto_dtype_on_a_cpu_is_the_faster_one_measured_once_per_machine(monkeypatch, bf16_seconds, expected):
    """A CPUID flag says bf16 exists, not that it is fast (one Xeon without AMX runs it 1.36x slower than fp32): `--dtype
    auto` on a CPU takes the faster of the two at the model's matmuls, a tie to fp32, measured once per machine and
    kept; an explicit --dtype is always obeyed; MFU's peak is the chosen dtype's."""
    timed = fake_cpu(monkeypatch, bf16_seconds)
    matmuls = [(4096, 192, 768), (4096, 768, 192), (4096, 192, 8192)]
    profile = T.device_profile("cpu", "auto", matmuls=matmuls)
    assert profile.compute_dtype is expected and len(timed) == 2
    seconds = bf16_seconds if expected else 0.2
    assert profile.peak_flops == pytest.approx(sum(2 * m * k * n for m, k, n in matmuls) / seconds * T.cpu_threads())
    assert f"{1e3 * bf16_seconds:.1f} ms in bf16 and 200.0 ms in fp32" in profile.dtype_source
    assert T.device_profile("cpu", "auto", matmuls=matmuls).compute_dtype is expected and len(timed) == 2  # kept
    assert T.device_profile("cpu", "bf16", matmuls=matmuls).compute_dtype is torch.bfloat16
    assert T.device_profile("cpu", "fp32", matmuls=matmuls).compute_dtype is None and len(timed) == 2
    T.device_profile("cpu", "auto", matmuls=matmuls[:2])  # other matmuls: measured too
    monkeypatch.setattr(T, "cpu_name", lambda: "another processor")
    T.device_profile("cpu", "auto", matmuls=matmuls)
    assert len(timed) == 6
    assert T.compute_dtype_for("cpu", "bf16") is torch.bfloat16 and T.compute_dtype_for("cpu", "fp32") is None
    assert T.compute_dtype_for("cpu") is None  # auto with nothing measured (a checkpoint scored): fp32


def test_a_damaged_table_of_timings_is_measured_again(monkeypatch):
    """A table of timings a crash or an edit damaged is measured again and rewritten, never trusted nor fatal."""
    timed = fake_cpu(monkeypatch, 0.1)
    T.machine_file().parent.mkdir(parents=True, exist_ok=True)
    key = "%s | torch %s | matmuls [(8, 8, 8)]" % (T.cpu_name(), torch.__version__)
    for bad in ("{not json", "[1, 2]", json.dumps({key: {"fp32": 0, "bf16": 1}}), json.dumps({key: {"fp32": "x"}})):
        T.machine_file().write_text(bad)
        assert T.device_profile("cpu", "auto", matmuls=[(8, 8, 8)]).compute_dtype is torch.bfloat16
        assert json.loads(T.machine_file().read_text())[key] == {"fp32": 0.2, "bf16": 0.1}
    assert len(timed) == 8  # each damaged table measured again, both dtypes


def test_a_checkpoint_is_scored_in_the_dtype_it_trained_in(tmp_path):
    model = tiny_gpt()
    for dtype, expected in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("auto", torch.float32)):
        T.save_checkpoint(tmp_path / "final.pt", model, {"recipe": {"dtype": dtype}})
        assert T.load_for_eval(str(tmp_path / "final.pt"), torch.device("cpu")).compute_dtype is expected
