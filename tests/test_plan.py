"""tools/plan.py, the budget planner (beside the submission: it imports train.py), and the Phase 2
preset it sized."""
from __future__ import annotations

import dataclasses
import json
import math
import sys

import pyarrow.parquet as pq
import pytest
import torch

import prepare
from helpers import REPO

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402
from tools import plan as P  # noqa: E402

DEFAULT = T.Recipe()


def plan_output(capsys, *args) -> dict:
    assert P.main(list(args)) == 0
    return {k: v.strip() for k, v in (line.split(":", 1) for line in capsys.readouterr().out.splitlines())}


def planned_model(depth: int) -> T.GPT:
    with torch.device("meta"):
        return T.GPT(T.model_config(dataclasses.replace(DEFAULT, depth=depth)))


def planned_tokens(depth: int, flops: float, budget: float) -> float:
    """The tokens a run of that depth trains at `flops` in the budget less the checkpoint's save."""
    model = planned_model(depth)
    return flops / model.flops_per_token() * (budget - T.checkpoint_save_reserve(model))


def test_planner_for_phase1_and_phase2(capsys, monkeypatch):
    """At its assumed MFU (22% of 79 TFLOP/s per NeuronCore) the planner takes the depth whose tokens per parameter
    come nearest PLAN_TOKENS_PER_PARAM, the batch law's batch in whole rows on every rank, and the steps that fill
    the budget: each checked against the model itself, so an edit of the model moves the plan, not the test."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    plans = {}
    for ranks, budget in ((4, 1800), (64, 14400)):  # one chip for 30 minutes, 16 chips for 4 hours
        out = plans[ranks] = plan_output(capsys, "--ranks", str(ranks), "--budget", str(budget))
        depth, flops = int(out["depth"]), P.PLAN_ASSUMED_MFU * T.NEURONCORE_BF16_FLOPS * 2 * ranks
        model = planned_model(depth)
        assert (out["width"], out["parameters_M"]) == (str(model.config.n_embd), f"{model.num_params() / 1e6:.1f}")
        off = {d: abs(math.log(planned_tokens(d, flops, budget) / planned_model(d).num_params() /
                                P.PLAN_TOKENS_PER_PARAM)) for d in (depth - 1, depth, depth + 1) if d >= 1}
        assert off[depth] == min(off.values())
        tokens = planned_tokens(depth, flops, budget)
        batch = P.planned_batch_size(tokens, DEFAULT.seq_len, ranks)
        assert batch % (DEFAULT.seq_len * ranks) == 0 and out["batch"].startswith(f"{batch:,} tokens = ")
        assert out["steps"] == f"{int(tokens // batch):,}"
    assert plans[64]["command"].startswith(f"torchrun --standalone --nproc_per_node=64 train.py --depth "
                                           f"{plans[64]['depth']} ")
    # The same 16 chips at LNC=1 (128 ranks of one core) plan the same model.
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    lnc1 = plan_output(capsys, "--ranks", "128", "--budget", "14400")
    assert (lnc1["depth"], lnc1["steps"]) == (plans[64]["depth"], plans[64]["steps"])
    assert lnc1["batch"].startswith(plans[64]["batch"].split(" = ")[0])


def test_the_default_model_would_overtrain_in_phase2():
    """At the same throughput, the depth-10 default sees about a hundred times the tokens per parameter the plan
    aims at: Phase 2 wants a larger model."""
    flops = P.PLAN_ASSUMED_MFU * T.NEURONCORE_BF16_FLOPS * 2 * 64
    assert planned_tokens(DEFAULT.depth, flops, 14400) / planned_model(DEFAULT.depth).num_params() > \
        50 * P.PLAN_TOKENS_PER_PARAM


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


def test_planner_advises_a_shape_from_tokens_per_second_measured_once_here(capsys, text_dataset, monkeypatch):
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    tiny = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "64", "--total-batch-size", "512",
            "--device-batch-size", "8", "--device", "cpu", "--shapes", "--budget", "600"]
    assert P.main(tiny) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("measured depth ") for line in lines) == 3  # measured here, into the table
    advice = next(line for line in lines if line.startswith("advice: "))
    out = {k: v.strip() for k, v in (line.split(":", 1) for line in lines[lines.index(advice) + 1:])}
    assert f"depth {out['depth']}, width {out['width']}" in advice and "measured, " in out["throughput"]
    assert out["command"].startswith(f"python train.py --depth {out['depth']} --aspect-ratio ")
    rows = out["command"].split("--seq-len ")[1].split()[0]
    assert advice.split(", the best expected")[0].endswith(f"rows of {rows}")
    assert P.main(tiny) == 0 and "measured depth" not in capsys.readouterr().out  # the second time: the table
    with pytest.raises(SystemExit, match="compares one cpu process's shapes"):
        P.main([*tiny, "--ranks", "2"])
    with pytest.raises(SystemExit, match="feed the planner's own rule"):
        P.main([*tiny, "--mfu", "0.3"])
    for bad in ("{not json", "[1, 2]"):
        P.shapes_file().write_text(bad)
        with pytest.raises(SystemExit, match="is not a table of tokens/s .* delete it to measure again"):
            P.main(tiny)


def shape_speeds(recipe, **speeds: float) -> dict[str, float]:
    """{shape_key: tokens/s} for the recipe's candidates, named by width (192: the cpu preset's own)."""
    return {P.shape_key(s): speeds[f"w{T.model_config(s).n_embd}"] for s in P.shape_candidates(recipe)}


def test_choose_shape_picks_by_the_fit_from_measured_speeds_with_a_margin(monkeypatch):
    recipe = T.parse_command_line(["--preset", "cpu"])[0]
    assert [T.model_config(s).n_embd for s in P.shape_candidates(recipe)] == [192, 256, 384]
    # the AVX-512 BF16 kind (benchmarks/results/shape_probe): the preset's shape, rows of 256 at 300 s, 512 at 900 s
    avx512 = shape_speeds(recipe, w192=7280, w256=5256, w384=3367)
    for budget, rows in ((300.0, 256), (900.0, 512)):
        pick, why = P.choose_shape(dataclasses.replace(recipe, time_budget=budget), avx512, 8264)
        assert (pick.depth, pick.aspect_ratio, pick.seq_len) == (3, 64, rows)
        assert len(why) == 4 and why[-1].startswith(f"advice: depth 3, width 192, rows of {rows}")
    # a machine whose matmul unit the preset leaves idle (AMX): width 384 at 90 % of the preset's speed wins
    amx = shape_speeds(recipe, w192=11000, w256=8000, w384=9900)
    pick, why = P.choose_shape(recipe, amx, 14605)
    assert (T.model_config(pick).n_embd, pick.seq_len) == (384, 256) and "advice: depth 3, width 384" in why[-1]
    monkeypatch.setattr(P, "SHAPE_MARGIN_BPB", 1.0)  # a gain under the margin keeps the recipe's shape
    assert T.model_config(P.choose_shape(recipe, amx, 14605)[0]).n_embd == 192


def test_choose_shape_doubles_the_rows_from_max_passes_over_what_they_reach():
    recipe = T.parse_command_line(["--preset", "cpu"])[0]
    for documents in (100, 8264, 30000):  # (at a billion tokens the fit would pick a wider shape, at 1/9 the speed)
        for passes, rows in ((0.99 * P.MAX_PASSES, 256), (1.01 * P.MAX_PASSES, 512)):
            speed = passes * documents * 257 / recipe.time_budget
            pick, why = P.choose_shape(recipe, shape_speeds(recipe, w192=speed, w256=speed / 9, w384=speed / 9),
                                       documents)
            assert pick.seq_len == rows and f"pass {passes:.1f} times over the first 257 tokens" in why[-1]


def test_the_recipes_shape_comes_first_and_the_table_keys_all_a_step_depends_on():
    recipe = T.parse_command_line(["--preset", "cpu", "--aspect-ratio", "128"])[0]  # the recipe is a candidate's shape
    assert [T.model_config(s).n_embd for s in P.shape_candidates(recipe)] == [384, 192 + 64]
    keys = {P.shape_key(r) for r in (recipe, dataclasses.replace(recipe, total_batch_size=8192),
                                     dataclasses.replace(recipe, device_batch_size=8), dataclasses.replace(recipe,
                                     architecture=T.Architecture()), dataclasses.replace(recipe, head_dim=128))}
    assert len(keys) == 5


def test_training_documents_counts_the_train_split(monkeypatch, text_dataset):
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    shards = prepare.split_shards("train")
    assert P.training_documents() == sum(pq.ParquetFile(p).metadata.num_rows for p in shards) > 0


def test_phase2_preset_is_the_plan_for_16_chips_4_hours(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    recipe, options, _ = T.parse_command_line(["--preset", "phase2"])
    flops = P.PLAN_ASSUMED_MFU * T.device_profile("neuron").peak_flops * 64
    plan = P.plan_run(recipe, 64, recipe.time_budget, flops)
    assert (plan.recipe.depth, plan.recipe.total_batch_size) == (recipe.depth, recipe.total_batch_size)
    assert recipe.time_budget == 14400 and options.save_every > 0
    for world in (64, 128, 256):  # LNC=2, LNC=1, two servers at LNC=1
        T.batch_geometry(recipe.total_batch_size, recipe.device_batch_size, recipe.seq_len, world)
