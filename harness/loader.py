"""Documents and the dataloader: row groups of a split, tokenized documents, BOS-aligned best-fit
packing into rows, and make_dataloader (a background thread reads, tokenizes and packs).

_row_groups_for_split, _document_batches and _row_group_texts keep their leading underscore
although prepare.py exports them: the first two are names of the organisers' kit, which train.py
files written for it import; the third is exported beside them."""
from __future__ import annotations

import atexit
import bisect
import itertools
import queue
import random
import threading

import numpy as np
import pyarrow.parquet as pq
import torch

from harness.common import DataError, get_dist_info
from harness.data import SHARD_NAME, open_shard, split_shards
from harness.tokenizer import Tokenizer


def _row_groups_for_split(split: str, start: int, step: int, shard_ids=None) -> list[tuple[str, int]]:
    """The (shard_path, row_group) pairs of a split, every `step`-th from `start` (rank sharding).
    shard_ids restricts to shards with those numbers (as in shard_NNNNN.parquet)."""
    if step < 1 or not 0 <= start < step:
        raise ValueError(f"need 0 <= start < step, got start={start}, step={step}")
    shards = split_shards(split)
    if shard_ids is not None:
        by_id = {int(SHARD_NAME.match(p.name).group(1)): p for p in shards}
        missing = [i for i in shard_ids if i not in by_id]
        if missing:
            raise DataError(f"split {split!r} has no shards {missing} (it has {sorted(by_id)})")
        shards = [by_id[i] for i in shard_ids]
    pairs = [(str(p), rg) for p in shards for rg in range(_row_group_count(p))]
    return pairs[start::step]


def _row_group_count(path) -> int:
    try:
        return pq.ParquetFile(path).metadata.num_row_groups
    except Exception as e:  # a truncated or damaged shard: name it, and the fix
        raise DataError(f"{path} is not a readable parquet shard ({type(e).__name__}: {str(e).splitlines()[0]}). "
                        "Run `python prepare.py setup` with the same source again: it repairs what is broken") from None


def _row_group_texts(path: str, row_group: int) -> list[str]:
    return pq.ParquetFile(path).read_row_group(row_group, columns=["text"]).column("text").to_pylist()


def _document_batches(split: str, start: int, step: int, tokenizer_batch_size: int = 128, shard_ids=None,
                      seed: int = 0):
    """Endless iterator of (list_of_document_texts, epoch) over this rank's row groups. Epoch 1
    reads them in order; later epochs in an order shuffled by (seed, epoch). The shards are opened now:
    a missing or damaged one is an error at the call, not at the first batch."""
    pairs = _row_groups_for_split(split, start, step, shard_ids)
    if not pairs:
        raise DataError(f"split {split!r} has too few row groups for {step} ranks (rank slot {start} got none); "
                        "prepare more data (more shards) or run fewer processes")
    return _documents_of(pairs, tokenizer_batch_size, seed)


def _documents_of(pairs: list, tokenizer_batch_size: int, seed: int):
    epoch = 1
    while True:
        order = list(pairs)
        if epoch > 1:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for path, rg in order:
            texts = _row_group_texts(path, rg)
            for i in range(0, len(texts), tokenizer_batch_size):
                yield texts[i:i + tokenizer_batch_size], epoch
        epoch += 1


def shard_document_batches(shards: list, batch: int = 128):
    """One pass over the documents of the given shards (paths, or their bytes), in order."""
    for source in shards:
        pf = open_shard(source)
        for rg in range(pf.metadata.num_row_groups):
            texts = pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
            for i in range(0, len(texts), batch):
                yield texts[i:i + batch], 1


def tokenized_documents(doc_batches, tokenizer: Tokenizer, num_threads: int):
    """(list of int32 arrays, epoch): each document as BOS + its tokens."""
    bos = tokenizer.get_bos_token_id()
    for texts, epoch in doc_batches:
        rows = tokenizer.encode(texts, prepend=bos, num_threads=num_threads)
        yield [np.asarray(r, dtype=np.int32) for r in rows], epoch


def pack_rows(token_batches, row_capacity: int, buffer_size: int):
    """BOS-aligned best-fit packing. Yields (row, epoch), row an int32 array of row_capacity tokens:
    each row is filled with the longest buffered document that still fits, and when none fits, the
    shortest one is cropped to fill it exactly. No padding; every row starts at a document start.
    The buffer holds documents of one epoch at a time (so a small dataset never has two copies of
    a document in it). On a finite input it stops when the buffer cannot fill another row."""
    lengths: list[int] = []  # sorted; docs[i] has length lengths[i]
    docs: list[np.ndarray] = []
    source = iter(token_batches)
    pending, epoch = None, 1
    while True:
        row = np.empty(row_capacity, dtype=np.int32)
        pos = 0
        while pos < row_capacity:
            while len(docs) < buffer_size:
                if pending is None:
                    pending = next(source, None)
                    if pending is None:
                        break
                if docs and pending[1] != epoch:
                    break  # use up this epoch's documents first
                batch, epoch = pending
                pending = None
                for doc in batch:
                    i = bisect.bisect_right(lengths, len(doc))
                    lengths.insert(i, len(doc))
                    docs.insert(i, doc)
            if not docs:
                return
            remaining = row_capacity - pos
            i = bisect.bisect_right(lengths, remaining) - 1
            if i < 0:
                i = 0  # nothing fits: crop the shortest
            lengths.pop(i)
            doc = docs.pop(i)
            n = min(len(doc), remaining)
            row[pos:pos + n] = doc[:n]
            pos += n
        yield row, epoch


def _batched(rows, batch_size: int, max_rows: int | None = None):
    """Group (row, epoch) into (int64 tensor [batch, capacity], epoch); the last group may be short
    when max_rows is reached or the rows run out."""
    group, taken, epoch = [], 0, 1
    for row, epoch in rows:
        group.append(row)
        taken += 1
        if len(group) == batch_size or taken == max_rows:
            yield torch.from_numpy(np.stack(group)).long(), epoch
            group = []
            if taken == max_rows:
                return
    if group:
        yield torch.from_numpy(np.stack(group)).long(), epoch


def make_dataloader(tokenizer: Tokenizer, batch_size: int, seq_len: int, split: str, device, *, seed: int = 0,
                    buffer_size: int = 1000, prefetch: int = 4, tokenizer_threads: int = 4,
                    tokenizer_batch_size: int = 128, shard_ids=None, rank: int | None = None,
                    world_size: int | None = None, start_batch: int = 0):
    """Endless iterator of (inputs, targets, state) on `device`: int64 [batch_size, seq_len] each,
    targets = inputs shifted by one. Rows are BOS-aligned and best-fit packed with no padding; each
    DDP rank reads a disjoint set of row groups. Deterministic for the same data, seed and world
    size. A background thread reads, tokenizes and packs ahead of the training step. `state` holds
    `epoch` (of the newest documents used) and `batches` (yielded so far, counting skipped ones).
    start_batch=N resumes a run: the first N batches are produced and dropped, so batch N+1 is
    exactly the one an uninterrupted run would see next. The arguments and the shards are checked at the call,
    not at the first batch."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, got {start_batch}")
    if rank is None or world_size is None:
        _, rank, _, world_size = get_dist_info()
    doc_batches = _document_batches(split, rank, world_size, tokenizer_batch_size, shard_ids, seed)
    rows = pack_rows(tokenized_documents(doc_batches, tokenizer, tokenizer_threads), seq_len + 1, buffer_size)
    batches = itertools.islice(_batched(rows, batch_size), start_batch, None)
    return _prefetched_on_device(batches, prefetch, split, device, start_batch)


def _prefetched_on_device(batches, prefetch: int, split: str, device, start_batch: int):
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def produce():
        try:
            for item in batches:
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, which raises it
            ready.put(e)

    def shutdown():  # the worker must not be inside native code when the interpreter exits
        stop.set()
        worker.join(timeout=10)

    worker = threading.Thread(target=produce, name=f"dataloader-{split}", daemon=True)
    worker.start()
    atexit.register(shutdown)
    device = torch.device(device)
    pin = device.type == "cuda"
    count = start_batch
    try:
        while True:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            tokens, epoch = item
            if pin:
                tokens = tokens.pin_memory()
            tokens = tokens.to(device, non_blocking=pin)
            count += 1
            yield tokens[:, :-1], tokens[:, 1:], {"epoch": epoch, "batches": count}
    finally:
        shutdown()
        atexit.unregister(shutdown)

