"""`prepare.py setup` with the offline sources: fresh clone, no-op rerun, repair, clear errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from helpers import REPO, make_text_source, random_documents, run_prepare, setup_in_process


def _fresh_clone(dest):
    """The files a clone of the repository holds (tracked, plus new files not ignored)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _artefact_lines(stdout: str) -> dict:
    keys = ("train data:", "public_val data:", "tokenizer:", "manifest:", "active dataset:")
    return {k: line[len(k):].strip() for line in stdout.splitlines() for k in keys if line.startswith(k)}


@pytest.mark.slow
def test_stdlib_setup_on_fresh_clone_then_rerun_is_a_noop(tmp_path):
    clone = _fresh_clone(tmp_path / "clone")
    env = {"FRONTIER_CACHE_DIR": str(tmp_path / "cache")}
    first = run_prepare(["setup", "--source", "stdlib"], env, cwd=clone)
    assert first.returncode == 0, first.stderr
    lines = _artefact_lines(first.stdout)
    assert set(lines) == {"train data:", "public_val data:", "tokenizer:", "manifest:", "active dataset:"}
    data_dir = tmp_path / "cache" / "stdlib"
    shards = sorted(data_dir.glob("shard_*.parquet"))
    assert len(shards) >= 2 and lines["public_val data:"] == str(shards[-1])
    assert "shipped and pinned" in lines["tokenizer:"]
    before = {p: p.stat().st_mtime_ns for p in data_dir.iterdir()}

    t0 = time.time()
    second = run_prepare(["setup", "--source", "stdlib"], env, cwd=clone)
    assert second.returncode == 0, second.stderr
    assert "shards up to date" in second.stdout
    assert {p: p.stat().st_mtime_ns for p in data_dir.iterdir()} == before  # nothing rewritten
    assert time.time() - t0 < 30


@pytest.mark.slow
def test_rerun_repairs_a_deleted_shard_and_leftover_temp_files(tmp_path):
    source = make_text_source(tmp_path / "src", random_documents(200, seed=3))
    env = {"FRONTIER_CACHE_DIR": str(tmp_path / "cache")}
    args = ["setup", "--source", f"dir:{source}", "--tokenizer", "stdlib"]
    assert run_prepare(args, env).returncode == 0
    data_dir = json.loads((tmp_path / "cache" / "active.json").read_text())["dataset_dir"]
    shards = sorted((tmp_path / "cache").glob("dir-*/shard_*.parquet"))
    shards[0].unlink()
    (shards[0].parent / "shard_00000.parquet.123.tmp").write_bytes(b"half a file")
    again = run_prepare(args, env)
    assert again.returncode == 0, again.stderr
    assert shards[0].exists() and not list(shards[0].parent.glob("*.tmp"))
    assert str(shards[0].parent) == data_dir


def test_bad_sources_get_one_clear_error(tmp_path):
    env = {"FRONTIER_CACHE_DIR": str(tmp_path / "cache")}
    cases = [
        (["--source", "nope"], "unknown --source 'nope'"),
        (["--source", f"dir:{tmp_path / 'missing'}"], "no such folder"),
        (["--source", "stdlib", "--num-train-shards", "3"], "--num-train-shards applies to --source climbmix only"),
        (["--source", "stdlib", "--tokenizer", "gpt9"], "no such shipped tokenizer"),
    ]
    (tmp_path / "empty").mkdir()
    cases.append((["--source", f"dir:{tmp_path / 'empty'}"], "found 0 usable documents"))
    for args, message in cases:
        result = setup_in_process(args, env)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow
def test_dir_source_reads_parquet_jsonl_and_txt(tmp_path):
    from helpers import write_shard
    src = tmp_path / "src"
    write_shard(src / "a.parquet", ["from parquet one", "from parquet two"])
    make_text_source(src / "j", ["from jsonl"])
    (src / "t.txt").write_text("from txt")
    (src / "skip.bin").write_bytes(b"\x00\x01")
    env = {"FRONTIER_CACHE_DIR": str(tmp_path / "cache")}
    assert run_prepare(["setup", "--source", f"dir:{src}", "--tokenizer", "stdlib"], env).returncode == 0
    import pyarrow.parquet as pq
    texts = sorted(t for p in (tmp_path / "cache").glob("dir-*/shard_*.parquet")
                   for t in pq.read_table(p).column("text").to_pylist())
    assert texts == sorted(["from parquet one", "from parquet two", "from jsonl", "from txt"])


@pytest.mark.slow
def test_malformed_jsonl_names_the_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    result = run_prepare(["setup", "--source", f"dir:{src}", "--tokenizer", "stdlib"],
                         {"FRONTIER_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 1 and "bad.jsonl:2" in result.stderr, result.stderr


def test_split_document_keeps_text_and_limits_size():
    from harness import data
    text = "".join(f"def f{i}():\n    return {i}\n\n" for i in range(400)) + "x" * 9000
    pieces = data.split_document(text, 1000)
    assert "".join(pieces) == text
    assert all(len(p) <= 1000 for p in pieces)
    assert pieces[0].startswith("def f0():") and pieces[0].endswith("\n\n")
