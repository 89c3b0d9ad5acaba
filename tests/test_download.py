"""The ClimbMix download path against a local HTTP server that injects faults."""
from __future__ import annotations

import http.server
import io
import threading
from collections import defaultdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepare
from harness import cli, data, download
from helpers import random_documents


def _parquet_bytes(docs) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, row_group_size=16)
    return buf.getvalue()


class FaultyServer:
    """Serves /shard_NNNNN.parquet. faults[name] lists what happens on attempts 1, 2, ...; after the
    list runs out the file is served correctly. Faults: '500', '404', 'cut' (connection closed
    mid-body, Content-Length promised the full size), 'short' (200 with a truncated body and a
    matching Content-Length), 'garbage' (200 with bytes that are not parquet)."""

    def __init__(self, files: dict[str, bytes], faults: dict[str, list[str]]):
        self.files, self.faults, self.attempts = files, faults, defaultdict(int)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                server.attempts[name] += 1
                plan = server.faults.get(name, [])
                fault = plan[server.attempts[name] - 1] if server.attempts[name] <= len(plan) else "ok"
                body = server.files.get(name)
                if body is None or fault == "404":
                    self.send_error(404)
                    return
                if fault == "500":
                    self.send_error(500)
                    return
                if fault == "garbage":
                    body = b"this is not a parquet file" * 100
                if fault == "short":
                    body = body[: len(body) // 2]
                self.send_response(200)
                self.send_header("Content-Length", str(len(server.files[name]) if fault == "cut" else len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if fault == "cut" else body)
                if fault == "cut":
                    self.wfile.flush()
                    self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/datasets/climbmix"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def shard_files():
    ids = [0, 1, 2, prepare.CLIMBMIX_LAST_SHARD]
    return {f"shard_{i:05d}.parquet": _parquet_bytes(random_documents(40, seed=i)) for i in ids}


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(download, "DOWNLOAD_BACKOFF_SECONDS", 0.01)


def _setup(url, capsys, extra=()):
    code = cli.main(["setup", "--source", "climbmix", "--num-train-shards", "3", "--base-url", url,
                         "--tokenizer", "stdlib", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def _final_files(cache):
    return sorted(p.name for p in (cache / "climbmix").iterdir() if p.name != "manifest.json")


def test_transient_faults_are_retried_until_every_shard_is_valid(isolated_cache, shard_files, capsys):
    faults = {"shard_00000.parquet": ["500", "500"], "shard_00001.parquet": ["cut"],
              "shard_00002.parquet": ["short", "garbage"], "shard_06542.parquet": ["500", "cut", "short"]}
    server = FaultyServer(shard_files, faults)
    try:
        code, out, err = _setup(server.url, capsys)
    finally:
        server.close()
    assert code == 0, err
    assert _final_files(isolated_cache) == sorted(shard_files)
    for name, data in shard_files.items():
        assert (isolated_cache / "climbmix" / name).read_bytes() == data
        assert server.attempts[name] == len(faults[name]) + 1
    assert "public_val data: " + str(isolated_cache / "climbmix" / "shard_06542.parquet") in out
    assert "[data] shard_00002.parquet ok" in out


def test_a_shard_that_never_validates_fails_clearly_and_leaves_no_bad_file(isolated_cache, shard_files, capsys):
    server = FaultyServer(shard_files, {"shard_00001.parquet": ["garbage"] * 10})
    try:
        code, out, err = _setup(server.url, capsys)
    finally:
        server.close()
    assert code == 1
    assert "shard_00001.parquet: download failed" in err and "not a readable parquet file" in err
    assert "--source stdlib" in err  # says how to work offline
    assert _final_files(isolated_cache) == ["shard_00000.parquet", "shard_00002.parquet", "shard_06542.parquet"]
    assert server.attempts["shard_00001.parquet"] == download.DOWNLOAD_ATTEMPTS


def test_missing_file_is_not_retried(isolated_cache, shard_files, capsys):
    del shard_files["shard_00002.parquet"]
    server = FaultyServer(shard_files, {})
    try:
        code, out, err = _setup(server.url, capsys)
    finally:
        server.close()
    assert code == 1 and "shard_00002.parquet" in err and "HTTP 404" in err
    assert server.attempts["shard_00002.parquet"] == 1


def test_rerun_keeps_good_shards_and_replaces_bad_ones(isolated_cache, shard_files, capsys):
    server = FaultyServer(shard_files, {})
    try:
        assert _setup(server.url, capsys)[0] == 0
        good = isolated_cache / "climbmix" / "shard_00000.parquet"
        bad = isolated_cache / "climbmix" / "shard_00001.parquet"
        bad.write_bytes(bad.read_bytes()[:100])  # a crash mid-write under the final name
        mtime = good.stat().st_mtime_ns
        code, out, err = _setup(server.url, capsys)
    finally:
        server.close()
    assert code == 0, err
    assert "bad file, downloading a replacement: shard_00001.parquet" in out
    assert bad.read_bytes() == shard_files["shard_00001.parquet"]
    assert good.stat().st_mtime_ns == mtime
    assert server.attempts["shard_00000.parquet"] == 1 and server.attempts["shard_00001.parquet"] == 2


def test_shard_without_text_column_is_rejected(tmp_path):
    path = tmp_path / "shard_00000.parquet"
    pq.write_table(pa.table({"content": ["a", "b"]}), path)
    with pytest.raises(prepare.BadShardError, match="no 'text' column"):
        prepare.check_shard(path)


def test_climbmix_tokenizer_build_needs_the_pinned_shards(isolated_cache, shard_files, capsys):
    server = FaultyServer(shard_files, {})
    try:
        base = ["setup", "--source", "climbmix", "--num-train-shards", "3", "--base-url", server.url]
        assert cli.main(base) == 1
        assert "none is shipped for 'climbmix'" in capsys.readouterr().err
        assert cli.main(base + ["--build-tokenizer-if-missing"]) == 1
        err = capsys.readouterr().err
    finally:
        server.close()
    assert "needs train shards 0..7; missing [3, 4, 5, 6, 7]" in err and "--num-train-shards 8" in err


def test_a_bad_file_stays_until_its_good_copy_has_arrived(isolated_cache, shard_files, capsys):
    """A failed repair of the validation shard leaves the bad file (which every reader refuses); it
    never disappears, so no training shard is ever taken for public_val."""
    server = FaultyServer(shard_files, {})
    try:
        assert _setup(server.url, capsys)[0] == 0
        folder = isolated_cache / "climbmix"
        val = folder / "shard_06542.parquet"
        val.write_bytes(val.read_bytes()[:100])
        damaged = val.read_bytes()
        server.faults["shard_06542.parquet"] = ["garbage"] * 10
        code, out, err = _setup(server.url, capsys)
    finally:
        server.close()
    assert code == 1 and "shard_06542.parquet: download failed" in err
    assert val.read_bytes() == damaged  # not deleted before a good copy arrived
    assert data.split_shards("public_val", folder) == [val]
    with pytest.raises(prepare.BadShardError):
        prepare.check_shard(val)


def test_splits_come_from_the_manifest(isolated_cache, shard_files, capsys):
    import json
    server = FaultyServer(shard_files, {})
    try:
        assert _setup(server.url, capsys)[0] == 0
    finally:
        server.close()
    folder = isolated_cache / "climbmix"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["splits"] == {"train": ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"],
                                  "public_val": ["shard_06542.parquet"]}
    (folder / "shard_06542.parquet").unlink()  # the validation shard is gone: an error, not a relabelling
    with pytest.raises(prepare.DataError, match=r"public_val split .* is missing \['shard_06542.parquet'\]"):
        data.split_shards("public_val", folder)
    del manifest["splits"]  # a manifest that does not list its splits (an older kit's)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(prepare.DataError, match="does not list its splits"):
        data.split_shards("train", folder)
