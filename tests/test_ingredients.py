"""The recipe's ingredients (value embeddings, sliding windows) and the stop rule: each ingredient is off by
default, wired into the forward, the parameter table and the FLOPs count, causal, and exact on packed rows; a
slow first step never ends a run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, every_ingredient, flags_for, prepare_in_process

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

from conftest import TINY_TRAIN_ARGS  # noqa: E402

VOCAB = 512
SHAPE = ["--depth", "4", "--aspect-ratio", "16", "--head-dim", "16", "--seq-len", "32"]
EVERY_INGREDIENT = flags_for({**every_ingredient(), "short_window": 5})  # train.py's list of ingredients
ONE_AT_A_TIME = {name: flags_for({name: on}) for name, on in every_ingredient().items()}


def gpt(argv=(), seed=0, dtype="fp32", perturb=True) -> T.GPT:
    """A small GPT whose every weight matters: init_weights starts several at zero (output projections, the
    value embeddings' gates), so everything is perturbed."""
    torch.manual_seed(seed)
    model = T.build_model(T.model_config(T.parse_command_line([*SHAPE, *argv])[0], vocab_size=VOCAB), dtype=dtype)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_every_ingredient_is_off_by_default_and_only_adds_to_the_baseline():
    off = {name: getattr(T.Architecture(), name) for name in every_ingredient()}
    baseline, explicit_off = gpt(perturb=False), gpt(flags_for(off), perturb=False)
    every = gpt(EVERY_INGREDIENT, perturb=False)
    assert baseline.state_dict().keys() == explicit_off.state_dict().keys() < every.state_dict().keys()
    assert all(getattr(T.Recipe().architecture, name) != on for name, on in every_ingredient().items())


@pytest.mark.parametrize("name", sorted(ONE_AT_A_TIME))
def test_each_ingredient_is_wired_in(name):
    """Its parameters exist only with its flag, each gets a gradient, each has a row in the parameter table,
    and the logits differ from the baseline's with the same shared weights."""
    model, baseline = gpt(ONE_AT_A_TIME[name]), gpt()
    added = set(model.state_dict()) - set(baseline.state_dict())
    assert bool(added) == (name != "window_pattern"), added
    idx = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    model(idx[:, :-1], idx[:, 1:]).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, pname
    groups = T.parameter_groups(model, T.Recipe())
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    shared = {k: v for k, v in model.state_dict().items() if k in baseline.state_dict()}
    baseline.load_state_dict(shared)
    with torch.no_grad():
        assert not torch.allclose(model(idx), baseline(idx), atol=1e-3)


def test_windows_shorten_attention_in_the_flops_count():
    """The matmuls are counted as a training step runs them (tests/test_edits.py, every ingredient on included);
    a window layer's attention covers its window."""
    full, windows = gpt(perturb=False), gpt(flags_for({"window_pattern": "SSSL", "short_window": 5}), perturb=False)
    c = full.config
    assert windows.config.windows == [5, 5, 5, c.sequence_len]  # SSSL over 4 layers, the last one L
    assert full.config.windows == [c.sequence_len] * 4  # L: the whole training row
    assert windows.flops_per_token() == full.flops_per_token() - 3 * 12 * c.n_embd * (c.sequence_len - 5)


def test_no_layer_looks_further_back_than_a_training_row_in_a_longer_row():
    """The scorer reads rows longer than the training rows (1,024 against the cpu preset's 256): there a full-context
    layer attends over the last sequence_len tokens, the distances it trained at, and nothing changes within a
    training row's length."""
    model = gpt(["--depth", "1"], perturb=True)  # one layer: what it sees is what its window lets in
    n = model.config.sequence_len
    idx = torch.randint(0, VOCAB, (1, 3 * n), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        long = model(idx)
        assert torch.equal(model(idx[:, :n]), long[:, :n])  # within a training row: causal, as before
        shifted = idx.clone()
        shifted[:, :n] = (shifted[:, :n] + 1) % VOCAB  # tokens more than a row back from position 2n + 5 on
        assert torch.allclose(model(shifted)[:, 2 * n + 5:], long[:, 2 * n + 5:], atol=1e-5)
        assert not torch.allclose(model(shifted)[:, n + 5:2 * n - 5], long[:, n + 5:2 * n - 5], atol=1e-5)


def test_bad_ingredient_flags_are_clear_errors(tmp_path):
    for argv, message in ((["--value-embeds", "odd"], "--value-embeds 'odd'"),
                          (["--window-pattern", "SXL"], "the letters L"),
                          (["--window-pattern", "S", "--short-window", "-3"], "at least 1 token")):
        with pytest.raises(ValueError, match=message):
            T.model_config(T.parse_command_line([*SHAPE, *argv])[0])
    run = subprocess.run([sys.executable, str(REPO / "train.py"), "--window-pattern", "SQ"], cwd=tmp_path,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 1 and "--window-pattern 'SQ'" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_ingredient_is_causal_and_batch_independent(dtype):
    model = gpt(EVERY_INGREDIENT, dtype=dtype).eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, VOCAB, (3, 32), generator=g)
    with torch.no_grad():
        full = model(x)
        for cut in (1, 6, 17, 31):
            changed = x.clone()
            changed[:, cut:] = torch.randint(0, VOCAB, (3, 32 - cut), generator=g)
            assert torch.equal(model(changed)[:, :cut], full[:, :cut]), cut
            assert not torch.equal(model(changed)[:, cut:], full[:, cut:])
        alone = model(x[1:2])
    tolerance = 1e-5 if dtype == "fp32" else 0.05
    torch.testing.assert_close(alone, full[1:2], atol=tolerance, rtol=0)


def test_window_masks_follow_rotary_positions():
    model = gpt(["--window-pattern", "SL", "--short-window", "3"], perturb=False)
    short, full = model.layer_masks(6, None, None)[:2]
    assert full is None  # the full-context layer keeps the fast causal path
    i, j = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    assert torch.equal(short[0, 0], (j <= i) & (i - j < 3))
    positions = torch.tensor([[0, 1, 2, 3, 2, 3]])  # a prefix of 2, continuations [2, 3] and [2, 3]
    segments = torch.tensor([[0, 0, 1, 1, 2, 2]])
    packed = (torch.ones(6, 6, dtype=torch.bool).tril() & ((segments[:, None, :] == 0) |
                                                          (segments[:, None, :] == segments[:, :, None])))[:, None]
    windowed = model.layer_masks(6, positions, packed)[0]
    assert windowed[0, 0, 5].tolist() == [False, True, False, False, True, True]  # positions 1, 2, 3 of its own


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")  # on purpose here
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_window_layers_on_flex_attention_agree_with_the_dense_mask(monkeypatch, dtype):
    """A compiled CUDA model runs its window layers on FlexAttention's block mask (uses_flex_attention); here,
    forced on the CPU, its logits equal the dense-mask path's, and a block mask one token too wide does not."""
    model = gpt(["--window-pattern", "SSL", "--short-window", "5", "--value-embeds", "alternate"],
                dtype=dtype).eval().requires_grad_(False)
    idx = torch.randint(0, VOCAB, (2, 24))
    dense = model(idx)
    assert not T.uses_flex_attention(torch.device("cpu"))  # the CPU path stays the dense mask
    monkeypatch.setattr(T, "uses_flex_attention", lambda device: True)
    masks = model.layer_masks(24, None, None)
    assert [type(m).__name__ for m in masks] == ["BlockMask", "BlockMask", "NoneType", "NoneType"]  # SSL, last L
    flex, scale = model(idx), dense.abs().max()
    assert (flex - dense).abs().max() < (1e-5 if dtype == "fp32" else 0.05) * scale
    wide = T.sliding_window_block_mask
    monkeypatch.setattr(T, "sliding_window_block_mask", lambda n, w, device: wide(n, w + 1, device))
    assert (model(idx) - dense).abs().max() > 0.3 * scale


# --- the stop rule ---------------------------------------------------------------------------------

def test_the_stop_rule_predicts_from_steps_after_start_up():
    startup = T.TRAIN_STARTUP_STEPS_EXCLUDED
    slow_first = [600.0] + [1.0] * (startup - 1)  # a cold compile, longer than the whole budget
    for steps in range(1, startup + 1):
        assert not T.out_of_time(0.0, slow_first[:steps], 0.0, training_seconds=10.0)
    assert T.out_of_time(8.5, slow_first + [2.0, 1.0], 0.0, 10.0)  # the longest after start-up: 8.5 + 2 > 10
    assert not T.out_of_time(7.5, slow_first + [2.0, 1.0], 0.0, 10.0)
    assert not T.out_of_time(8.5, slow_first + [9.0] + [1.0] * 5, 0.0, 10.0)  # the last five only: 8.5 + 1
    assert T.out_of_time(7.5, slow_first + [2.0], 1.0, 10.0)  # a due snapshot's time counts
    assert T.out_of_time(11.0, slow_first[:2], 0.0, 10.0)  # charged time already spent (start-up past the cap)


@pytest.mark.slow
def test_a_first_step_slower_than_the_budget_still_trains_and_stops_in_time(tmp_path, text_dataset):
    """Step 0 takes 4 s longer, more than the whole training time of the 8 s budget (under 3 s once the save's
    reserve is kept): the run trains on past start-up, and stops within budget."""
    env = dict(os.environ, FRONTIER_DATA_DIR=str(text_dataset), PYTHONPATH=str(REPO))
    slow_first_step = ("import sys, time, train as T\n"
                       "kit_step, calls = T.train_step, []\n"
                       "def slow(*args, **kwargs):\n"
                       "    calls.append(1)\n"
                       "    if len(calls) == 1:\n"
                       "        time.sleep(4)  # as a cold compile makes it\n"
                       "    return kit_step(*args, **kwargs)\n"
                       "T.train_step = slow\n"
                       "sys.exit(T.main(sys.argv[1:]))\n")
    run = subprocess.run([sys.executable, "-c", slow_first_step, *TINY_TRAIN_ARGS, "--time-budget", "8",
                          "--eval-tokens", "0", "--peak-tflops", "0.1", "--out-dir", str(tmp_path / "out")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    s = dict(line.split(":", 1) for line in run.stdout.split("\n---\n", 1)[1].splitlines() if ":" in line)
    s = {k.strip(): v.strip() for k, v in s.items()}
    assert "step 00000" in run.stdout and int(s["num_steps"]) >= T.TRAIN_STARTUP_STEPS_EXCLUDED + 2, s["num_steps"]
    assert float(s["startup_seconds"]) >= 4.0
    assert s["over_budget"] == "False" and float(s["charged_seconds"]) <= 8.0
    assert float(s["training_seconds"]) > 1.5  # it trained for a good part of the time it had
    assert (tmp_path / "out" / "final.pt").exists()


@pytest.mark.slow
def test_every_ingredient_trains_and_passes_the_scorers_contract(tmp_path, text_dataset):
    env = dict(os.environ, FRONTIER_DATA_DIR=str(text_dataset), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY_TRAIN_ARGS, *EVERY_INGREDIENT,
                          "--max-steps", "12", "--eval-tokens", "0", "--out-dir",
                          str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "num_steps:             12" in run.stdout
    result = prepare_in_process(["eval-public", "--train-py", str(REPO / "train.py"), "--checkpoint",
                                 str(tmp_path / "out" / "final.pt"), "--max-tokens", "4096"],
                                {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "causality_passed:        True" in result.stdout and "val_bpb" in result.stdout
