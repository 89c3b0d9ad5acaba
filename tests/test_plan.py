"""tools/plan.py, the budget planner (beside the submission: it imports train.py), and the Phase 2
preset it sized."""
from __future__ import annotations

import sys

import pytest
import torch

from helpers import REPO

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402
from tools import plan as P  # noqa: E402

DEFAULT = T.Recipe()


def plan_output(capsys, *args) -> dict:
    assert P.main(list(args)) == 0
    return {k: v.strip() for k, v in (line.split(":", 1) for line in capsys.readouterr().out.splitlines())}


def test_planner_for_phase1_and_phase2(capsys, monkeypatch):
    """What the planner picks at its assumed MFU (22% of 79 TFLOP/s per NeuronCore), stated."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    phase1 = plan_output(capsys, "--ranks", "4", "--budget", "1800")  # one chip, 30 minutes
    assert (phase1["depth"], phase1["width"], phase1["parameters_M"]) == ("9", "640", "54.7")
    assert phase1["batch"] == "262,144 tokens = 8 x 2048 x 4 ranks x 4 accumulation"
    assert (phase1["steps"], phase1["tokens_B"], phase1["tokens_per_parameter"]) == ("2,163", "0.57", "10.4")
    phase2 = plan_output(capsys, "--ranks", "64", "--budget", "14400")  # 16 chips, 4 hours
    assert (phase2["depth"], phase2["width"], phase2["parameters_M"]) == ("23", "1536", "676.3")
    assert phase2["batch"] == "524,288 tokens = 4 x 2048 x 64 ranks x 1 accumulation"
    assert (phase2["steps"], phase2["tokens_B"], phase2["tokens_per_parameter"]) == ("12,521", "6.56", "9.7")
    assert phase2["command"].startswith("torchrun --standalone --nproc_per_node=64 train.py --depth 23 ")
    # The same 16 chips at LNC=1 (128 ranks of one core) plan the same model.
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    lnc1 = plan_output(capsys, "--ranks", "128", "--budget", "14400")
    assert (lnc1["depth"], lnc1["steps"]) == ("23", "12,521") and lnc1["batch"].startswith("524,288 tokens = 2 x")


def test_the_default_model_would_overtrain_in_phase2():
    """The issue's figure: at the same throughput, the depth-10 default sees ~1,100 tokens per parameter."""
    with torch.device("meta"):
        model = T.GPT(T.model_config(DEFAULT))
    flops = P.PLAN_ASSUMED_MFU * T.NEURONCORE_BF16_FLOPS * 2 * 64
    tokens_per_param = flops * 14400 / model.flops_per_token() / model.num_params()
    assert 1050 < tokens_per_param < 1200


def test_planner_rescales_a_measured_throughput(capsys):
    """A figure measured with the depth-10 model on 4 ranks: FLOP/s per rank carry over to other depths."""
    out = plan_output(capsys, "--ranks", "64", "--budget", "14400", "--tokens-per-second", "400000",
                      "--measured-ranks", "4")
    per_rank = 400000 / 4 * T.GPT(T.model_config(DEFAULT)).flops_per_token() / 1e12
    assert out["throughput"].startswith(f"{per_rank:.1f} TFLOP/s per rank (measured 400,000 tokens/s")
    assert int(out["depth"]) > 23  # faster than the assumed MFU: a bigger model fills the budget
    assert 8 < float(out["tokens_per_parameter"]) < 14


@pytest.mark.slow
def test_planner_probe_measures_this_device(capsys):
    tiny = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "64", "--total-batch-size", "512",
            "--device-batch-size", "8"]
    out = plan_output(capsys, *tiny, "--device", "cpu", "--probe", "--ranks", "2", "--budget", "600")
    assert "probe:" in out["throughput"] and "MFU" in out["throughput"] and int(out["depth"]) >= 1
    with pytest.raises(SystemExit, match="--probe measures on the device it plans for"):
        P.main(["--probe", "--device", "neuron"] if T.detect_device_type() != "neuron" else
               ["--probe", "--device", "cpu"])


def test_planner_says_what_shape_for_budget_trains_here(capsys, monkeypatch, tmp_path, text_dataset):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    tiny = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "64", "--total-batch-size", "512",
            "--device-batch-size", "8", "--device", "cpu", "--shape-for-budget", "--budget", "600"]
    assert P.main(tiny) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("shape probe: ") for line in lines) == 3  # measured here, into the table
    picked = next(line for line in lines if line.startswith("picked "))
    out = {k: v.strip() for k, v in (line.split(":", 1) for line in lines[lines.index(picked) + 1:])}
    assert f"depth {out['depth']}, width {out['width']}" in picked and "measured, " in out["throughput"]
    assert out["command"].startswith(f"python train.py --depth {out['depth']} --aspect-ratio ")
    rows = out["command"].split("--seq-len ")[1].split()[0]
    assert picked.split(" (--shape-for-budget)")[0].endswith(f"rows of {rows}")
    assert P.main(tiny) == 0 and "shape probe" not in capsys.readouterr().out  # the second time: the table
    with pytest.raises(SystemExit, match="picks one cpu process's shape"):
        P.main([*tiny, "--ranks", "2"])
    with pytest.raises(SystemExit, match="feed the planner's own rule"):
        P.main([*tiny, "--mfu", "0.3"])


def test_phase2_preset_is_the_plan_for_16_chips_4_hours(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    recipe, options, _ = T.parse_command_line(["--preset", "phase2"])
    flops = P.PLAN_ASSUMED_MFU * T.device_profile("neuron").peak_flops * 64
    plan = P.plan_run(recipe, 64, recipe.time_budget, flops)
    assert (plan.recipe.depth, plan.recipe.total_batch_size) == (recipe.depth, recipe.total_batch_size)
    assert recipe.time_budget == 14400 and options.save_every > 0
    for world in (64, 128, 256):  # LNC=2, LNC=1, two servers at LNC=1
        T.batch_geometry(recipe.total_batch_size, recipe.device_batch_size, recipe.seq_len, world)
