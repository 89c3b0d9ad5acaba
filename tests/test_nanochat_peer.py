"""benchmarks/nanochat_peer.py and benchmarks/nanochat_adapter.py: nanochat's own base_train on the kit's data
and tokenizer, scored by the kit's metric. A CPU rehearsal end to end (prepare, a few seconds of training,
eval-public through the adapter, the adapter's logits against nanochat's own GPT), skipped unless
NANOCHAT_SNAPSHOT names the pinned nanochat tarball (nanochat-92d63d4.tar.gz)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, run_prepare

SNAPSHOT = os.environ.get("NANOCHAT_SNAPSHOT")
PEER = REPO / "benchmarks" / "nanochat_peer.py"
ADAPTER = REPO / "benchmarks" / "nanochat_adapter.py"

# nanochat's GPT (from the unpacked copy) and the adapter on the same checkpoint and tokens, both frozen
COMPARE = r"""
import importlib.util, json, sys, torch
sys.path.insert(0, ".")
from nanochat.gpt import GPT, GPTConfig
spec = importlib.util.spec_from_file_location("adapter", sys.argv[2])
adapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(adapter)
ck = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
cfg = GPTConfig(**ck["model_config"])
with torch.device("meta"):
    ref = GPT(cfg)
ref.to_empty(device="cpu")
ref.init_weights()
ref.load_state_dict(ck["model_state"], strict=True, assign=True)
ref.eval().requires_grad_(False)
mine = adapter.load_for_eval(sys.argv[1], torch.device("cpu"))
g = torch.Generator().manual_seed(0)
diffs = []
for B, T in ((2, 1024), (3, 100)):
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    with torch.no_grad():
        diffs.append((ref(idx) - mine(idx)).abs().max().item())
print(json.dumps(diffs))
"""


@pytest.mark.slow
@pytest.mark.skipif(not SNAPSHOT, reason="set NANOCHAT_SNAPSHOT to the nanochat-92d63d4.tar.gz snapshot")
def test_cpu_rehearsal(tmp_path, stdlib_dataset):
    env = dict(os.environ, FRONTIER_DATA_DIR=str(stdlib_dataset))
    work, out = tmp_path / "work", tmp_path / "out"

    def peer(*args, timeout=300):
        result = subprocess.run([sys.executable, str(PEER), *args], env=env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        return result

    prepared = peer("prepare", "--snapshot", SNAPSHOT, "--work", str(work))
    assert "nanochat's tokenizer gives the kit's ids" in prepared.stdout
    assert sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) < 4e6
    peer("train", "--work", str(work), "--out", str(out), "--device", "cpu", "--seconds", "6",
         "--measure-steps", "3", "--depth", "2", "--seq-len", "256", "--device-batch-size", "4",
         "--total-batch-size", "1024", "--no-compile")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= 14 and summary["steps"] == summary["num_iterations"]
    assert summary["time_budget_line"].startswith("time budget: 6.0s")
    assert summary["tokens_per_step"] == 1024 and summary["tokens"] == 1024 * summary["steps"]
    assert summary["tokens_per_second"] > 0 and summary["training_seconds"] > 0
    assert summary["attention"].startswith("torch SDPA") and summary["nanochat_commit"] == "92d63d4"
    assert summary["num_params"] > 0 and summary["tokenizer_check"]["parquet_files"] >= 2

    # the adapter gives nanochat's logits
    compare = subprocess.run([sys.executable, "-c", COMPARE, str(out / "final.pt"), str(ADAPTER)],
                             cwd=work / "nanochat", env=dict(env, PYTHONPATH=str(work / "active_shims")),
                             capture_output=True, text=True, timeout=300)
    assert compare.returncode == 0, compare.stderr[-2000:]
    assert max(json.loads(compare.stdout.strip().splitlines()[-1])) <= 1e-5

    # the kit's scorer takes the adapter and the checkpoint
    result = run_prepare(["eval-public", "--train-py", str(ADAPTER), "--checkpoint", str(out / "final.pt"),
                          "--max-tokens", "4096", "--device", "cpu"], {"FRONTIER_DATA_DIR": str(stdlib_dataset)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in result.stdout.splitlines()
                                                if ":" in ln and not ln.startswith("["))}
    assert 0 < float(lines["val_bpb"]) < 20 and lines["causality_passed"] == "True"


def test_failures_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(PEER), "train", "--work", str(tmp_path / "none"), "--out",
                             str(tmp_path / "out"), "--seconds", "5", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("nanochat_peer: error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "is not prepared" in result.stderr
