"""autoresearch/: the loop end to end in a temporary git repository, on CPU with a tiny budget."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from datetime import datetime

import pytest

from conftest import TINY_TRAIN_ARGS
from helpers import REPO, commit_new_repo, git

sys.path.insert(0, str(REPO / "autoresearch"))
import slots  # noqa: E402

KIT_FILES = ["prepare.py", "harness", "train.py", ".gitignore", "tokenizer", "kernels", "autoresearch/loop.py",
             "autoresearch/slots.py", "autoresearch/results.py", "autoresearch/run.sh", "autoresearch/program.md"]
FROZEN = {f"\n    {name}: float = {value} ": f"\n    {name}: float = 0.0 " for name, value in
          (("embedding_lr", 0.6), ("unembedding_lr", 0.004), ("matrix_lr", 0.04), ("scalar_lr", 0.5))}



def edit_and_commit(repo, replacements: dict, message: str):
    path = repo / "train.py"
    text = path.read_text()
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    git(repo, "commit", "-qam", message)
    return git(repo, "rev-parse", "--short=7", "HEAD")


@pytest.fixture
def kit_repo(tmp_path):
    repo = tmp_path / "kit"
    for name in KIT_FILES:
        src, dst = REPO / name, repo / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir() else shutil.copy2(src, dst)
    return commit_new_repo(repo, "autoresearch/test", "kit")


def run_loop(repo, dataset, *extra, timeout=300):
    train_args = " ".join(a for a in TINY_TRAIN_ARGS if a not in ("--eval-tokens", "4096"))
    env = dict(os.environ, FRONTIER_DATA_DIR=str(dataset), PYTHON=sys.executable)
    return subprocess.run(["bash", str(repo / "autoresearch" / "run.sh"), "--budget", "12", "--eval-tokens", "8192",
                           "--device", "cpu", "--train-args", train_args, *extra], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout)


def rows(repo):
    with open(repo / "autoresearch" / "results.tsv", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


STEPS = "\n    max_steps: int = 0 "


@pytest.mark.slow
def test_keep_discard_crash_and_timeout(kit_repo, text_dataset):
    # a fixed number of steps, far inside the budget: each run takes seconds, not the budget
    frozen = edit_and_commit(kit_repo, {**FROZEN, STEPS: "\n    max_steps: int = 15 "}, "baseline with frozen weights")
    fixed = ("--budget", "60", "--timeout", "120")
    assert run_loop(kit_repo, text_dataset, *fixed).returncode == 0
    better = edit_and_commit(kit_repo, {v: k for k, v in FROZEN.items()}, "learn")
    assert run_loop(kit_repo, text_dataset, *fixed).returncode == 0
    worse = edit_and_commit(kit_repo, FROZEN, "freeze again")
    result = run_loop(kit_repo, text_dataset, *fixed)
    assert result.returncode == 0 and "discarded" in result.stdout
    assert git(kit_repo, "rev-parse", "--short=7", "HEAD") == better  # the branch keeps the better commit

    broken = edit_and_commit(kit_repo, {"def main(argv=None) -> int:": "def main(argv=None) -> int\n"}, "syntax error")
    result = run_loop(kit_repo, text_dataset, *fixed)
    assert result.returncode == 0 and "CRASH" in result.stdout and "SyntaxError" in result.stdout
    slow = edit_and_commit(kit_repo, {"    recipe, options, notes = parse_command_line(argv)\n":
                                      "    recipe, options, notes = parse_command_line(argv)\n    time.sleep(120)\n"},
                           "hangs")
    result = run_loop(kit_repo, text_dataset, "--timeout", "10")
    assert result.returncode == 0 and "timeout: train.py killed after 10s" in result.stdout
    assert git(kit_repo, "rev-parse", "--short=7", "HEAD") == better

    r = rows(kit_repo)
    assert [x["commit"] for x in r] == [frozen, better, worse, broken, slow]
    assert [x["status"] for x in r] == ["keep", "keep", "discard", "crash", "crash"]
    assert {x["slot"] for x in r} == {"0"}
    assert float(r[1]["val_bpb"]) < float(r[0]["val_bpb"]) < float(r[0]["val_bpb"]) + 1
    assert float(r[2]["val_bpb"]) > float(r[1]["val_bpb"])
    assert r[3]["val_bpb"] == r[4]["val_bpb"] == "0.000000"
    assert "syntax error [train.py exited with 1;" in r[3]["description"]
    assert float(r[1]["memory_gb"]) > 0
    crash_dirs = sorted((kit_repo / "autoresearch" / "runs").glob(f"*-{broken}"))
    assert "SyntaxError" in (crash_dirs[0] / "crash.txt").read_text()

    png = kit_repo / "autoresearch" / "progress.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(png).shape[2] in (3, 4)
    assert git(kit_repo, "status", "--porcelain") == ""  # results, runs and the plot are ignored by git


def test_uncommitted_changes_are_refused(kit_repo, text_dataset):
    (kit_repo / "train.py").write_text((kit_repo / "train.py").read_text() + "\n# edited\n")
    result = run_loop(kit_repo, text_dataset)
    assert result.returncode == 1 and "commit the experiment first" in result.stderr
    assert not (kit_repo / "autoresearch" / "results.tsv").exists()


def times(row: dict) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(row["start"]), datetime.fromisoformat(row["end"])


def within(a: dict, b: dict) -> bool:
    """a started and ended while b ran (to the second), ending strictly before b."""
    (a0, a1), (b0, b1) = times(a), times(b)
    return b0 <= a0 <= a1 < b1


def overlap(a: dict, b: dict) -> bool:
    (a0, a1), (b0, b1) = times(a), times(b)
    return max(a0, b0) < min(a1, b1)


@pytest.mark.slow
@pytest.mark.skipif(len(slots.usable_cores()) < 2, reason="two CPU slots need two cores")
def test_two_slots_at_once(kit_repo, text_dataset):
    """The baseline, then three sibling ideas in two slots: a syntax error crashes in one slot
    while the other trains; the better and the worse idea train at the same time; the branch ends
    at the better. Steps are fixed (the budget is far away), so better and worse do not hang on load."""
    baseline = edit_and_commit(kit_repo, {STEPS: "\n    max_steps: int = 10 "}, "baseline: 10 steps")
    result = run_loop(kit_repo, text_dataset, "--slots", "2", "--budget", "60")
    assert result.returncode == 0, result.stdout + result.stderr

    def idea(replacements, message):
        commit = edit_and_commit(kit_repo, replacements, message)
        queued = subprocess.run([sys.executable, "loop.py", "queue"], cwd=kit_repo / "autoresearch",
                                capture_output=True, text=True)
        assert queued.returncode == 0, queued.stderr
        assert git(kit_repo, "rev-parse", "--short=7", "HEAD") == baseline  # the next idea starts from the best
        return commit

    broken = idea({"def main(argv=None) -> int:": "def main(argv=None) -> int\n"}, "syntax error")
    better = idea({"\n    max_steps: int = 10 ": "\n    max_steps: int = 30 "}, "30 steps")
    worse = idea(FROZEN, "frozen weights")
    result = run_loop(kit_repo, text_dataset, "--slots", "2", "--budget", "60")
    assert result.returncode == 0, result.stdout + result.stderr

    r = {x["commit"]: x for x in rows(kit_repo)}
    assert list(r)[0] == baseline and set(r) == {baseline, broken, better, worse}
    assert [r[c]["status"] for c in (baseline, broken, better, worse)] == ["keep", "crash", "keep", "discard"]
    assert float(r[better]["val_bpb"]) < float(r[baseline]["val_bpb"]) < float(r[worse]["val_bpb"])
    assert "SyntaxError" in r[broken]["description"]
    assert r[broken]["slot"] != r[better]["slot"] and within(r[broken], r[better])  # it crashed while better trained
    assert r[better]["slot"] != r[worse]["slot"] and overlap(r[better], r[worse])  # trained at the same time
    assert git(kit_repo, "rev-parse", "--short=7", "HEAD") == better
    assert git(kit_repo, "status", "--porcelain") == ""
    # both slots trained, each pinned to its share (that the processes got it: test_autoresearch_slots.py)
    headers = {log.read_text().splitlines()[0] for log in (kit_repo / "autoresearch" / "runs").glob("*/train.log")}
    assert headers == {f"# {s.describe()}" for s in slots.plan_slots("cpu", 2, {}, slots.usable_cores())}
