"""Drop-in parity with the organisers' kit, on the harness side: a participant's train.py written
against the official interface trains under torchrun, calls evaluate_bpb and causality_check from
its loop on every rank, and is scored by eval-public; the official environment variables."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import prepare
from harness import config
from helpers import REPO, prepare_in_process, run_prepare

OFFICIAL = REPO / "tests" / "fixtures" / "official_style_train.py"


def _summary(stdout: str) -> dict:
    """The summary lines after the "---" (rank 0 prints them all)."""
    after = stdout.split("---", 1)[1]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in after.splitlines() if ": " in line
                                               and "rank " not in line)}


@pytest.mark.slow
def test_an_official_style_train_py_trains_under_torchrun_and_is_scored(tmp_path, text_dataset):
    env = dict(os.environ, FRONTIER_DATA_DIR=str(text_dataset), PYTHONPATH=str(REPO),
               NEURON_COMPETITION_R1_NUM_STEPS="8", NEURON_COMPETITION_R1_OUT_DIR=str(tmp_path / "out"))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(OFFICIAL)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    s = _summary(run.stdout)
    assert s["num_steps"] == "8" and s["causality_passed"] == "True" and s["over_budget"] == "False"
    # evaluate_bpb ran on both ranks, shared the rows, and both got the same number
    import re
    per_rank = re.findall(r"rank (\d) val_bpb ([0-9.]+)", run.stdout)
    assert sorted(r for r, _ in per_rank) == ["0", "1"] and per_rank[0][1] == per_rank[1][1]
    # the ledger: start-up lasts until the end of step 4 (the fifth), and is not charged
    ends = [float(t) for t in s["step_end_elapsed"].split(",")]
    assert s["startup_steps_excluded"] == "5"
    assert abs(float(s["startup_allowance_est"]) - ends[4]) < 0.05
    assert ends[1] - ends[0] >= 0.5  # the slow first step (0.5 s) fell inside start-up
    checkpoint = tmp_path / "out" / "final.pt"
    import torch
    assert set(torch.load(checkpoint, weights_only=True)) == {"model_state", "model_config", "meta"}
    result = prepare_in_process(["eval-public", "--train-py", str(OFFICIAL), "--checkpoint", str(checkpoint),
                                 "--seq-len", "64", "--max-tokens", "512"], {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert result.returncode == 0, result.stderr
    lines = {k.strip(): v.strip() for k, v in (l.split(":", 1) for l in result.stdout.splitlines()
                                               if ":" in l and not l.startswith("["))}
    assert "val_bpb" in lines and "val_bpb" in s, (f"train summary: {s}\neval-public stdout:\n{result.stdout}\n"
                                                   f"stderr tail:\n{result.stderr[-3000:]}")
    assert lines["val_bpb"] == s["val_bpb"]  # the isolated official path agrees with the in-process one
    assert lines["official"].startswith("False") and "--seq-len 64 is not the official context 1024" in lines["official"]


@pytest.mark.slow
def test_official_environment_variables_are_honoured_and_named(tmp_path, text_dataset, monkeypatch):
    cache = tmp_path / "official_cache"
    source = tmp_path / "docs"
    source.mkdir()
    (source / "a.txt").write_text("alpha bravo charlie " * 50)
    (source / "b.txt").write_text("delta echo foxtrot " * 50)
    env = {"FRONTIER_CACHE_DIR": "", "NEURON_COMPETITION_R1_CACHE_DIR": str(cache),
           "NEURON_COMPETITION_R1_TOKENIZER_URL": "https://example.invalid/tok.zip"}
    result = run_prepare(["setup", "--source", f"dir:{source}", "--tokenizer", "stdlib"], env)
    assert result.returncode == 0, result.stderr
    assert f"[env] cache_dir = {cache} (from NEURON_COMPETITION_R1_CACHE_DIR)" in result.stdout
    assert "NEURON_COMPETITION_R1_TOKENIZER_URL is set and ignored" in result.stdout
    assert (cache / "active.json").exists()
    both = run_prepare(["setup", "--source", f"dir:{source}"], {**env, "FRONTIER_CACHE_DIR": str(tmp_path / "x")})
    assert both.returncode == 1 and "disagree" in both.stderr

    monkeypatch.setenv("NEURON_COMPETITION_R1_OUT_DIR", "runs/a")
    monkeypatch.setenv("NEURON_COMPETITION_R1_EVAL_PUBLIC", "0")
    monkeypatch.setenv("NEURON_COMPETITION_R1_EVAL_TOKENS", "4096")
    assert config.default_out_dir() == "runs/a" and config.default_train_eval_public() is False
    assert config.default_train_eval_tokens() == 4096
    monkeypatch.setenv("NEURON_COMPETITION_R1_EVAL_TOKENS", "many")
    with pytest.raises(prepare.ConfigError, match="EVAL_TOKENS"):
        config.default_train_eval_tokens()


def test_official_tokenizer_variables(tmp_path, text_dataset, monkeypatch):
    shipped = REPO / "tokenizer" / "stdlib.json"
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    monkeypatch.setenv("NEURON_COMPETITION_R1_TOKENIZER_PATH", str(shipped))
    with pytest.raises(prepare.TokenizerError, match="has no pin"):
        prepare.ensure_tokenizer()
    monkeypatch.setenv("NEURON_COMPETITION_R1_TOKENIZER_SHA256", prepare.sha256_file(shipped))
    assert prepare.ensure_tokenizer().path == shipped
    monkeypatch.setenv("NEURON_COMPETITION_R1_TOKENIZER_SHA256", "00" * 32)
    with pytest.raises(prepare.TokenizerError, match="does not match its pin"):
        prepare.ensure_tokenizer()
    monkeypatch.setenv("NEURON_COMPETITION_R1_TOKENIZER_PATH", str(tmp_path / "tokenizer_8192.pkl"))
    with pytest.raises(prepare.TokenizerError, match="never loads pickles"):
        prepare.ensure_tokenizer()


@pytest.mark.slow
def test_eval_public_finds_the_checkpoint_in_the_official_out_dir(tmp_path, text_dataset):
    import torch
    out = tmp_path / "runs"
    out.mkdir()
    torch.save({"state_dict": {"emb.weight": torch.randn(8192, 16), "head.weight": torch.randn(8192, 16)}},
               out / "final.pt")
    result = prepare_in_process(["eval-public", "--train-py", str(REPO / "tests" / "fixtures" / "bigram_train.py"),
                                 "--max-tokens", "2048"],
                                {"FRONTIER_DATA_DIR": str(text_dataset), "NEURON_COMPETITION_R1_OUT_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert f"[env] out_dir = {out} (from NEURON_COMPETITION_R1_OUT_DIR)" in result.stdout
    assert f"checkpoint_sha256:       {prepare.sha256_file(out / 'final.pt')}" in result.stdout
