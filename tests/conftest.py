from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import make_text_source, random_documents, run_prepare

# Evaluations keep the kernel's caches between their workers (dropping them is machine-wide and makes
# every next start cold); the tests of the drop itself set FRONTIER_KEEP_KERNEL_CACHES=0.
os.environ["FRONTIER_KEEP_KERNEL_CACHES"] = "1"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """No test reads or writes the user's cache."""
    monkeypatch.setenv("FRONTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FRONTIER_DATA_DIR", raising=False)
    return tmp_path / "cache"


def _setup(tmp_root, source_args):
    cache = tmp_root / "cache"
    result = run_prepare(["setup", *source_args], {"FRONTIER_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stdout + result.stderr
    return Path(json.loads((cache / "active.json").read_text())["dataset_dir"])


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory):
    """600 generated documents as a dir: source, with the shipped tokenizer: 2 shards."""
    root = tmp_path_factory.mktemp("text_dataset")
    source = make_text_source(root / "source", random_documents(600, seed=1))
    return _setup(root, ["--source", f"dir:{source}", "--tokenizer", "stdlib"])


@pytest.fixture(scope="session")
def stdlib_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib_dataset")
    return _setup(root, ["--source", "stdlib"])


TINY_MODEL_ARGS = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "128",
                   "--device-batch-size", "8", "--total-batch-size", "1024", "--eval-tokens", "4096",
                   "--log-every", "10", "--device", "cpu"]
# MFU against a given peak: no CPU matmul measurement (a second) in every train.py the tests start; the
# measurement itself runs in tiny_training and tests/test_model.py.
TINY_TRAIN_ARGS = TINY_MODEL_ARGS + ["--peak-tflops", "0.1"]


@pytest.fixture(scope="session")
def tiny_training(tmp_path_factory, text_dataset):
    """A tiny model trained for 60 steps on the generated text: (checkpoint path, stdout)."""
    import os
    import subprocess
    import sys
    from helpers import REPO
    out = tmp_path_factory.mktemp("trained")
    env = dict(os.environ, FRONTIER_DATA_DIR=str(text_dataset), PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY_MODEL_ARGS, "--max-steps", "60",
                             "--time-budget", "600", "--out-dir", str(out / "out")], cwd=out, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out / "out" / "final.pt", result.stdout


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_training):
    return tiny_training[0]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The weights of the hostile participants' bigram (tests/hostile.py)."""
    import torch
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "final.pt"
    torch.save({"state_dict": {"emb.weight": torch.randn(8192, 16), "head.weight": torch.randn(8192, 16) * 0.3}}, path)
    return str(path)


@pytest.fixture(scope="session")
def honest(tmp_path_factory, checkpoint, text_dataset):
    """The honest bigram's result lines through eval-public at the short test context."""
    from hostile import evaluate, participant
    result, lines = evaluate(participant(tmp_path_factory.mktemp("honest"), "train"), checkpoint, text_dataset)
    assert result.returncode == 0, result.stderr
    return lines


@pytest.fixture
def train_main(monkeypatch, text_dataset):
    """train.py's main(argv) in this process, on the generated text, each call as a new process would start:
    an empty budget ledger (the harness's, which takes steps in order from 0 once per process) and no
    compiled graphs. For what is not about the process boundary: the loop, its errors, its host reads."""
    import torch
    from harness import ledger
    from helpers import REPO
    sys.path.insert(0, str(REPO))
    import train
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))

    def main(argv):
        monkeypatch.setattr(ledger, "_LEDGER", ledger._fresh_ledger())
        torch._dynamo.reset()
        return train.main(argv)
    return main


@pytest.fixture(scope="session")
def two_rank_steps(tmp_path_factory):
    """tests/fixtures/one_step.py and sharded_step.py under one torchrun of 2 processes (the CI's standard):
    the folder with their results (ddp.pt; rank0.pt, rank1.pt)."""
    import subprocess
    from helpers import REPO
    out = tmp_path_factory.mktemp("two_rank_steps")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO / "tests" / "fixtures" / "two_rank_steps.py"), str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out
