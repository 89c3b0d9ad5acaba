"""train.py at any scale: batch geometry, resumable runs,
several servers (nothing assumes LOCAL_RANK == RANK) and the end-of-run evaluation on every rank."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import TINY_TRAIN_ARGS as TINY
from helpers import REPO

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402
from test_train import run_train, summary  # noqa: E402

DEFAULT = T.Recipe()


# --- batch geometry ------------------------------------------------------------------------------

@pytest.mark.parametrize("world, rows, accum", [(1, 8, 16), (4, 8, 4), (8, 8, 2), (64, 2, 1), (128, 1, 1)])
def test_default_batch_has_a_geometry_up_to_128_ranks(world, rows, accum):
    g = T.batch_geometry(DEFAULT.total_batch_size, DEFAULT.device_batch_size, DEFAULT.seq_len, world)
    assert (g.device_batch_size, g.grad_accum_steps) == (rows, accum)
    assert g.device_batch_size * g.seq_len * world * g.grad_accum_steps == DEFAULT.total_batch_size
    if rows == 8:
        assert g.note == ""
    else:  # the device batch shrank, and the run says so
        assert g.note.startswith(f"device batch 8 -> {rows} rows")


def test_no_geometry_is_a_clear_error():
    with pytest.raises(ValueError) as e:  # 256 ranks: 2^18 tokens are half a row of 2048 per rank
        T.batch_geometry(2**18, 8, 2048, 256)
    assert "--total-batch-size 524288" in str(e.value) and "at most 128 ranks" in str(e.value)
    with pytest.raises(ValueError, match="--total-batch-size 258048 or --total-batch-size 264192"):
        T.batch_geometry(2**18, 8, 2048, 3)  # not a multiple of 3 rows


def test_device_batch_shrinks_to_the_largest_divisor():
    g = T.batch_geometry(12 * 2048, 8, 2048, 1)  # 12 rows per rank: 6 x 2, not 8
    assert (g.device_batch_size, g.grad_accum_steps) == (6, 2)
    assert T.batch_geometry(2**19, 2, 2048, 256).grad_accum_steps == 1  # Phase 2 batch on two servers at LNC=1


def test_a_run_with_more_ranks_than_rows_adapts_instead_of_exiting(tmp_path, train_main, capsys):
    """One process standing in for a rank of a large world: a total batch of 2 rows per step, device batch 8.
    A batch no geometry fits is an input error (train.py's one clear line, no traceback)."""
    assert train_main([*TINY, "--total-batch-size", "256", "--max-steps", "2", "--eval-tokens", "0",
                       "--out-dir", str(tmp_path / "out")]) == 0
    assert "batch geometry: device batch 8 -> 2 rows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no batch geometry") as e:
        train_main([*TINY, "--total-batch-size", "100", "--out-dir", str(tmp_path / "out2")])
    assert T.is_input_error(e.value)


# --- schedules and resumable runs -----------------------------------------------------------------

def test_schedules_run_on_steps_when_a_step_count_is_given():
    recipe = T.Recipe(max_steps=40)
    assert T.training_progress(10, charged_seconds=999.0, training_seconds=100.0, recipe=recipe) == 0.25
    assert T.training_progress(10, charged_seconds=25.0, training_seconds=100.0, recipe=T.Recipe()) == 0.25
    assert T.training_progress(10, charged_seconds=250.0, training_seconds=100.0, recipe=T.Recipe()) == 1.0


def tiny_model_and_optimizer(recipe, seed=0):
    torch.manual_seed(seed)
    model = T.build_model(T.model_config(recipe), dtype="fp32")
    optimizer = T.build_optimizer(model, recipe, ns_dtype=None)
    model(torch.randint(0, 8000, (2, 16)), torch.randint(0, 8000, (2, 16))).backward()
    optimizer.step()  # optimizer state exists
    return model, optimizer


def test_snapshot_round_trip_and_refusals(tmp_path):
    recipe = T.parse_command_line(TINY[:8])[0]
    geometry, clock = T.batch_geometry(1024, 8, 128, 1), T.BudgetClock()
    model, optimizer = tiny_model_and_optimizer(recipe)
    state_dir = tmp_path / "state"
    for step, tokens, loss in ((7, 7168, 3.0), (9, 9216, 2.0)):
        run = T.RunState(step=step, tokens_seen=tokens, smooth_loss=loss)
        T.save_snapshot(state_dir, model, optimizer, run, recipe, geometry, 0, clock)
    assert sorted(p.name for p in state_dir.iterdir()) == ["latest.json", "step_000009"]  # older ones go

    fresh, fresh_optimizer = tiny_model_and_optimizer(recipe, seed=1)
    assert not torch.equal(fresh.wte.weight, model.wte.weight)
    run = T.load_snapshot(state_dir, fresh, fresh_optimizer, recipe, geometry, 0)
    assert (run.step, run.tokens_seen, run.smooth_loss) == (9, 9216, 2.0)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    saved, restored = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for k in saved:
        for name, value in saved[k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(restored[k][name])), (k, name)

    with pytest.raises(ValueError, match=r"--matrix-lr 0.04 -> 0.05"):
        T.load_snapshot(state_dir, fresh, fresh_optimizer, dataclasses.replace(recipe, matrix_lr=0.05), geometry, 0)
    # The snapshot records the recipe only: run options (output, compilation, kernels) may change on resume.
    assert json.loads((state_dir / "latest.json").read_text())["recipe"] == T.recipe_settings(recipe)
    with pytest.raises(ValueError, match="that run had 1 ranks, this one has 2"):
        T.load_snapshot(state_dir, fresh, fresh_optimizer, recipe, T.batch_geometry(1024, 4, 128, 2), 0)
    with pytest.raises(ValueError, match="optimizer_rank00001.pt is missing"):
        pointer = json.loads((state_dir / "latest.json").read_text())
        (state_dir / "latest.json").write_text(json.dumps(dict(pointer, world_size=2)))
        T.load_snapshot(state_dir, fresh, fresh_optimizer, recipe, T.batch_geometry(1024, 4, 128, 2), 1)
    with pytest.raises(ValueError, match="no snapshot there"):
        T.load_snapshot(tmp_path / "nothing", fresh, fresh_optimizer, recipe, geometry, 0)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(tmp_path, text_dataset, monkeypatch):
    """SIGKILL a run that snapshots after every step (so the kill may land mid-write), resume it, and
    compare with an uninterrupted run: the same final weights, bit for bit (fp32, one process)."""
    env = {"FRONTIER_DATA_DIR": str(text_dataset)}
    args = [*TINY, "--dtype", "fp32", "--max-steps", "20", "--eval-tokens", "0"]
    full = run_train([*args, "--out-dir", str(tmp_path / "full")], env, cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-2000:]

    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args, "--save-every", "1e-9", "--out-dir",
                             str(killed_dir)], cwd=tmp_path, env=dict(os.environ, **env, PYTHONPATH=str(REPO)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pointer = killed_dir / "state" / "latest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(pointer.read_text())["run"]["step"] >= 6:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]  # killed, not finished
    assert not (killed_dir / "final.pt").exists()

    resumed = run_train([*args, "--resume", str(killed_dir / "state"), "--out-dir", str(killed_dir)], env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    step = json.loads(pointer.read_text())["run"]["step"]  # the run ends with no snapshot: still the one resumed
    assert f"at step {step}," in resumed.stdout and 6 <= step < 20
    assert summary(resumed.stdout)["num_steps"] == "20"
    a = torch.load(tmp_path / "full" / "final.pt", weights_only=True)["model_state"]
    b = torch.load(killed_dir / "final.pt", weights_only=True)["model_state"]
    for name in a:
        assert torch.equal(a[name], b[name]), name

    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    with pytest.raises(ValueError, match="--max-steps 20 -> 21"):
        T.main([*args, "--max-steps", "21", "--resume", str(killed_dir / "state")])


# --- several servers, and the evaluation on every rank ---------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_servers_rank_by_rank_and_evaluation_on_every_rank(tmp_path, text_dataset):
    """Two torchrun launchers with one process each, joined by c10d rendezvous, stand in for two
    servers: both processes have LOCAL_RANK 0, so RANK and LOCAL_RANK differ on the second."""
    port, records = free_port(), tmp_path / "records"
    records.mkdir()
    env = dict(os.environ, FRONTIER_DATA_DIR=str(text_dataset), PYTHONPATH=str(REPO), RECORD_DIR=str(records))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-servers",
              str(REPO / "tests" / "fixtures" / "instrumented_train.py"), *TINY, "--total-batch-size", "2048",
              "--max-steps", "3", "--eval-tokens", "2048", "--out-dir", str(tmp_path / "out")]
    servers = [subprocess.Popen(launch, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in servers]
    for p, (out, err) in zip(servers, outputs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    reports = [out for out, _ in outputs if "\n---\n" in out]
    assert len(reports) == 1  # global rank 0 reports, once
    s = summary(reports[0])
    assert s["device"] == "cpu x 2" and s["num_steps"] == "3" and math.isfinite(float(s["val_bpb"]))
    rank0, rank1 = (json.loads((records / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["local_rank"] == rank1["local_rank"] == 0
    assert rank0["first_batch"] != rank1["first_batch"]  # data sharded by global rank
    assert len(rank0["evaluate_bpb"]) == len(rank1["evaluate_bpb"]) == 1  # every rank evaluates ...
    assert rank0["evaluate_bpb"] == rank1["evaluate_bpb"]  # ... with the same arguments
    assert (tmp_path / "out" / "final.pt").exists()
