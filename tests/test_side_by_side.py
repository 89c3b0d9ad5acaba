"""benchmarks/side_by_side.py: its input errors (the runs themselves need a nanochat snapshot: run the script)."""
from __future__ import annotations

import subprocess
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "side_by_side.py"


def side_by_side(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path):
    cases = [(["--text", tmp_path / "missing", "--seconds", "10"], "is not a folder"),
             (["--text", tmp_path, "--seconds", "0"], "must be positive"),
             (["--text", tmp_path, "--seconds", "10", "--multiples", "1,x"], "must be positive")]
    for args, says in cases:
        result = side_by_side("--nanochat", tmp_path / "none.tar.gz", "--work", tmp_path / "work", *args)
        assert result.returncode == 1 and says in result.stderr, result.stderr
        assert result.stderr.startswith("side_by_side: error: ") and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()  # nothing was prepared


def test_an_unknown_nanochat_shape_is_one_line(tmp_path):
    result = side_by_side("--nanochat", tmp_path / "none.tar.gz", "--work", tmp_path / "work", "--text", tmp_path,
                          "--seconds", "10", "--nanochat-shapes", "defaults,huge")
    assert result.returncode == 1 and "--nanochat-shapes: unknown ['huge']" in result.stderr
    assert not (tmp_path / "work").exists()


def test_the_table_says_what_ran_in_which_dtype_and_no_path():
    """What nanochat really ran (from its checkpoint's config and log), tokens and first steps, the target
    seconds and a run that missed them, one scoring dtype, and the text by its folder's name only."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import side_by_side as S
    nanochat = {"training_seconds": 497.0, "steps": 863, "tokens_per_step": 4096, "tokens_per_second": 8180.0,
                "first_step_dt_s": 31.5, "num_params": 11.5e6, "compute_dtype": "torch.bfloat16",
                "sliding_window_warning": "SDPA has no support for sliding window attention",
                "checkpoint": {"model_config": {"n_layer": 4, "n_embd": 256, "n_head": 2, "window_pattern": "SSSL",
                                                "sequence_len": 512}}}
    kit = {"training_seconds": 496.0, "seq_len": 256, "compute_dtype": "bfloat16", "num_steps": 1125,
           "tokens_per_second": 10913.0, "mfu_percent": 8.1, "first_step_seconds": 40.2, "tokens": 1125 * 4096,
           "shape": "depth 3, width 384, rows of 256", "startup_seconds": 151.2}
    rows = [{"multiple": 1.0, "target": 425.0, "seconds": 497.0, "nanochat": {"defaults": nanochat}, "kit": kit,
             "nanochat_bpb": {"defaults": 1.6228}, "kit_bpb": 1.3777, "score_dtype": "bfloat16"}]
    out = S.table(rows, "/home/someone/private/mytext")
    assert "mytext" in out and "/home" not in out and "in bfloat16." in out
    assert "nanochat defaults (d4, w256, 2 heads of 128, SSSL: windows on SDPA's dense mask" in out
    assert "target 425 s, trained 497 s **missed its target by more than 5 %**" in out
    assert "kit `--preset cpu` (depth 3, width 384, rows of 256, bfloat16; start-up 151 s" in out  # its pick there
    assert "| 863 | 3.53 | 8,180 | 31.5 |" in out and "| 1125 | 4.61 | 10,913 | 40.2 | 8.1 % | 1.3777 | -15.1 % |" in out
