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
