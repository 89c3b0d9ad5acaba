"""autoresearch with several slots: the slot plan, the shared table, and the loop's scheduling,
crashes, hangs and Ctrl-C, on a kit whose train.py and prepare.py are stand-ins (real processes,
no model), so timing is the test's own. The real train.py in two slots: tests/test_autoresearch.py."""
from __future__ import annotations

import csv
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from helpers import REPO, commit_new_repo, git

sys.path.insert(0, str(REPO / "autoresearch"))
import results  # noqa: E402
import slots  # noqa: E402

# A train.py stand-in: reports where it ran, "trains" for SECONDS, writes a checkpoint the fake
# eval-public reads VAL_BPB from. HANG: sleeps forever, with a child in a session of its own (as
# torchrun starts its workers), which the loop must find and kill too.
FAKE_TRAIN = '''import argparse, json, os, subprocess, sys, time
VAL_BPB = 2.0
SECONDS = 0.5
HANG = False
p = argparse.ArgumentParser()
p.add_argument("--out-dir")
args, _ = p.parse_known_args()
os.makedirs(args.out_dir)
info = {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "threads": os.environ.get("OMP_NUM_THREADS")}
if HANG:
    info["child"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True).pid
with open(os.path.join(args.out_dir, "..", "fake.json"), "w") as f:
    json.dump(info, f)
time.sleep(600 if HANG else SECONDS)
with open(os.path.join(args.out_dir, "final.pt"), "w") as f:
    json.dump({"val_bpb": VAL_BPB}, f)
print("---\\npeak_memory_mb: 512")
'''
FAKE_PREPARE = '''import argparse, json
p = argparse.ArgumentParser()
p.add_argument("command")
p.add_argument("--checkpoint")
args, _ = p.parse_known_args()
with open(args.checkpoint) as f:
    print("---\\nval_bpb: %.6f" % json.load(f)["val_bpb"])
'''



@pytest.fixture
def fake_kit(tmp_path):
    repo = tmp_path / "kit"
    (repo / "autoresearch").mkdir(parents=True)
    for name in ("loop.py", "slots.py", "results.py", "run.sh"):
        shutil.copy2(REPO / "autoresearch" / name, repo / "autoresearch" / name)
    shutil.copy2(REPO / ".gitignore", repo / ".gitignore")
    (repo / "train.py").write_text(FAKE_TRAIN)
    (repo / "prepare.py").write_text(FAKE_PREPARE)
    return commit_new_repo(repo, "autoresearch/test", "baseline")


def commit(repo, message, **constants):
    text = (repo / "train.py").read_text()
    for name, value in constants.items():
        lines = [f"{name} = {value!r}" if line.startswith(f"{name} = ") else line for line in text.splitlines()]
        text = "\n".join(lines) + "\n"
    (repo / "train.py").write_text(text)
    git(repo, "commit", "-qam", message)
    return git(repo, "rev-parse", "--short=7", "HEAD")


def loop(repo, *args, timeout=120):
    return subprocess.run([sys.executable, "loop.py", *args], cwd=repo / "autoresearch", capture_output=True,
                          text=True, timeout=timeout)


def run_args(*extra):
    return ["run", "--device", "cpu", "--budget", "30", *extra]


def table(repo):
    with open(repo / "autoresearch" / "results.tsv", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def fake_info(repo, commit_):
    [path] = (repo / "autoresearch" / "runs").glob(f"*-{commit_}/fake.json")
    return json.loads(path.read_text())


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


# --- the plan of slots, and the table --------------------------------------------------------

def test_cpu_slots_split_the_cores():
    assert [(s.cpus, s.env) for s in slots.plan_slots("cpu", 2, {}, [(0,), (1,)])] == \
        [((0,), {"OMP_NUM_THREADS": "1"}), ((1,), {"OMP_NUM_THREADS": "1"})]
    assert [s.cpus for s in slots.plan_slots("cpu", 2, {}, [(4,), (5,), (6,), (7,), (8,)])] == [(4, 5), (6, 7)]
    assert slots.plan_slots("cpu", 1, {}, [(0,), (1,)])[0].env == {"OMP_NUM_THREADS": "2"}
    smt = slots.plan_slots("cpu", 2, {}, [(0, 4), (1, 5), (2, 6), (3, 7)])  # hyperthread siblings stay together
    assert [(s.cpus, s.env["OMP_NUM_THREADS"]) for s in smt] == [((0, 1, 4, 5), "2"), ((2, 3, 6, 7), "2")]
    with pytest.raises(slots.SlotError, match="at most one slot per core"):
        slots.plan_slots("cpu", 3, {}, [(0,), (1,)])
    cores = slots.usable_cores()  # this machine's: every usable CPU in exactly one core
    assert sorted(cpu for core in cores for cpu in core) == sorted(os.sched_getaffinity(0))


def test_accelerator_slots_get_one_device_each():
    neuron = slots.plan_slots("neuron", 8, {}, [(0,)])
    assert [s.env["NEURON_RT_VISIBLE_CORES"] for s in neuron] == [str(i) for i in range(8)]
    assert {s.env["NEURON_LOGICAL_NC_CONFIG"] for s in neuron} == {"1"} and neuron[0].cpus is None
    lnc2 = slots.plan_slots("neuron", 4, {"NEURON_LOGICAL_NC_CONFIG": "2"}, [(0,)])
    assert [(s.env["NEURON_RT_VISIBLE_CORES"], s.env["NEURON_LOGICAL_NC_CONFIG"]) for s in lnc2] == \
        [("0", "2"), ("1", "2"), ("2", "2"), ("3", "2")]
    some = slots.plan_slots("neuron", 2, {"NEURON_RT_VISIBLE_CORES": "4-5,7"}, [(0,)])
    assert [s.env["NEURON_RT_VISIBLE_CORES"] for s in some] == ["4", "5"]
    with pytest.raises(slots.SlotError, match="makes only 3 visible"):
        slots.plan_slots("neuron", 4, {"NEURON_RT_VISIBLE_CORES": "4-5,7"}, [(0,)])
    assert [s.env for s in slots.plan_slots("cuda", 2, {"CUDA_VISIBLE_DEVICES": "GPU-ab,GPU-cd"}, [(0,)])] == \
        [{"CUDA_VISIBLE_DEVICES": "GPU-ab"}, {"CUDA_VISIBLE_DEVICES": "GPU-cd"}]
    with pytest.raises(slots.SlotError, match="has 1 CUDA GPU"):
        slots.plan_slots("cuda", 2, {}, [(0,)], cuda_count=1)
    with pytest.raises(slots.SlotError, match="at least 1"):
        slots.plan_slots("cuda", 0, {}, [(0,)])


def _append_rows(args):
    path, writer, n = args
    for i in range(n):
        with results.locked(path.with_name("lock")):
            results.append_result(path, {"commit": f"{writer:03d}{i:04d}", "val_bpb": "1.0", "memory_gb": "0.1",
                                         "status": "discard", "slot": writer, "start": "s", "end": "e",
                                         "description": f"writer {writer}\trow {i}\nwith a tab and a newline"})


def test_concurrent_appends_never_lose_or_split_a_row(tmp_path):
    path = tmp_path / "results.tsv"
    with multiprocessing.get_context("fork").Pool(6) as pool:
        pool.map(_append_rows, [(path, w, 40) for w in range(6)])
    rows = results.read_results(path)
    assert len(rows) == 240 and len({r["commit"] for r in rows}) == 240
    assert all(r["description"].startswith("writer ") and "\t" not in r["description"] for r in rows)
    assert path.read_text().count("commit\tval_bpb") == 1


def test_a_table_of_the_old_format_is_refused(fake_kit):
    (fake_kit / "autoresearch" / "results.tsv").write_text("commit\tval_bpb\tmemory_gb\tstatus\tdescription\n")
    result = loop(fake_kit, *run_args())
    assert result.returncode == 1 and "move the old table aside" in result.stderr
    assert not (fake_kit / "autoresearch" / "runs" / "queue").exists() or not list(
        (fake_kit / "autoresearch" / "runs" / "queue").iterdir())


# --- the loop ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_one_slot_keeps_discards_crashes_and_times_out(fake_kit):
    """The loop's verdicts one after the other: the baseline and a better idea are kept, a worse one is
    discarded (the branch stays at the better), a train.py that does not parse is a crash with its error in the
    table and crash.txt, a hang is killed at --timeout and is a crash too; every row has its slot, the plot is
    drawn, and nothing the loop writes is tracked by git."""
    assert loop(fake_kit, *run_args()).returncode == 0
    baseline = git(fake_kit, "rev-parse", "--short=7", "HEAD")
    better = commit(fake_kit, "better", VAL_BPB=1.5)
    assert loop(fake_kit, *run_args()).returncode == 0
    worse = commit(fake_kit, "worse", VAL_BPB=1.75)
    result = loop(fake_kit, *run_args())
    assert result.returncode == 0 and "discarded" in result.stdout, result.stdout + result.stderr
    assert git(fake_kit, "rev-parse", "--short=7", "HEAD") == better  # the branch keeps the better commit
    (fake_kit / "train.py").write_text((fake_kit / "train.py").read_text() + "def broken(:\n")
    git(fake_kit, "commit", "-qam", "syntax error")
    broken = git(fake_kit, "rev-parse", "--short=7", "HEAD")
    result = loop(fake_kit, *run_args())
    assert result.returncode == 0 and "CRASH" in result.stdout and "SyntaxError" in result.stdout
    git(fake_kit, "reset", "-q", "--hard", better)
    hang = commit(fake_kit, "hangs", HANG=True)
    result = loop(fake_kit, *run_args("--timeout", "2"))
    assert result.returncode == 0 and "timeout: train.py killed after 2s" in result.stdout
    assert git(fake_kit, "rev-parse", "--short=7", "HEAD") == better

    r = table(fake_kit)
    assert [(x["commit"], x["status"]) for x in r] == [(baseline, "keep"), (better, "keep"), (worse, "discard"),
                                                       (broken, "crash"), (hang, "crash")]
    assert {x["slot"] for x in r} == {"0"} and r[3]["val_bpb"] == r[4]["val_bpb"] == "0.000000"
    assert "syntax error [train.py exited with 1;" in r[3]["description"] and float(r[1]["memory_gb"]) > 0
    [crash_dir] = (fake_kit / "autoresearch" / "runs").glob(f"*-{broken}")
    assert "SyntaxError" in (crash_dir / "crash.txt").read_text()
    assert not alive(fake_info(fake_kit, hang)["child"])
    assert (fake_kit / "autoresearch" / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert git(fake_kit, "status", "--porcelain") == ""


@pytest.mark.slow
@pytest.mark.skipif(len(slots.usable_cores()) < 2, reason="two CPU slots need two cores")
def test_two_slots_pin_judge_and_kill_a_hang(fake_kit):
    assert loop(fake_kit, *run_args("--slots", "2")).returncode == 0  # an empty queue: HEAD, the baseline
    baseline = git(fake_kit, "rev-parse", "--short=7", "HEAD")
    ideas = {}
    for name, constants in (("better", dict(VAL_BPB=1.5, SECONDS=2.0)), ("worse", dict(VAL_BPB=2.5, SECONDS=2.0)),
                            ("hang", dict(HANG=True)), ("best", dict(VAL_BPB=1.25))):
        ideas[name] = commit(fake_kit, name, **constants)
        queued = loop(fake_kit, "queue")
        assert queued.returncode == 0 and f"to {baseline}" in queued.stdout, queued.stdout + queued.stderr
        assert git(fake_kit, "rev-parse", "--short=7", "HEAD") == baseline  # siblings: each from the best
    result = loop(fake_kit, *run_args("--slots", "2", "--timeout", "6"))
    assert result.returncode == 0, result.stdout + result.stderr

    rows = {r["commit"]: r for r in table(fake_kit)}
    assert [rows[ideas[n]]["status"] for n in ("better", "worse", "hang", "best")] == \
        ["keep", "discard", "crash", "keep"]
    assert "timeout: train.py killed after 6s" in rows[ideas["hang"]]["description"]
    better, worse = fake_info(fake_kit, ideas["better"]), fake_info(fake_kit, ideas["worse"])
    assert {rows[ideas["better"]]["slot"], rows[ideas["worse"]]["slot"]} == {"0", "1"}
    (b0, b1), (w0, w1) = [[datetime.fromisoformat(rows[ideas[n]][k]) for k in ("start", "end")]
                          for n in ("better", "worse")]
    assert max(b0, w0) < min(b1, w1)  # side by side
    plan = {str(s.index): s for s in slots.plan_slots("cpu", 2, {}, slots.usable_cores())}
    for info, row in ((better, rows[ideas["better"]]), (worse, rows[ideas["worse"]])):  # the child got its slot's
        slot = plan[row["slot"]]
        assert tuple(info["cpus"]) == slot.cpus and info["threads"] == slot.env["OMP_NUM_THREADS"]
    assert not set(better["cpus"]) & set(worse["cpus"])
    hang = fake_info(fake_kit, ideas["hang"])
    assert not alive(hang["pid"]) and not alive(hang["child"])  # the child in its own session went too
    assert git(fake_kit, "rev-parse", "--short=7", "HEAD") == ideas["best"]
    assert git(fake_kit, "status", "--porcelain") == ""
    status = loop(fake_kit, "status").stdout
    assert f"best: 1.250000 at {ideas['best']}" in status and "no loop is running" in status


@pytest.mark.slow
def test_the_branch_waits_for_uncommitted_work(fake_kit):
    assert loop(fake_kit, *run_args()).returncode == 0
    base = git(fake_kit, "rev-parse", "--short=7", "HEAD")
    commit(fake_kit, "better", VAL_BPB=1.5)
    assert loop(fake_kit, "queue").returncode == 0
    assert git(fake_kit, "rev-parse", "--short=7", "HEAD") == base
    (fake_kit / "train.py").write_text((fake_kit / "train.py").read_text() + "# the next idea, half-written\n")
    result = loop(fake_kit, *run_args())
    assert result.returncode == 0 and "stays at" in result.stdout and "uncommitted changes" in result.stdout
    assert git(fake_kit, "rev-parse", "--short=7", "HEAD") == base
    assert (fake_kit / "train.py").read_text().endswith("# the next idea, half-written\n")
    refused = loop(fake_kit, "queue")
    assert refused.returncode == 1 and "commit the experiment first" in refused.stderr
    assert loop(fake_kit, "queue", "no-such-commit").returncode == 1


def wait_for(predicate, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(len(slots.usable_cores()) < 2, reason="two CPU slots need two cores")
def test_ctrl_c_stops_every_slot_and_keeps_the_table(fake_kit):
    quick = commit(fake_kit, "quick", VAL_BPB=1.5)
    hangs = [commit(fake_kit, f"hang {i}", HANG=True, VAL_BPB=3.0 + i) for i in range(3)]
    for c in (hangs[0], quick, hangs[1], hangs[2]):
        assert loop(fake_kit, "queue", c).returncode == 0
    runs = fake_kit / "autoresearch" / "runs"
    proc = subprocess.Popen([sys.executable, "loop.py", *run_args("--slots", "2", "--wait")],
                            cwd=fake_kit / "autoresearch", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(list(runs.glob("*/fake.json"))) == 3 and (fake_kit / "autoresearch" / "results.tsv")
                 .exists(), "two hangs running and the quick row written")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert [(r["commit"], r["status"]) for r in table(fake_kit)] == [(quick, "keep")]
    for c in hangs[:2]:
        info = fake_info(fake_kit, c)
        assert not alive(info["pid"]) and not alive(info["child"])
        [run_dir] = runs.glob(f"*-{c}")
        assert (run_dir / "interrupted.txt").exists()
    assert f"python loop.py queue {hangs[0]} {hangs[1]}" in out
    assert [json.loads(p.read_text())["commit"][:7] for p in (runs / "queue").glob("*.json")] == [hangs[2]]
    assert not list((fake_kit / "autoresearch").glob("*.tmp"))
    assert git(fake_kit, "rev-parse", "--short=7", "HEAD") == quick


@pytest.mark.slow
def test_a_second_loop_is_refused_and_leftovers_are_stopped(fake_kit):
    hang = commit(fake_kit, "hang", HANG=True)
    proc = subprocess.Popen([sys.executable, "loop.py", *run_args()], cwd=fake_kit / "autoresearch",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = fake_kit / "autoresearch" / "runs"
    try:
        wait_for(lambda: list(runs.glob("*/fake.json")), "the hang to start")
        second = loop(fake_kit, *run_args())
        assert second.returncode == 1 and "another loop is running" in second.stderr
    finally:
        proc.kill()  # the loop dies outright: its experiment lives on, orphaned
        proc.wait()
    info = fake_info(fake_kit, hang)
    assert alive(info["pid"]) and alive(info["child"])
    commit(fake_kit, "quick", HANG=False)
    result = loop(fake_kit, *run_args())
    assert result.returncode == 0 and "an earlier loop left running" in result.stdout, result.stdout
    assert f"their loop ended before they finished (queue them again to train them): {hang}" in result.stdout
    assert [r["commit"] for r in table(fake_kit)] == [git(fake_kit, "rev-parse", "--short=7", "HEAD")]
    wait_for(lambda: not alive(info["pid"]) and not alive(info["child"]), "the leftovers to go", timeout=10)
