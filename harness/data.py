"""Where the data lives and how it gets there: the dataset folder, its manifest (which records the
split of every shard), shard checks, ClimbMix downloads and the offline sources.

A dataset is one folder of shards shard_NNNNN.parquet (each with a `text` column, documents in row
groups) plus manifest.json, whose "splits" name the shards of "train" and of "public_val" (for
ClimbMix, public_val is exactly shard_06542.parquet). `setup` records the dataset it prepared in
<cache>/active.json, and everything else reads that (or $FRONTIER_DATA_DIR)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness.common import BadShardError, DataError, DownloadError, HarnessError, log, sha256_file, tmp_name
from harness.config import CLIMBMIX_LAST_SHARD, cache_root
from harness.download import DOWNLOAD_WORKERS, download_file

SPLITS = ("train", "public_val")
DEFAULT_NUM_TRAIN_SHARDS = 24  # ~30 min of a Phase 1 chip at the top of the leaderboard, one epoch
OFFLINE_SHARD_CHARS = 4_000_000  # offline sources: characters per shard
OFFLINE_ROW_GROUP_DOCS = 64  # offline sources: documents per row group (the unit of rank sharding)
OFFLINE_MAX_DOC_CHARS = 4000  # offline sources: longer files become several documents, so that
                              # packing (which crops what does not fit a row) wastes little
OFFLINE_SHUFFLE_SEED = 1234  # offline sources: fixed document order before sharding
SHARD_NAME = re.compile(r"^shard_(\d{5})\.parquet$")


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.parquet"


def active_dataset_dir() -> Path:
    env = os.environ.get("FRONTIER_DATA_DIR")
    if env:
        path = Path(env).expanduser()
        if not (path / "manifest.json").exists():
            raise DataError(f"FRONTIER_DATA_DIR={env} holds no prepared dataset (no manifest.json). "
                            f"Run `python prepare.py setup --data-dir {env}` first, or unset it.")
        return path
    marker = cache_root() / "active.json"
    if not marker.exists():
        raise DataError(f"No dataset is set up ({marker} does not exist). Run `python prepare.py setup` "
                        "(ClimbMix, needs the network) or `python prepare.py setup --source stdlib` (offline).")
    try:
        path = Path(json.loads(marker.read_text())["dataset_dir"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{marker} is corrupt ({e}). Run `python prepare.py setup` again.")
    if not (path / "manifest.json").exists():
        raise DataError(f"The active dataset {path} (from {marker}) is missing or incomplete. "
                        "Run `python prepare.py setup` again.")
    return path


def load_manifest(dataset_dir: Path) -> dict:
    path = dataset_dir / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{dataset_dir} is not a prepared dataset (no manifest.json). Run `python prepare.py setup`.")
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is corrupt ({e}). Run `python prepare.py setup` again to repair it.")


def list_shards(dataset_dir: Path) -> list[tuple[int, Path]]:
    """(shard number, path) of every final-named shard in the folder, in order."""
    if not dataset_dir.is_dir():
        return []
    found = []
    for p in dataset_dir.iterdir():
        m = SHARD_NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def split_shards(split: str, dataset_dir: Path | None = None) -> list[Path]:
    """The shard files of a split, as the manifest lists them. A split the manifest does not list,
    or a listed shard that is missing, is a DataError: nothing is ever relabelled."""
    if split == "val":
        split = "public_val"
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use 'train' or 'public_val'")
    dataset_dir = dataset_dir or active_dataset_dir()
    manifest = load_manifest(dataset_dir)
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not all(isinstance(splits.get(s), list) for s in SPLITS):
        raise DataError(f"{dataset_dir / 'manifest.json'} does not list its splits (it was written by an older "
                        "version of the kit). Run `python prepare.py setup` with the same source again.")
    names = splits[split]
    if not names:
        raise DataError(f"{dataset_dir / 'manifest.json'} lists no {split} shard. Run `python prepare.py setup` again.")
    missing = [n for n in names if not (dataset_dir / n).is_file()]
    if missing:
        raise DataError(f"the {split} split of {dataset_dir} is missing {missing[:5]}"
                        f"{' ...' if len(missing) > 5 else ''}. Run `python prepare.py setup` again to repair it.")
    return [dataset_dir / n for n in names]


def open_shard(source) -> pq.ParquetFile:
    """A shard from its path or from its bytes (read_pinned_shard)."""
    return pq.ParquetFile(pa.BufferReader(source) if isinstance(source, (bytes, bytearray)) else source)


def check_shard(path: Path, read_data: bool = False, data: bytes | None = None) -> int:
    """Number of documents in a shard; BadShardError unless it is a parquet file with a string
    `text` column. read_data=True also decodes every row group (used right after a download).
    data: the shard's bytes, already read (path then only names it)."""
    try:
        pf = open_shard(path if data is None else data)
    except Exception as e:
        raise BadShardError(f"{path.name} is not a readable parquet file ({type(e).__name__}: {e})")
    names = pf.schema_arrow.names
    if "text" not in names:
        raise BadShardError(f"{path.name} has no 'text' column (columns: {names})")
    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise BadShardError(f"{path.name}: column 'text' has type {kind}, expected string")
    if pf.metadata.num_rows == 0 or pf.metadata.num_row_groups == 0:
        raise BadShardError(f"{path.name} holds no documents")
    if read_data:
        try:
            for rg in range(pf.metadata.num_row_groups):
                pf.read_row_group(rg, columns=["text"])
        except Exception as e:
            raise BadShardError(f"{path.name} is damaged: row group {rg} does not decode ({e})")
    return pf.metadata.num_rows


def shard_hashes(dataset_dir: Path) -> dict[str, str]:
    """SHA-256 of every final-named shard in the folder (the pins a manifest records)."""
    return {p.name: sha256_file(p) for _, p in list_shards(dataset_dir)}


def shard_pin(path: Path) -> str:
    """The SHA-256 the dataset's manifest pins for this shard, or DataError."""
    manifest = load_manifest(path.parent)
    pin = manifest.get("sha256", {}).get(path.name) if isinstance(manifest.get("sha256"), dict) else None
    if not pin:
        raise DataError(f"{path.parent / 'manifest.json'} pins no SHA-256 for {path.name} (it was written by an older "
                        f"version of the kit). Run `python prepare.py setup --source {manifest.get('source', '...')}` "
                        "again: it records the pins.")
    return pin


def source_folder(dataset_dir: Path) -> Path | None:
    """The folder an offline data set was built from (its documents are readable there), or None
    for a downloaded one."""
    source = load_manifest(dataset_dir).get("source", "")
    if source == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    if source.startswith("dir:"):
        return Path(source[4:]).expanduser()
    return None


def read_pinned_shard(path: Path, pin: str | None) -> tuple[bytes, str]:
    """(the shard's bytes, their SHA-256), read once; DataError if a pin is given and differs. The
    evaluation parses exactly these bytes, so the hash it reports is of what it scored."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the shard ({e.strerror})") from None
    digest = hashlib.sha256(data).hexdigest()
    if pin is not None and digest != pin.lower():
        raise DataError(f"{path} has sha256 {digest}, but it is pinned as {pin.lower()}: the shard was changed or "
                        "damaged. Run `python prepare.py setup` with the same source again to repair it (or pass the "
                        "shard that matches the pin).")
    return data, digest


# ---------------------------------------------------------------------------------------------
# ClimbMix downloads
# ---------------------------------------------------------------------------------------------

def _check_pinned(path: Path, pin: str | None, read_data: bool = False) -> None:
    """BadShardError unless the shard is valid and, when pinned, has the pinned SHA-256."""
    check_shard(path, read_data=read_data)
    if pin is not None:
        actual = sha256_file(path)
        if actual != pin:
            raise BadShardError(f"{path.name} has sha256 {actual}, but the manifest pins {pin} (recorded when it was "
                                "first downloaded)")


def download_shards(base_url: str, shard_ids: list[int], dataset_dir: Path, workers: int = DOWNLOAD_WORKERS,
                    attempts: int | None = None, backoff: float | None = None, timeout: float | None = None,
                    pins: dict | None = None) -> None:
    """Make every listed shard present and valid under its final name, and equal to its pin where
    `pins` (name -> SHA-256, from the manifest) has one. Good files are kept; a bad one stays
    where it is until its good copy has downloaded and replaces it (a failed repair leaves the
    bad file, which every reader refuses, never a gap that shifts the splits)."""
    pins = pins or {}
    todo = []
    for i in shard_ids:
        path = dataset_dir / shard_name(i)
        if path.exists():
            try:
                _check_pinned(path, pins.get(path.name))
                continue
            except BadShardError as e:
                log(f"[data] bad file, downloading a replacement: {e}")
        todo.append(i)
    log(f"[data] {len(shard_ids) - len(todo)}/{len(shard_ids)} shards already present in {dataset_dir}")
    if not todo:
        return
    log(f"[data] downloading {len(todo)} shards from {base_url} with {min(workers, len(todo))} workers")
    t0, done, total_bytes, failed = time.time(), 0, 0, []
    lock = threading.Lock()

    def fetch(i: int) -> int:
        name = shard_name(i)
        return download_file(f"{base_url.rstrip('/')}/{name}", dataset_dir / name,
                             validate=lambda p: _check_pinned(p, pins.get(name), read_data=True),
                             attempts=attempts, backoff=backoff, timeout=timeout)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
        futures = {pool.submit(fetch, i): i for i in todo}
        for fut in as_completed(futures):
            with lock:
                try:
                    total_bytes += fut.result()
                    done += 1
                    rate = total_bytes / max(time.time() - t0, 1e-9) / 1e6
                    log(f"[data] {shard_name(futures[fut])} ok ({done}/{len(todo)}, "
                        f"{total_bytes / 1e6:.1f} MB, {rate:.1f} MB/s)")
                except DownloadError as e:
                    failed.append(str(e))
                    log(f"[data] FAILED {e}")
    if failed:
        raise DownloadError(f"{len(failed)} of {len(todo)} shards could not be downloaded:\n  " + "\n  ".join(failed)
                            + "\nRerun the same command to retry (good shards are kept). To work offline instead: "
                              "`python prepare.py setup --source stdlib`.")


# ---------------------------------------------------------------------------------------------
# Data sources
# ---------------------------------------------------------------------------------------------
# climbmix: the public shards at their real address. stdlib / dir:PATH: documents collected
# locally, shuffled with a fixed seed, written as shards in the same layout with the same split rule.

def dataset_name(source: str) -> str:
    if source in ("climbmix", "stdlib"):
        return source
    if source.startswith("dir:"):
        path = Path(source[4:]).expanduser().resolve()
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
        return f"dir-{re.sub(r'[^A-Za-z0-9_.-]', '_', path.name)}-{digest}"
    raise HarnessError(f"unknown --source {source!r}: use climbmix, stdlib or dir:PATH")


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return root, files


def _dir_files(root: Path) -> list[Path]:
    if not root.is_dir():
        raise DataError(f"--source dir:{root}: no such folder")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames)
                     if f.endswith((".parquet", ".jsonl", ".txt")) and not f.startswith("."))
    return files


def _fingerprint(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256(f"{sys.version_info[:3]}|{root}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _read_documents(files: list[Path]) -> list[str]:
    """Documents of .py/.txt files (one per file), .jsonl (field 'text' per line), .parquet
    (column 'text'). Files that are not UTF-8 are skipped; empty documents are dropped."""
    docs = []
    for f in files:
        if f.suffix == ".parquet":
            try:
                check_shard(f)
            except BadShardError as e:
                raise DataError(f"{f}: {e}")
            docs.extend(t for t in pq.read_table(f, columns=["text"]).column("text").to_pylist() if t)
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if f.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    doc = obj["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(f"{f}:{n}: expected a JSON object with a 'text' field ({e})")
                if not isinstance(doc, str):
                    raise DataError(f"{f}:{n}: 'text' must be a string")
                if doc:
                    docs.append(doc)
        elif text:
            docs.append(text)
    return docs


def split_document(text: str, max_chars: int, separators: tuple = ("\n\n", "\n")) -> list[str]:
    """Pieces of at most max_chars whose concatenation is the text, cut at blank lines where
    possible, else at line ends, else anywhere. Whitespace-only pieces are dropped."""
    if len(text) <= max_chars:
        return [text]
    if not separators:
        return [text[i:i + max_chars] for i in range(0, len(text), max_chars)]
    sep, finer = separators[0], separators[1:]
    parts = text.split(sep)
    units = [p + sep for p in parts[:-1]] + [parts[-1]]
    pieces, current = [], ""
    for unit in units:
        for piece in split_document(unit, max_chars, finer):
            if current and len(current) + len(piece) > max_chars:
                pieces.append(current)
                current = ""
            current += piece
    pieces.append(current)
    return [p for p in pieces if p.strip()]


def write_offline_shards(dataset_dir: Path, docs: list[str]) -> dict[str, int]:
    """Split long documents, shuffle with a fixed seed, write shards (the last one becomes public_val,
    see offline_splits)."""
    docs = [piece for doc in docs for piece in split_document(doc, OFFLINE_MAX_DOC_CHARS)]
    random.Random(OFFLINE_SHUFFLE_SEED).shuffle(docs)
    total_chars = sum(len(d) for d in docs)
    num_shards = min(len(docs), max(2, math.ceil(total_chars / OFFLINE_SHARD_CHARS)))
    if num_shards < 2:
        raise DataError(f"need at least 2 documents to make a train and a validation split, found {len(docs)}")
    for _, old in list_shards(dataset_dir):
        old.unlink()
    written = {}
    for k in range(num_shards):
        part = docs[k * len(docs) // num_shards:(k + 1) * len(docs) // num_shards]
        path = dataset_dir / shard_name(k)
        tmp = tmp_name(path)
        try:
            pq.write_table(pa.table({"text": pa.array(part, type=pa.string())}), tmp,
                           row_group_size=OFFLINE_ROW_GROUP_DOCS, compression="zstd")
            check_shard(tmp, read_data=True)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        written[path.name] = len(part)
    return written


def offline_splits(shards: dict[str, int]) -> dict[str, list[str]]:
    """An offline source's splits: its last shard is public_val, the others train."""
    names = sorted(shards)
    return {"train": names[:-1], "public_val": names[-1:]}


def climbmix_splits(dataset_dir: Path) -> dict[str, list[str]]:
    """ClimbMix's splits: public_val is exactly shard_06542; train is every other shard present."""
    val = shard_name(CLIMBMIX_LAST_SHARD)
    return {"train": [p.name for _, p in list_shards(dataset_dir) if p.name != val], "public_val": [val]}


def _shards_intact(dataset_dir: Path, manifest: dict) -> bool:
    """Every shard the manifest lists is there, readable and equal to its pin."""
    names = {p.name for _, p in list_shards(dataset_dir)}
    pins = manifest.get("sha256")
    if set(manifest.get("shards", {})) != names or "splits" not in manifest or not isinstance(pins, dict):
        return False
    try:
        for name in names:
            _check_pinned(dataset_dir / name, pins.get(name) or "missing")
    except BadShardError as e:
        log(f"[data] rebuilding: {e}")
        return False
    return True


def prepare_offline_source(source: str, dataset_dir: Path) -> dict:
    """Build (or verify, if the source is unchanged) the shards of stdlib or dir:PATH."""
    if source == "stdlib":
        root, files = _stdlib_files()
    else:
        root = Path(source[4:]).expanduser().resolve()
        files = _dir_files(root)
    fingerprint = _fingerprint(root, files)
    old = load_manifest(dataset_dir) if (dataset_dir / "manifest.json").exists() else {}
    if old.get("fingerprint") == fingerprint and _shards_intact(dataset_dir, old):
        log(f"[data] {source}: shards up to date in {dataset_dir}")
        return old
    log(f"[data] {source}: reading {len(files)} files under {root}")
    docs = _read_documents(files)
    if len(docs) < 2:
        raise DataError(f"--source {source}: found {len(docs)} usable documents under {root}; need at least 2 "
                        "(.parquet with a 'text' column, .jsonl with a 'text' field, or UTF-8 .txt files)")
    shards = write_offline_shards(dataset_dir, docs)
    log(f"[data] {source}: wrote {len(shards)} shards, {sum(shards.values())} documents, "
         f"{sum(len(d) for d in docs) / 1e6:.1f}M characters")
    manifest = {"source": source, "fingerprint": fingerprint, "shards": shards, "splits": offline_splits(shards),
                "sha256": shard_hashes(dataset_dir), "python": ".".join(map(str, sys.version_info[:3]))}
    if old.get("tokenizer") and old.get("fingerprint") == fingerprint:
        manifest["tokenizer"] = old["tokenizer"]
    return manifest


def prepare_climbmix(dataset_dir: Path, num_train_shards: int, base_url: str, workers: int) -> dict:
    if not 1 <= num_train_shards <= CLIMBMIX_LAST_SHARD:
        raise HarnessError(f"--num-train-shards must be between 1 and {CLIMBMIX_LAST_SHARD}, got {num_train_shards}")
    ids = list(range(num_train_shards)) + [CLIMBMIX_LAST_SHARD]
    old = load_manifest(dataset_dir) if (dataset_dir / "manifest.json").exists() else {}
    pins = old.get("sha256") if isinstance(old.get("sha256"), dict) else {}
    download_shards(base_url, ids, dataset_dir, workers=workers, pins=pins)
    shards = {p.name: check_shard(p) for _, p in list_shards(dataset_dir)}
    hashes = {name: pins.get(name) or sha256_file(dataset_dir / name) for name in shards}  # pinned ones were checked
    manifest = {"source": "climbmix", "base_url": base_url, "shards": shards, "splits": climbmix_splits(dataset_dir),
                "sha256": hashes}
    if old.get("tokenizer"):
        manifest["tokenizer"] = old["tokenizer"]
    return manifest

