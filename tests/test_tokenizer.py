"""The tokenizer: round trips, pinning, deterministic builds."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import prepare
from helpers import REPO, run_prepare, shipped_tokenizer


def test_round_trips_text_including_non_ascii():
    tok = shipped_tokenizer()
    assert tok.get_vocab_size() == prepare.TOKENIZER_VOCAB_SIZE == 8192
    samples = ["hello world", "naïve café, Ωmega ≠ omega", "北京 東京 서울", "emoji 🚀👩‍💻 mixed",
               "tabs\tand\r\nnewlines\n\n", "def f(x):\n    return x ** 2  # é", "<|bos|> is plain text here", ""]
    for text in samples:
        ids = tok.encode(text)
        assert all(0 <= i < 8192 - len(prepare.SPECIAL_TOKENS) for i in ids), text
        assert tok.decode(ids) == text
    batch = tok.encode(samples, prepend="<|bos|>")
    assert all(row[0] == tok.get_bos_token_id() for row in batch)
    assert [tok.decode(row[1:]) for row in batch] == samples


def test_token_bytes_are_utf8_lengths_and_zero_for_specials():
    tok = shipped_tokenizer()
    lengths = prepare.get_token_bytes("cpu", tok)
    assert lengths.shape == (8192,) and lengths.dtype.is_floating_point is False
    for name in prepare.SPECIAL_TOKENS:
        assert lengths[tok.encode_special(name)] == 0
    text = "naïve 北京 🚀 text"
    assert sum(lengths[i].item() for i in tok.encode(text)) == len(text.encode("utf-8"))
    assert (lengths[: 8192 - len(prepare.SPECIAL_TOKENS)] > 0).all()


def _copy_harness(dest):
    dest.mkdir()
    shutil.copy2(REPO / "prepare.py", dest / "prepare.py")
    shutil.copytree(REPO / "harness", dest / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tokenizer", dest / "tokenizer")
    return dest


@pytest.mark.slow
def test_one_byte_change_to_the_shipped_tokenizer_is_refused(tmp_path, stdlib_dataset):
    copy = _copy_harness(tmp_path / "kit")
    artifact = copy / "tokenizer" / "stdlib.json"
    data = bytearray(artifact.read_bytes())
    i = data.index(b'"merges_b64"') + 40
    data[i] = data[i] ^ 0x01
    artifact.write_bytes(bytes(data))
    code = "import prepare; prepare.ensure_tokenizer()"
    result = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True,
                            env={"FRONTIER_DATA_DIR": str(stdlib_dataset), "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    assert str(artifact) in result.stderr and "does not match its pin" in result.stderr
    assert "git checkout -- tokenizer/" in result.stderr


def test_one_byte_change_to_a_built_tokenizer_is_refused(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    artifact = data_dir / "tokenizer.json"
    shutil.copy2(prepare.SHIPPED_TOKENIZER_DIR / "stdlib.json", artifact)
    manifest = {"source": f"dir:{tmp_path}", "shards": {},
                "tokenizer": {"name": "mine", "sha256": prepare.sha256_file(artifact), "file": "tokenizer.json"}}
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
    assert prepare.ensure_tokenizer(dataset_dir=data_dir).get_vocab_size() == 8192
    raw = bytearray(artifact.read_bytes())
    raw[-3] ^= 0x20
    artifact.write_bytes(bytes(raw))
    with pytest.raises(prepare.TokenizerError) as e:
        prepare.ensure_tokenizer(dataset_dir=data_dir)
    assert str(artifact) in str(e.value) and "--build-tokenizer-if-missing" in str(e.value)


def test_missing_tokenizer_says_how_to_build_it(tmp_path, text_dataset):
    data_dir = tmp_path / "d"
    shutil.copytree(text_dataset, data_dir)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    manifest.pop("tokenizer")
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(prepare.TokenizerError, match="--build-tokenizer-if-missing"):
        prepare.ensure_tokenizer(dataset_dir=data_dir)


@pytest.mark.slow
def test_two_builds_from_the_same_shards_are_byte_identical(tmp_path, stdlib_dataset):
    """Builds via the CLI from a dir: source holding the stdlib train shards."""
    source = tmp_path / "shards"
    source.mkdir()
    for p in prepare.split_shards("train", stdlib_dataset):
        shutil.copy2(p, source / p.name)
    artifacts = []
    for k in range(2):
        env = {"FRONTIER_CACHE_DIR": str(tmp_path / f"cache{k}")}
        result = run_prepare(["setup", "--source", f"dir:{source}", "--build-tokenizer-if-missing"], env)
        assert result.returncode == 0, result.stderr
        assert "built here, pinned in manifest.json" in result.stdout
        (artifact,) = (tmp_path / f"cache{k}").glob("dir-*/tokenizer.json")
        artifacts.append(artifact.read_bytes())
    assert artifacts[0] == artifacts[1]
    built = json.loads(artifacts[0])
    assert built["vocab_size"] == 8192 and built["trained_on"]["documents"] > 0
