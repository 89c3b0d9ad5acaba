"""train.py on CPU: learning, DDP, checkpoint and load contract, failure paths, budget."""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

import prepare
from helpers import REPO, every_ingredient, prepare_in_process

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

from conftest import TINY_TRAIN_ARGS as TINY


def run_train(args, env_extra, cwd, torchrun: int = 0, timeout: int = 600):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = str(REPO)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] \
        if torchrun else [sys.executable]
    return subprocess.run([*launcher, str(REPO / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def summary(stdout: str) -> dict:
    after = stdout.split("\n---\n", 1)[1]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in after.splitlines() if ":" in line)}


@pytest.fixture
def trained(tiny_training):
    return tiny_training


def _unigram_entropy_nats(dataset) -> float:
    tok = prepare.ensure_tokenizer(dataset_dir=dataset)
    counts = collections.Counter()
    for path in prepare.split_shards("train", dataset):
        for rg in range(pq.ParquetFile(path).metadata.num_row_groups):
            for ids in tok.encode(prepare._row_group_texts(str(path), rg), prepend=tok.get_bos_token_id()):
                counts.update(ids)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def model_cross_entropy(checkpoint, dataset, monkeypatch) -> float:
    """The trained model's cross-entropy on rows of the training text, from its logits as the scorer reads them
    (not the loss it trained on, which an edit may change: a second head's adds a term)."""
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(dataset))
    model = T.load_for_eval(str(checkpoint), torch.device("cpu"))
    inputs, targets, _ = next(prepare.make_dataloader(prepare.ensure_tokenizer(), 8, 128, "train", torch.device("cpu")))
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()


def test_tiny_model_learns_well_below_unigram_entropy(trained, text_dataset, monkeypatch):
    checkpoint, stdout = trained
    s = summary(stdout)
    entropy, learned = _unigram_entropy_nats(text_dataset), model_cross_entropy(checkpoint, text_dataset, monkeypatch)
    assert learned < 0.75 * entropy, (learned, entropy)
    assert s["num_steps"] == "60" and s["over_budget"] == "False"
    assert math.isfinite(float(s["val_bpb"])) and float(s["mfu_percent"]) > 0
    for key in ("training_seconds", "charged_seconds", "tokens_per_second", "num_params_M", "peak_memory_mb"):
        assert key in s
    dtype = "bf16" if s["compute_dtype"] == "bfloat16" else "fp32"  # the CPU's peak in the compute dtype
    assert float(s["peak_tflops"]) > 0 and f"the model's matmuls in {dtype}, best 1-thread call" in s["peak_source"]


@pytest.mark.slow
def test_checkpoint_round_trips_through_load_for_eval_and_eval_public(trained, text_dataset, tmp_path):
    checkpoint, _ = trained
    payload = torch.load(checkpoint, weights_only=True)
    assert payload["format"] == T.CHECKPOINT_FORMAT and payload["model_config"]["n_layer"] == 2
    model = T.load_for_eval(str(checkpoint), torch.device("cpu"))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    x = torch.randint(0, 8000, (2, 64))
    assert model(x).shape == (2, 64, 8192)
    result = prepare_in_process(["eval-public", "--train-py", str(REPO / "train.py"), "--checkpoint", str(checkpoint),
                                 "--max-tokens", "4096"], {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert result.returncode == 0, result.stderr
    assert "causality_passed:        True" in result.stdout


def test_checkpoint_of_another_config_is_a_clear_error(trained, tmp_path, text_dataset):
    checkpoint, _ = trained
    payload = torch.load(checkpoint, weights_only=True)
    cases = []
    deeper = dict(payload, model_config=dict(payload["model_config"], n_layer=3))
    cases.append((deeper, "does not fit this train.py's GPT"))
    cases.append((dict(payload, model_config=dict(payload["model_config"], rotary_dim=16)), "unexpected keyword argument 'rotary_dim'"))
    cases.append((dict(payload, format="other-kit/7"), "has format 'other-kit/7'"))
    for k, (bad, message) in enumerate(cases):
        path = tmp_path / f"bad{k}.pt"
        torch.save(bad, path)
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            T.load_for_eval(str(path), torch.device("cpu"))
    result = prepare_in_process(["eval-public", "--train-py", str(REPO / "train.py"), "--checkpoint",
                                 str(tmp_path / "bad0.pt")], {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert result.returncode == 1 and "does not fit this train.py's GPT" in result.stderr


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path, text_dataset):
    result = run_train([*TINY, "--total-batch-size", "2048", "--max-steps", "4", "--eval-tokens", "0",
                        "--out-dir", str(tmp_path / "out")], {"FRONTIER_DATA_DIR": str(text_dataset)}, cwd=tmp_path,
                       torchrun=2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("\n---\n") == 1  # rank 0 reports
    s = summary(result.stdout)
    assert s["device"] == "cpu x 2" and s["num_steps"] == "4"
    assert float(s["comm_seconds_per_step"]) > 0  # the optimizer waited on gradient communication
    assert "sharded (ZeRO-1" in result.stdout  # --shard-optimizer auto, at 2 ranks
    assert (tmp_path / "out" / "final.pt").exists()


@pytest.mark.slow
def test_one_ddp_step_equals_one_single_process_step(tmp_path, two_rank_steps):
    script = REPO / "tests" / "fixtures" / "one_step.py"
    single = subprocess.run([sys.executable, str(script), str(tmp_path / "single.pt")], capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    a, b = torch.load(tmp_path / "single.pt"), torch.load(two_rank_steps / "ddp.pt")
    for name, g in a["grads"].items():  # the averaged gradient: fp32 rounding relative to its scale
        assert torch.allclose(g, b["grads"][name], rtol=1e-5, atol=1e-6 * g.abs().max().item()), name
    for name, w in a["weights"].items():
        # AdamW divides by sqrt(v) + 1e-10, so an element whose gradient is at the rounding level
        # moves by rounding noise times the learning rate: compare the elements with a real gradient.
        g = a["grads"][name]
        real = g.abs() > 1e-4 * g.abs().max()
        assert torch.allclose(w[real], b["weights"][name][real], rtol=1e-5, atol=1e-6), name
        assert (w[real] - a["before"][name][real]).abs().max() > 1e-4, name  # the step moved it


def test_a_nan_loss_stops_cleanly_without_a_checkpoint(tmp_path, train_main, monkeypatch):
    kit_step, steps = T.train_step, []

    def nan_at_step_3(*args, **kwargs):
        loss, state = kit_step(*args, **kwargs)
        steps.append(1)
        return (loss * float("nan") if len(steps) == 4 else loss), state

    monkeypatch.setattr(T, "train_step", nan_at_step_3)
    with pytest.raises(T.TrainingDiverged, match="training diverged at step 3: .* no checkpoint written"):
        train_main([*TINY, "--max-steps", "10", "--out-dir", str(tmp_path / "out")])
    assert T.is_input_error(T.TrainingDiverged())  # train.py's __main__ prints it as one line and exits 1
    assert not (tmp_path / "out" / "final.pt").exists()
    assert "training diverged" not in (tmp_path / "out" / "log.txt").read_text()  # the error is stderr's, once


@pytest.mark.slow
def test_short_budget_is_respected_including_the_save(tmp_path, text_dataset):
    result = run_train([*TINY, "--time-budget", "8", "--eval-tokens", "0", "--out-dir", str(tmp_path / "out")],
                       {"FRONTIER_DATA_DIR": str(text_dataset)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(result.stdout)
    assert s["over_budget"] == "False" and float(s["charged_seconds"]) <= 8.0
    assert float(s["charged_seconds"]) > 2.0  # it trained for most of the ~2.9 s it had (5.1 s are kept for the save)
    assert (tmp_path / "out" / "final.pt").exists()


def test_nki_flag_fails_clearly_off_trainium(tmp_path, train_main):
    with pytest.raises(SystemExit) as e:  # a message: exit code 1 and that line on stderr, no traceback
        train_main([*TINY, "--nki-rmsnorm", "--out-dir", str(tmp_path / "out")])  # norm: every model calls it
    assert isinstance(e.value.code, str) and "--nki-rmsnorm" in e.value.code and "neuron device" in e.value.code


def test_relu2_reference_matches_autograd_in_float64():
    x = torch.randn(64, 48, dtype=torch.float64)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x).requires_grad_()  # stay off the kink
    g = torch.randn(64, 48, dtype=torch.float64)
    y, dx = T.relu2_forward_reference(x), T.relu2_backward_reference(x.detach(), g)
    x2 = x.detach().clone().requires_grad_()
    y2 = torch.relu(x2) ** 2
    (dx2,) = torch.autograd.grad(y2, x2, g)
    assert torch.equal(y, y2) and torch.allclose(dx, dx2, rtol=0, atol=1e-15)
    assert torch.autograd.gradcheck(T.relu2_forward_reference, (x,))
    assert torch.equal(T.relu_squared(x.detach()), torch.relu(x.detach()) ** 2)  # the default path


def test_the_budget_clock_follows_the_rule(monkeypatch):
    """train.py's own clock (the organisers' prepare.py gives it no ledger figures): start-up lasts until
    the end of this process's step TRAIN_STARTUP_STEPS_EXCLUDED - 1, at most the cap, and a resumed
    run's earlier charged seconds carry over."""
    now = {"t": 1000.0}
    monkeypatch.setattr(T, "clock_seconds", lambda: now["t"])
    clock = T.BudgetClock(carried_seconds=50.0)
    clock.started = 1000.0
    for step in range(T.TRAIN_STARTUP_STEPS_EXCLUDED):
        now["t"] = 1100.0 + 10 * step
        assert clock.step_done() == step and clock.charged_seconds() == 50.0  # all start-up so far
    now["t"] = 1140.0 + 30.0
    s = clock.status(budget_seconds=75.0)
    assert s["startup_allowance_seconds"] == 140.0 and s["charged_seconds"] == 80.0 and s["over_budget"]
    assert clock.median_step_seconds() is None  # no step after start-up yet
    now["t"] = 1142.0
    clock.step_done()
    assert clock.median_step_seconds() == 2.0
    slow = T.BudgetClock()  # a start-up longer than the cap
    slow.started = 1000.0
    for step in range(T.TRAIN_STARTUP_STEPS_EXCLUDED):
        now["t"] = 2000.0 + step
        slow.step_done()
    assert slow.status(1e9)["startup_allowance_seconds"] == T.TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS
    assert slow.charged_seconds() == 1004.0 - T.TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS


def test_the_budget_clock_ignores_a_step_of_the_wall_clock(monkeypatch):
    """NTP or settimeofday can step time.time() mid-run; charged time counts elapsed seconds."""
    clock = T.BudgetClock()
    assert clock.started <= T.IMPORTED_AT <= T.clock_seconds()
    before = clock.status(1e9)["elapsed_seconds"]
    wall = T.time.time
    for jump in (3600.0, -3600.0):
        monkeypatch.setattr(T.time, "time", lambda jump=jump: wall() + jump)
        assert 0 <= clock.status(1e9)["elapsed_seconds"] - before < 5.0
        assert T.BudgetClock().started == clock.started <= T.IMPORTED_AT  # the start read again after it


def test_the_default_recipe_is_the_organisers_d10():
    """Their size (59.6M parameters in their architecture: 12 x 10 x 640^2 + 2 x 8192 x 640 + 20 scalars) with
    every ingredient off; what the architecture is made of is the recipe's to change (benchmarks/fingerprint.py
    holds the kit's arithmetic)."""
    c = T.model_config(T.Recipe())
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.sequence_len, c.vocab_size) == (10, 640, 5, 5, 2048, 8192)
    assert all(getattr(T.Recipe().architecture, name) != on for name, on in every_ingredient().items())


@pytest.mark.slow
def test_importing_train_has_no_side_effects(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import train; import torch.distributed as d; " \
           "print(d.is_initialized())"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "False"
    assert list(tmp_path.iterdir()) == []


def test_flags_cover_the_recipe_and_the_run_options_and_presets_apply():
    recipe, options, _ = T.parse_command_line(["--preset", "cpu", "--depth", "3", "--no-compile", "--matrix-lr",
                                               "0.01"])
    assert recipe.depth == 3 and recipe.matrix_lr == 0.01 and options.compile is False
    assert recipe.seq_len == T.PRESETS["cpu"]["seq_len"] and options.log_every == T.PRESETS["cpu"]["log_every"]
    assert T.parse_command_line([])[:2] == (T.Recipe(), T.RunOptions())
    fields = [f.name for f in T.setting_fields()]
    assert len(fields) == len(set(fields))  # a setting is either the recipe's or a run option, never both
    assert set(T.PRESETS["cpu"]) | set(T.PRESETS["phase2"]) | set(T.PRESETS["gpu"]) <= set(fields)


def test_schedules():
    """The learning rate ramps up from 0 over the warmup, holds its peak of 1, and comes down to final_lr_frac at
    the end (whatever the curve between: a schedule of another shape passes); Muon's momentum ramps from start to
    end."""
    recipe = T.Recipe(warmup_ratio=0.1, warmdown_ratio=0.5, final_lr_frac=0.1)
    values = [T.lr_multiplier(p / 200, recipe) for p in range(201)]
    peak = values.index(max(values))
    assert values[0] == pytest.approx(0.0, abs=1e-9) and values[peak] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1) and all(0.0 <= v <= 1.0 + 1e-9 for v in values)
    assert all(a <= b + 1e-9 for a, b in zip(values[:peak], values[1:peak + 1]))  # up to the peak, down after
    assert all(a >= b - 1e-9 for a, b in zip(values[peak:], values[peak + 1:]))
    assert T.lr_multiplier(0.3, recipe) == pytest.approx(1.0)  # between warmup and warmdown
    assert T.muon_momentum(0.0, recipe) == 0.85 and T.muon_momentum(1.0, recipe) == 0.95


def test_a_run_leaves_a_folder_to_look_at_and_keeps_the_previous_run(tmp_path, train_main, capsys):
    """log.txt, summary.json (the summary as JSON), metrics.jsonl and loss.png beside final.pt; a second run
    moves the first one's files into a dated folder instead of overwriting them."""
    from PIL import Image
    out = tmp_path / "out"
    argv = [*TINY, "--max-steps", "8", "--log-every", "2", "--eval-tokens", "2048", "--out-dir", str(out)]
    train_main(argv)
    first = (out / "final.pt").read_bytes()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_steps"] == 8 and summary["over_budget"] is False and 0 < summary["val_bpb"] < 20
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics][:3] == [0, 1, 2] and metrics[-1]["step"] == 7
    assert "step 00007" in (out / "log.txt").read_text() and "num_steps:" in (out / "log.txt").read_text()
    with Image.open(out / "loss.png") as picture:
        assert picture.format == "PNG" and picture.size[0] > 300 and len(picture.getcolors(maxcolors=2**20)) > 10
    assert "next: python prepare.py eval-public --checkpoint" in capsys.readouterr().out
    train_main(argv)
    (kept,) = [p for p in out.iterdir() if p.name.startswith("run-")]
    assert (kept / "final.pt").read_bytes() == first and {p.name for p in kept.iterdir()} == set(T.RUN_FILES)
    assert (out / "final.pt").exists() and (out / "loss.png").exists()


def test_the_run_folder_skips_the_picture_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    T.write_run_folder(tmp_path, {"val_bpb": "1.5"}, [{"charged_seconds": 1.0, "loss": 5.0}], 10.0, 12.0)
    assert "loss.png: skipped (matplotlib is not installed here)" in capsys.readouterr().out
    assert (tmp_path / "summary.json").exists() and not (tmp_path / "loss.png").exists()
