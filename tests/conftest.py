from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import make_text_source, random_documents, run_prepare


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
