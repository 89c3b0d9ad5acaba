"""autoresearch/: the loop end to end in a temporary git repository, on CPU with a tiny budget."""
from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import TINY_TRAIN_ARGS
from helpers import REPO, commit_new_repo, git

KIT_FILES = ["prepare.py", "harness", "train.py", ".gitignore", "tokenizer", "kernels", "autoresearch/loop.py",
             "autoresearch/slots.py", "autoresearch/results.py", "autoresearch/run.sh", "autoresearch/program.md"]


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
def test_the_real_kit_end_to_end(kit_repo, text_dataset):
    """One run of the loop over the real train.py and the contained eval-public: the baseline scores under
    half of what a model that learned nothing would (1.7 against 6.1 bits per byte, measured) and is kept,
    the branch stays at it, the run's log and the plot are written and ignored by git. The loop's other
    verdicts (discard, crash, timeout) and two slots: tests/test_autoresearch_slots.py, on stand-ins."""
    baseline = edit_and_commit(kit_repo, {STEPS: "\n    max_steps: int = 12 "}, "baseline: 12 steps")
    result = run_loop(kit_repo, text_dataset, "--budget", "60", "--timeout", "120")  # 12 steps, far inside it
    assert result.returncode == 0 and "kept" in result.stdout, result.stdout + result.stderr
    assert git(kit_repo, "rev-parse", "--short=7", "HEAD") == baseline

    r = rows(kit_repo)
    assert [(x["commit"], x["status"], x["slot"]) for x in r] == [(baseline, "keep", "0")]
    [log] = (kit_repo / "autoresearch" / "runs").glob(f"*-{baseline}/eval.log")  # the contained eval-public's
    scored = dict(line.split(":", 1) for line in log.read_text().splitlines() if line.startswith("eval_"))
    uniform = math.log2(8192) * int(scored["eval_tokens"]) / int(scored["eval_bytes"])  # a model that learned nothing
    assert 0 < float(r[0]["val_bpb"]) < 0.5 * uniform, (r[0]["val_bpb"], uniform)
    assert float(r[0]["memory_gb"]) > 0
    png = kit_repo / "autoresearch" / "progress.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(png).shape[2] in (3, 4)
    assert git(kit_repo, "status", "--porcelain") == ""  # results, runs and the plot are ignored by git


@pytest.mark.slow
def test_uncommitted_changes_are_refused(kit_repo, text_dataset):
    (kit_repo / "train.py").write_text((kit_repo / "train.py").read_text() + "\n# edited\n")
    result = run_loop(kit_repo, text_dataset)
    assert result.returncode == 1 and "commit the experiment first" in result.stderr
    assert not (kit_repo / "autoresearch" / "results.tsv").exists()
