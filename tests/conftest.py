from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_text_source, random_documents, run_prepare

# Evaluations keep the kernel's caches between their workers (dropping them is machine-wide and makes
# every next start cold); the tests of the drop itself set FRONTIER_KEEP_KERNEL_CACHES=0.
os.environ["FRONTIER_KEEP_KERNEL_CACHES"] = "1"


def _one_thread_per_test_process() -> None:
    """Under pytest-xdist (`make test` runs `-n 2`, one test process per core): one matmul thread in each
    test process and all it starts, so that two processes' thread pools do not spin against each other
    for the same cores. Not pinned: a test of CPU slots (tests/test_autoresearch_slots.py) needs every
    core, and a test that starts several processes (torchrun) may use both."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


_one_thread_per_test_process()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort: each group keeps its order), so that under pytest-xdist the
    long ones start early and the short ones fill in at the end, instead of one process finishing a
    long test while the other waits. The tests of the one torchrun launch (two_ranks) in one process,
    which starts it while the other goes on."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        if "two_ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("two-ranks"))


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """No test reads or writes the user's cache."""
    monkeypatch.setenv("FRONTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FRONTIER_DATA_DIR", raising=False)
    return tmp_path / "cache"


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name` that build(folder) fills, built once per run of the suite: under pytest-xdist
    the first test process that needs it builds it while the others wait on a lock, then all read it
    (session fixtures are otherwise per process). What build makes is only read afterwards."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each test process's own
    folder, done = root / f"once-{name}", root / f"once-{name}.done"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def _setup(tmp_root, source_args):
    cache = tmp_root / "cache"
    result = run_prepare(["setup", *source_args], {"FRONTIER_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stdout + result.stderr


def _dataset_dir(tmp_root) -> Path:
    return Path(json.loads((tmp_root / "cache" / "active.json").read_text())["dataset_dir"])


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory):
    """600 generated documents as a dir: source, with the shipped tokenizer: 2 shards."""
    def build(root):
        source = make_text_source(root / "source", random_documents(600, seed=1))
        _setup(root, ["--source", f"dir:{source}", "--tokenizer", "stdlib"])
    return _dataset_dir(built_once(tmp_path_factory, "text_dataset", build))


@pytest.fixture(scope="session")
def stdlib_dataset(tmp_path_factory):
    return _dataset_dir(built_once(tmp_path_factory, "stdlib_dataset",
                                   lambda root: _setup(root, ["--source", "stdlib"])))


TINY_MODEL_ARGS = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "128",
                   "--device-batch-size", "8", "--total-batch-size", "1024", "--eval-tokens", "4096",
                   "--log-every", "10", "--device", "cpu"]
# MFU against a given peak: no CPU matmul measurement (a second) in every train.py the tests start; the
# measurement itself runs in tiny_training and tests/test_model.py.
TINY_TRAIN_ARGS = TINY_MODEL_ARGS + ["--peak-tflops", "0.1"]


@pytest.fixture(scope="session")
def tiny_training(tmp_path_factory, text_dataset):
    """A tiny model trained for 60 steps on the generated text: (checkpoint path, stdout)."""
    from helpers import REPO

    def build(out):
        env = dict(os.environ, FRONTIER_DATA_DIR=str(text_dataset), PYTHONPATH=str(REPO))
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY_MODEL_ARGS, "--max-steps", "60",
                                 "--time-budget", "600", "--out-dir", str(out / "out")], cwd=out, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        (out / "stdout.txt").write_text(result.stdout)
    out = built_once(tmp_path_factory, "tiny_training", build)
    return out / "out" / "final.pt", (out / "stdout.txt").read_text()


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_training):
    return tiny_training[0]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The weights of the hostile participants' bigram (tests/hostile.py)."""
    import torch

    def build(folder):
        torch.manual_seed(0)
        torch.save({"state_dict": {"emb.weight": torch.randn(8192, 16), "head.weight": torch.randn(8192, 16) * 0.3}},
                   folder / "final.pt")
    return str(built_once(tmp_path_factory, "checkpoint", build) / "final.pt")


@pytest.fixture(scope="session")
def honest(tmp_path_factory, checkpoint, text_dataset):
    """The honest bigram's result lines through eval-public at the short test context."""
    from hostile import evaluate, participant

    def build(folder):
        result, lines = evaluate(participant(folder, "train"), checkpoint, text_dataset)
        assert result.returncode == 0, result.stderr
        (folder / "lines.json").write_text(json.dumps(lines))
    return json.loads((built_once(tmp_path_factory, "honest", build) / "lines.json").read_text())


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


TWO_RANKS_TIMEOUT = 900  # seconds for the whole launch: far past what its jobs take (about a minute)


@pytest.fixture(scope="session")
def two_ranks(request, tmp_path_factory):
    """The distributed runs of the harness's commands, all in one torchrun launch of 2 processes (the CI's
    standard; each launch costs about 5 s of starting processes). Every test module that uses this fixture
    lists its jobs in a function two_rank_jobs(folder, request) -> [job] (tests/fixtures/two_rank_jobs.py
    says what a job is; request gives the session's fixtures), the inputs written under folder; only the
    modules of the tests selected run. Returns the folder and name -> CompletedProcess per job: both ranks'
    output, rank 0's first, and the exit code of the first rank that failed (0 if none did; -1 where a
    rank has none, with why and the launch's own output), so each test fails on its own job's outcome."""
    from helpers import REPO
    modules = sorted({item.module for item in request.session.items if "two_ranks" in item.fixturenames},
                     key=lambda m: m.__name__)

    def build(folder):
        jobs = [job for module in modules for job in module.two_rank_jobs(folder, request)]
        (folder / "jobs.json").write_text(json.dumps(jobs))
        launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                   str(REPO / "tests" / "fixtures" / "two_rank_jobs.py"), str(folder / "jobs.json"),
                                   str(folder)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
        try:
            output = launch.communicate(timeout=TWO_RANKS_TIMEOUT)[0]
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)  # the launcher and its ranks
            output = launch.communicate()[0] + f"\n(the launch was stopped after {TWO_RANKS_TIMEOUT} s)"
        (folder / "launch.log").write_text(f"exit code {launch.returncode}\n{output}")

    folder = built_once(tmp_path_factory, "two_ranks", build)

    def read(path) -> str:
        return path.read_text() if path.exists() else ""

    results = {}
    for job in json.loads((folder / "jobs.json").read_text()):
        paths = [{k: folder / f"{job['name']}.rank{r}.{k}" for k in ("stdout", "stderr", "code")} for r in (0, 1)]
        codes = [int(p["code"].read_text()) if p["code"].exists() else None for p in paths]
        stderr = "".join(read(p["stderr"]) for p in paths)
        if None in codes:
            stderr += f"\n(a rank gave no exit code; the launch said:)\n{read(folder / 'launch.log')[-3000:]}"
        results[job["name"]] = subprocess.CompletedProcess(
            job, -1 if None in codes else next((c for c in codes if c), 0),
            "".join(read(p["stdout"]) for p in paths), stderr)
    return folder, results


@pytest.fixture(scope="session")
def two_rank_steps(tmp_path_factory):
    """tests/fixtures/one_step.py and sharded_step.py under one torchrun of 2 processes (the CI's standard):
    the folder with their results (ddp.pt; rank0.pt, rank1.pt)."""
    from helpers import REPO

    def build(out):
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(REPO / "tests" / "fixtures" / "two_rank_steps.py"), str(out)],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return built_once(tmp_path_factory, "two_rank_steps", build)
