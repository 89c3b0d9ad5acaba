"""make_dataloader: BOS-aligned best-fit packing, rank sharding, determinism."""
from __future__ import annotations

import itertools

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import prepare
from harness import loader


@pytest.fixture
def tok(text_dataset, monkeypatch):
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    return prepare.ensure_tokenizer()


def _take(loader, n):
    return [(x.clone(), y.clone(), dict(s)) for x, y, s in itertools.islice(loader, n)]


def test_rows_start_with_bos_and_targets_are_inputs_shifted(tok):
    bos = tok.get_bos_token_id()
    for x, y, state in _take(prepare.make_dataloader(tok, 4, 64, "train", "cpu"), 10):
        assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.long
        assert (x[:, 0] == bos).all()
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert state["epoch"] >= 1


def test_rows_are_whole_or_cropped_documents_without_padding(tok, text_dataset):
    """Every stretch from one BOS to the next is a prefix of a real document's tokens."""
    bos = tok.get_bos_token_id()
    docs = []
    for path in prepare.split_shards("train", text_dataset):
        for rg in range(pq.ParquetFile(path).metadata.num_row_groups):
            docs += prepare._row_group_texts(str(path), rg)
    encoded = {tuple(ids) for ids in tok.encode(docs, prepend=bos)}
    prefixes = {d[:k] for d in encoded for k in range(1, len(d) + 1)}
    full_docs_seen = 0
    for x, y, _ in _take(prepare.make_dataloader(tok, 2, 200, "train", "cpu"), 20):
        rows = torch.cat([x, y[:, -1:]], dim=1).tolist()  # the row of seq_len + 1 tokens
        for row in rows:
            starts = [i for i, t in enumerate(row) if t == bos] + [len(row)]
            assert starts[0] == 0
            for a, b in zip(starts, starts[1:]):
                assert tuple(row[a:b]) in prefixes
                full_docs_seen += tuple(row[a:b]) in encoded
    assert full_docs_seen > 0  # best fit places whole documents, not only crops


def test_two_ranks_get_disjoint_rows(tok):
    rows = []
    for rank in range(2):
        loader = prepare.make_dataloader(tok, 4, 32, "train", "cpu", rank=rank, world_size=2)
        rows.append({tuple(r) for x, _, _ in _take(loader, 15) for r in x.tolist()})
    assert len(rows[0]) > 20 and len(rows[1]) > 20
    assert not rows[0] & rows[1]


def test_same_seed_gives_the_same_batches_across_epochs(tok):
    def batches(seed):
        return _take(prepare.make_dataloader(tok, 8, 128, "train", "cpu", seed=seed), 100)

    a, b, c = batches(0), batches(0), batches(1)
    assert a[-1][2]["epoch"] >= 3  # the comparison spans epoch boundaries
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1, _), (x2, y2, _) in zip(a, b))
    assert [s["epoch"] for *_, s in a] == [s["epoch"] for *_, s in b]
    assert any(not torch.equal(x1, x2) for (x1, _, _), (x2, _, _) in zip(a, c))  # later epochs reshuffle


def test_too_many_ranks_for_the_data_is_a_clear_error(tok):
    n = len(prepare._row_groups_for_split("train", 0, 1))
    with pytest.raises(prepare.DataError, match="too few row groups"):  # when the loader is made
        prepare.make_dataloader(tok, 2, 16, "train", "cpu", rank=n, world_size=n + 1)


def test_row_groups_for_split_shards_by_rank(tok):
    everything = prepare._row_groups_for_split("train", 0, 1)
    parts = [prepare._row_groups_for_split("train", r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == sorted(everything)
    assert prepare._row_groups_for_split("public_val", 0, 1)[0][0].endswith("shard_00001.parquet")


def test_pack_rows_best_fit():
    docs = [np.array([9] + [n] * (n - 1), dtype=np.int32) for n in (5, 3, 2, 7, 4)]
    rows = list(loader.pack_rows(iter([(docs, 1)]), 8, buffer_size=100))
    # first row: longest that fits 8 is 7, then the 1 remaining slot crops the shortest (2)
    assert rows[0][0].tolist() == [9, 7, 7, 7, 7, 7, 7, 9]
    assert rows[1][0].tolist() == [9, 5, 5, 5, 5, 9, 3, 3]  # 5 fits, then 3
    assert len(rows) == 2  # 4 alone cannot fill a row: no padding, so it is dropped
