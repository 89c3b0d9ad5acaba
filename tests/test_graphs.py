"""Trainium-ready by construction, checked on the CPU (tests/graph_checks.py): the training step and
the scorers' forwards compile as one graph each, a run recompiles nothing after its first step, the step
reads no value back to the host, and no op the Neuron backend would run on the host is in the graphs.
Each check also runs on a deliberately broken copy (a graph break in an ingredient, a Python-scalar
learning rate, an .item() in the step, a sort, float64), where it must fail."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import graph_checks as R
from helpers import every_ingredient, flags_for

T = R.T
TINY = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "64", "--device-batch-size", "2",
        "--total-batch-size", "256", "--device", "cpu", "--log-every", "5", "--peak-tflops", "0.1"]


# --- one graph ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("shape", ["d10", "cpu", "gpu", "phase2", "every-ingredient"])
def test_the_training_step_is_one_graph_with_no_op_the_device_runs_on_the_host(shape):
    census = R.training_step_census(*R.tiny_recipe(R.SHAPES[shape]))
    assert census.graphs == 1
    assert census.ops["aten.mm.default"] > 0 and any("backward" in op for op in census.ops)  # forward and backward
    assert census.host_ops() == {}


@pytest.mark.slow
def test_the_scorers_forwards_are_one_graph_each():
    recipe, _ = R.tiny_recipe(R.SHAPES["every-ingredient"])
    assert R.eval_forward_census(recipe).graphs == 1
    prefix = list(range(1, 60))
    sequences = [prefix + [100 + k, 200 + k, 300 + k] for k in range(4)] + [list(range(500, 530))]
    census = R.packed_scoring_census(recipe, sequences)
    assert census.graphs == 1 and census.host_ops() == {}


def test_a_graph_break_in_the_model_is_an_error_that_names_the_line(monkeypatch):
    original = T.norm  # an op every model calls

    def norm_with_a_host_branch(x):
        if float(x.max()) > 1e9:  # data-dependent Python control flow: a graph break
            pass
        return original(x)

    monkeypatch.setattr(T, "norm", norm_with_a_host_branch)
    with pytest.raises(R.GraphBreak, match=r"test_graphs.py.*line \d+"):
        R.training_step_census(*R.tiny_recipe(["--depth", "2"]))


@pytest.mark.slow
def test_an_op_the_device_runs_on_the_host_is_listed(monkeypatch):
    original = T.norm  # an op every model calls
    monkeypatch.setattr(T, "norm", lambda x: original(x).sort(dim=-1).values)
    census = R.training_step_census(*R.tiny_recipe(["--depth", "2"]))
    assert "aten.sort.default" in census.host_ops()
    monkeypatch.setattr(T, "norm", lambda x: F.rms_norm(x.double(), (x.size(-1),)).to(x.dtype))
    assert any("float64" in op for op in R.training_step_census(*R.tiny_recipe(["--depth", "2"])).host_ops())


# --- no recompiles -------------------------------------------------------------------------------------

def compiles_after_the_first_step(argv, monkeypatch, train_main) -> tuple[int, int]:
    """Run train.py's main in this process with --compile through a counting backend (R.CompileCount: the
    model's graphs and the optimizer's updates): (graphs compiled by the end of the first step, graphs
    compiled after it, the evaluation at the end included)."""
    counter, seen = R.CompileCount(), []
    profile = T.device_profile

    def counted_profile(*args, **kwargs):
        return dataclasses.replace(profile(*args, **kwargs), compile_backend=counter)

    step_done = T.Run.step_done

    def noting(self, *args, **kwargs):
        seen.append(counter.graphs)
        return step_done(self, *args, **kwargs)

    monkeypatch.setattr(T, "device_profile", counted_profile)
    monkeypatch.setattr(T.Run, "step_done", noting)
    assert train_main(argv) == 0
    return seen[0], counter.graphs - seen[0]


def test_the_optimizer_step_is_one_graph_for_every_group_and_shape():
    recipe, options = R.tiny_recipe(["--depth", "2"])
    model = T.build_model(T.model_config(recipe), "cpu", recipe.dtype)
    counter = R.CompileCount()
    optimizer = T.build_optimizer(model, recipe, options, None, counter, compiled=True)
    assert len({tuple(p.shape) for p in model.parameters()}) > 2 and len(optimizer.param_groups) > 2
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        T.apply_schedules(optimizer, 0.1 + 0.4 * step, recipe)  # new values are data, not a new graph
        optimizer.step()
        assert counter.graphs == 1


SCHEDULES_MOVING = ["--max-steps", "20", "--warmup-ratio", "0.2", "--warmdown-ratio", "0.5",
                    "--muon-momentum-warmup-ratio", "0.5", "--compile"]


@pytest.mark.slow
def test_twenty_steps_with_every_schedule_moving_and_the_evaluation_recompile_nothing(tmp_path, monkeypatch,
                                                                                     train_main):
    argv = [*TINY, *SCHEDULES_MOVING, "--eval-tokens", "2048", "--out-dir", str(tmp_path / "out")]
    first, later = compiles_after_the_first_step(argv, monkeypatch, train_main)
    assert first >= 2 and later == 0  # the model's graph and the optimizer's updates, all in the first step


@pytest.mark.slow
def test_a_python_scalar_learning_rate_recompiles_and_is_caught(tmp_path, monkeypatch, train_main):
    def as_python_floats(self):  # the mistake: the step's lr handed to the update as a float
        return [{k: float(g[k]) for k in T.MuonAdamW.SCHEDULED if k in g} for g in self.param_groups]

    monkeypatch.setattr(T.MuonAdamW, "_device_hyperparameters", as_python_floats)
    argv = [*TINY, *SCHEDULES_MOVING, "--eval-tokens", "0", "--out-dir", str(tmp_path / "out")]
    try:
        first, later = compiles_after_the_first_step(argv, monkeypatch, train_main)
    except torch._dynamo.exc.FailOnRecompileLimitHit:  # so many recompiles that the fullgraph update gave up
        pass
    else:
        assert later > 0


# --- no host reads inside a step -------------------------------------------------------------------------

def host_reads_of_a_run(argv, monkeypatch, train_main) -> R.HostReads:
    """train.py's main in this process (eager), its reads labelled "step" inside train_step and "between"
    in the bookkeeping after each step."""
    reads = R.HostReads()
    train_step, step_done = T.train_step, T.Run.step_done

    def step(*args, **kwargs):
        with reads.within("step"):
            return train_step(*args, **kwargs)

    def between(self, *args, **kwargs):
        with reads.within("between"):
            return step_done(self, *args, **kwargs)

    monkeypatch.setattr(T, "train_step", step)
    monkeypatch.setattr(T.Run, "step_done", between)
    with reads:
        assert train_main(argv) == 0
    return reads


@pytest.mark.slow
def test_a_step_reads_nothing_back_and_the_bookkeeping_reads_once_per_step(tmp_path, monkeypatch, train_main):
    argv = [*TINY, *flags_for(every_ingredient()), "--max-steps", "8", "--eval-tokens", "0",
            "--out-dir", str(tmp_path / "out")]
    reads = host_reads_of_a_run(argv, monkeypatch, train_main)
    assert reads.in_region("step") == []
    between = reads.in_region("between")
    assert len(between) == 8 and {(call, where.split()[-1]) for call, where in between} == \
        {("tolist", "agree_across_ranks")}  # the loss and the stop vote, one read after each step


def test_an_item_in_the_step_is_caught_where_it_happens(tmp_path, monkeypatch, train_main):
    norm = T.norm  # an op every model calls

    def norm_that_reads(x):
        if x.abs().max().item() > 1e4:  # the mistake: a host read inside the step
            raise RuntimeError("activation too large")
        return norm(x)

    monkeypatch.setattr(T, "norm", norm_that_reads)
    reads = host_reads_of_a_run([*TINY, "--max-steps", "2", "--eval-tokens", "0", "--out-dir", str(tmp_path / "out")],
                                monkeypatch, train_main)
    inside = reads.in_region("step")
    assert inside and {call for call, _ in inside} == {"item"}
    assert all("test_graphs.py" in where and "norm_that_reads" in where for _, where in inside)
