"""benchmarks/gpu_check.py, rehearsed on the CPU at tiny sizes: every stage runs and its JSON has every field
the GPU run reports, so the script is ready on the day a GPU is lent (the GPU run itself:
docs/presets-and-benchmarks.md, "On a CUDA GPU")."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def gpu_check(*args, timeout=600):
    result = subprocess.run([sys.executable, str(SCRIPT), "run", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def only_result(out):
    (found,) = out.glob("*.json")
    return json.loads(found.read_text()), found


@pytest.mark.slow
def test_the_rehearsal_runs_every_stage_and_reports_every_field(tmp_path, text_dataset):
    out = tmp_path / "out"
    gpu_check("--rehearsal", "--seconds", "9", "--data", str(text_dataset), "--work", str(tmp_path / "work"),
              "--out", str(out), "--skip", "nanochat,nanochat_gpu")
    result, path = only_result(out)
    stages = result["stages"]
    assert {name: e["status"] for name, e in stages.items()} == \
        {name: "ok" for name in ("environment", "peak", "sandbox", "d10", "gpu", "core", "attention", "tolerances")}, \
        stages
    parts = {k: v for k, v in stages["sandbox"].items() if k not in ("status", "wall_seconds", "card")}
    assert set(parts) >= {"none", "landlock", "seccomp", "all", "all-thread-names", "worker"}
    assert set(parts.values()) == {"ok"}, parts  # each part probed; on a CPU every one leaves the device working
    assert {e["card"] for e in stages.values()} == {"CPU (rehearsal)"}  # every figure says which card it came from
    assert stages["environment"]["torch"] and stages["peak"]["tflops"] > 0
    for run in ("d10", "gpu"):
        r = stages[run]
        assert r["command"].startswith("python train.py")
        for key in ("tokens_per_second", "mfu_percent", "peak_memory_mb", "startup_seconds", "first_step_seconds",
                    "num_params_M", "num_steps"):
            assert r[key] > 0, (run, key, r[key])
        # MFU against the measured peak (the summary prints it to 3 decimals)
        assert r["peak_tflops"] == pytest.approx(stages["peak"]["tflops"], abs=5e-4)
        assert len(r["loss_curve"]) >= 3 and r["loss_curve"][-1][2] < r["loss_curve"][0][2]  # it learned
        e = r["eval_public"]
        assert math.isfinite(e["val_bpb"]) and e["causality_passed"] is True and e["official"] is False
        assert "sandboxed_attempt_failed" not in e and "landlock" in " ".join(e["sandbox"])  # scored in the sandbox
        assert any("--max-tokens" in why for why in e["not_official_because"])  # the rehearsal's count, said
    assert stages["gpu"]["num_params_M"] > stages["d10"]["num_params_M"]  # the preset's value embeddings
    core = stages["core"]
    assert 0 < core["examples"] and -1 <= core["core"] <= 1
    assert core["honest_differences"]["max_abs_loss_diff"] < core["tolerances"]["loss"]
    assert stages["attention"]["flex_vs_dense_max_abs_diff"] < 1e-4
    lines = stages["tolerances"]["lines"]
    assert any(line.startswith("CORE, inference.py vs trusted path") for line in lines)
    assert any(line.startswith("val_bpb, in process, 1 secrets (16 probes") and "refused 0" in line for line in lines)
    table = path.with_suffix(".md").read_text()
    assert "| kit d10" in table and "| kit --preset gpu" in table and "CORE-shaped bundle" in table
    assert "| CPU (rehearsal) |" in table and "Sandbox parts on CPU (rehearsal)" in table


@pytest.mark.slow
def test_a_stage_that_no_longer_fits_is_skipped_and_a_rerun_merges(tmp_path, text_dataset):
    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--rehearsal", "--data", str(text_dataset), "--work", str(work), "--out", str(out)]
    gpu_check(*common, "--only", "environment,d10", "--seconds", "600", "--deadline", "60")
    result, path = only_result(out)
    assert result["stages"]["environment"]["status"] == "ok"
    assert result["stages"]["d10"]["status"] == "skipped" and "left of --deadline" in result["stages"]["d10"]["why"]
    gpu_check(*common, "--only", "peak", "--merge", str(path))
    merged, again = only_result(out)
    assert again == path and set(merged["stages"]) == {"environment", "d10", "peak"}
    assert merged["stages"]["peak"]["status"] == "ok"


@pytest.mark.slow
def test_an_unknown_stage_is_one_clear_line(tmp_path, text_dataset):
    result = subprocess.run([sys.executable, str(SCRIPT), "run", "--rehearsal", "--only", "warp", "--data",
                             str(text_dataset), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "unknown stages ['warp']" in result.stderr
    assert not (tmp_path / "o").exists()
