"""evaluate_bpb and causality_check: exact values, refusals, determinism, timeout."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import prepare
from helpers import (BatchMixModel, BatchSizeModel, BigramModel, NaNModel, PeekModel, UniformModel,
                     WrongShapeModel, documents_with_token_count, shipped_tokenizer, write_shard)

V = 8192


@pytest.fixture(scope="module")
def tok():
    return shipped_tokenizer()


@pytest.fixture(scope="module")
def eight_token_docs(tok):
    return documents_with_token_count(tok, 8, 40, seed=5)


def _evaluate(model, tok, shard, seq_len, batch_size=4, **kw):
    return prepare.evaluate_bpb(model, tok, batch_size, seq_len, "cpu", shard_path=shard, **kw)


def test_uniform_logits_give_log2_vocab_per_token(tmp_path, tok, eight_token_docs):
    """Each document is BOS + 8 tokens = one row of seq_len 8: every target is scored."""
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    result = _evaluate(UniformModel(V), tok, shard, seq_len=8)
    tokens = 8 * len(eight_token_docs)
    nbytes = sum(len(d.encode("utf-8")) for d in eight_token_docs)
    assert result["tokens"] == tokens and result["total_bytes"] == nbytes and result["rows"] == 40
    # log2(8192) = 13 bits per token; the metric's cross-entropy is fp32, hence fp32 precision
    assert result["val_bpb"] == pytest.approx(13 * tokens / nbytes, rel=2e-7)
    assert result["eval_over_timeout"] is False and result["causality_passed"] is True


def test_special_tokens_are_excluded_from_tokens_and_bytes(tmp_path, tok):
    """Two BOS+4-token documents per row of seq_len 9: the BOS target in the middle is not scored."""
    docs = documents_with_token_count(tok, 4, 30, seed=2)
    shard = write_shard(tmp_path / "val.parquet", docs)
    result = _evaluate(UniformModel(V), tok, shard, seq_len=9)
    assert result["rows"] == 15
    assert result["tokens"] == 4 * 30  # 8 of the 9 targets of each row
    assert result["total_bytes"] == sum(len(d.encode()) for d in docs)
    assert result["val_bpb"] == pytest.approx(13 * 120 / result["total_bytes"], rel=2e-7)


def test_bigram_model_matches_an_independent_float64_computation(tmp_path, tok, eight_token_docs):
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    bos = tok.get_bos_token_id()
    seqs = [[bos] + tok.encode(d) for d in eight_token_docs]
    counts = np.ones((V, V))
    for s in seqs[:20]:  # fit on half, so the model is imperfect on the rest
        for a, b in zip(s, s[1:]):
            counts[a, b] += 50
    log_probs = torch.from_numpy(np.log(counts / counts.sum(1, keepdims=True))).float()
    result = _evaluate(BigramModel(log_probs), tok, shard, seq_len=8, batch_size=3)

    table = log_probs.double().numpy()
    table = table - np.log(np.exp(table).sum(1, keepdims=True))  # log_softmax, float64
    nats = -sum(table[a, b] for s in seqs for a, b in zip(s, s[1:]))
    nbytes = sum(len(d.encode("utf-8")) for d in eight_token_docs)
    expected = nats / (math.log(2) * nbytes)
    assert abs(result["val_bpb"] - expected) < 1e-6
    assert result["val_bpb"] < 13 * 320 / nbytes  # it learned something


def test_two_calls_agree_exactly_and_batch_size_does_not_matter(tmp_path, tok, eight_token_docs):
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    gen = torch.Generator().manual_seed(0)
    model = BigramModel(torch.randn(V, V, generator=gen))
    a = _evaluate(model, tok, shard, seq_len=8, batch_size=4)
    b = _evaluate(model, tok, shard, seq_len=8, batch_size=4)
    c = _evaluate(model, tok, shard, seq_len=8, batch_size=7)
    assert a["val_bpb"] == b["val_bpb"]
    assert c["val_bpb"] == pytest.approx(a["val_bpb"], rel=1e-12)


def test_max_tokens_fixes_the_number_of_rows(tmp_path, tok, eight_token_docs):
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    result = _evaluate(UniformModel(V), tok, shard, seq_len=8, max_tokens=8 * 10 + 3)
    assert result["rows"] == 10 and result["tokens"] == 80


def test_tiny_timeout_reports_over_timeout_not_a_number(tmp_path, tok, eight_token_docs):
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    result = _evaluate(UniformModel(V), tok, shard, seq_len=8, timeout_seconds=1e-9)
    assert result["eval_over_timeout"] is True
    assert math.isnan(result["val_bpb"])


@pytest.mark.parametrize("model, message", [
    (NaNModel(V), "non-finite logits"),
    (WrongShapeModel(V), r"returned shape \(4, 8192\)"),
    (UniformModel(V - 1), "expected logits"),
    (PeekModel(V), "not causal"),
    (BatchMixModel(V), "other rows of the batch"),
    (BatchSizeModel(V), "batch size"),
])
def test_broken_models_are_refused_with_a_clear_message(tmp_path, tok, eight_token_docs, model, message):
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    with pytest.raises(prepare.EvalRefused, match=message):
        _evaluate(model, tok, shard, seq_len=8)


def test_causality_check_reports_and_passes_a_valid_model(tok):
    torch.manual_seed(0)
    valid = BigramModel(torch.randn(V, V))
    check = prepare.causality_check(valid, tok, 4, 16, "cpu")
    assert check["passed"] and check["max_abs_diff"] == 0.0
    peek = prepare.causality_check(PeekModel(V), tok, 4, 16, "cpu")
    assert not peek["passed"] and peek["causal_max_abs_diff"] == pytest.approx(10.0)


def test_valid_causal_attention_model_is_never_refused(tok):
    """A real (tiny) causal transformer layer passes, with and without padded vocab."""
    class TinyAttention(torch.nn.Module):
        def __init__(self, vocab):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(V, 32)
            self.qkv = torch.nn.Linear(32, 96)
            self.head = torch.nn.Linear(32, vocab)

        def forward(self, idx):
            x = self.emb(idx)
            q, k, v = self.qkv(x).split(32, dim=-1)
            y = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)
            return self.head(x + y[:, 0])

    for vocab in (V, V + 64):
        check = prepare.causality_check(TinyAttention(vocab).eval(), tok, 4, 64, "cpu")
        assert check["passed"], check["message"]
