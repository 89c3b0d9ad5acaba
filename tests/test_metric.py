"""evaluate_bpb and causality_check: exact values, refusals, determinism, timeout."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import prepare
from harness import metric as M
from helpers import (REPO, BatchMixModel, BatchSizeModel, BigramModel, NaNModel, NoisyModel, PeekAfterWarmup,
                     PeekExceptAtFixedCuts, PeekModel, PeekOnRealText, PeekWithHugeSpecialLogit, SubclassModel,
                     UniformModel, WrongShapeModel, documents_with_token_count, random_documents, shipped_tokenizer,
                     write_shard)

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
    (BatchMixModel(V), "rows (must not )?interact"),
    (BatchSizeModel(V), "batch size"),
    (SubclassModel(V), "plain torch.Tensor"),
    (NoisyModel(V), "pure function|rows must not interact|not causal"),
])
def test_broken_models_are_refused_with_a_clear_message(tmp_path, tok, eight_token_docs, model, message):
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    with pytest.raises(prepare.EvalRefused, match=message):
        _evaluate(model, tok, shard, seq_len=8)


@pytest.fixture(scope="module")
def long_shard(tmp_path_factory):
    """Real-looking text: enough rows of 32 tokens for dozens of probes."""
    return write_shard(tmp_path_factory.mktemp("long") / "val.parquet", random_documents(1000, seed=3))


@pytest.mark.parametrize("model", [
    PeekExceptAtFixedCuts(V, seq_len=32),  # peeks everywhere but at the fixed cut points 1, T/2, T-1
    PeekAfterWarmup(V, warmup=3),  # honest in its first forwards, peeks afterwards
    PeekOnRealText(V),  # peeks only on rows that repeat a token (random rows almost never do)
    PeekWithHugeSpecialLogit(V),  # one logit of -1e7 on a special token: it would widen a relative tolerance
], ids=lambda m: type(m).__name__)
def test_models_that_hide_their_peeking_are_refused(tok, long_shard, model):
    with pytest.raises(prepare.EvalRefused, match="not causal"):
        _evaluate(model, tok, long_shard, seq_len=32, batch_size=8, max_tokens=32 * 200)


def test_probes_cut_every_position_and_leave_the_number_alone(tok, long_shard):
    gen = torch.Generator().manual_seed(0)
    model = BigramModel(torch.randn(V, V, generator=gen))
    a = _evaluate(model, tok, long_shard, seq_len=16, batch_size=8, max_tokens=16 * 800)
    b = _evaluate(model, tok, long_shard, seq_len=16, batch_size=8, max_tokens=16 * 800)
    assert a["probes"] >= 50 and a["cut_positions"] == 15  # every position 1..15 was a cut point
    assert a["val_bpb"] == b["val_bpb"]  # the secret probes differ between runs; the number does not
    assert a["causality_max_abs_diff"] == 0.0 and a["batch_size_max_abs_diff"] == 0.0


class PeekAtShare(torch.nn.Module):
    """Reads the next token at a share of the positions only, picked from what it has seen (its
    token, the one before and the position): honest everywhere else."""

    def __init__(self, vocab: int, share: float):
        super().__init__()
        self.vocab, self.share = vocab, share

    def picked(self, idx):
        prev = torch.roll(idx, 1, dims=1)
        prev[:, 0] = 0
        pos = torch.arange(idx.shape[1])
        return (idx * 7919 + prev * 104729 + pos * 15485863) % 10007 < self.share * 10007

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, self.vocab)
        nxt = torch.roll(idx, -1, dims=1)
        return logits.scatter_(2, nxt.unsqueeze(-1), 10.0 * self.picked(idx).unsqueeze(-1).float())


def test_the_stated_coverage_is_what_the_twins_catch():
    """200 rows of 16 positions get 32 twins: reading ahead at >= 13.4 % of the positions is caught
    in 99 % of runs. A model that reads ahead at 20 % of them is caught under each of 20 secrets
    (the bound says it escapes one run in 1,300); one that reads ahead at 1 % escapes most of them
    (72 % of runs by the bound), so the figure is no more than what the twins catch."""
    import contextlib
    rows = np.random.default_rng(7).integers(9, 64, size=(200, 17)).astype(np.int32)
    caught = {}
    for share in (0.2, 0.01):
        model = PeekAtShare(64, share)
        measured = float(model.picked(torch.from_numpy(rows[:, :15].astype(np.int64))).float().mean())
        assert abs(measured - share) < 0.3 * share + 0.005, measured
        caught[share] = 0
        for seed in range(20):
            scorer = M._Scorer(rows, np.ones(64, dtype=np.int64), 8, 55, float("inf"), np.random.default_rng(seed))
            assert sum(p.cut < 16 for p in scorer.probes) == 32
            try:
                scorer.run(lambda k: contextlib.nullcontext((M.LocalForward(model, "cpu", 64), "float32")))
            except prepare.EvalRefused as e:
                assert "not causal" in str(e)
                caught[share] += 1
    assert 0.134 < M.read_ahead_caught(32) < 0.135
    assert caught[0.2] == 20 and caught[0.01] <= 10, caught


def test_a_run_says_what_its_probes_catch():
    """The coverage in words: a run with an official run's twins states it plainly; a smaller one
    also says what an official run would catch."""
    official = M.official_twins()
    assert M.probe_coverage(official) == (f"reading ahead at >= 0.14 % of positions is caught in 99 % of runs "
                                          f"({official} twins)")
    small = M.probe_coverage(26)
    assert small.startswith("reading ahead at >= 16 % of positions is caught in 99 % of runs (26 twins); ")
    assert small.endswith(f"fewer twins than an official run's {official}, which catch >= 0.14 %")


@pytest.fixture
def active_text_dataset(text_dataset, monkeypatch):
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    return text_dataset


def test_causality_check_reports_and_passes_a_valid_model(tok, active_text_dataset):
    torch.manual_seed(0)
    valid = BigramModel(torch.randn(V, V))
    check = prepare.causality_check(valid, tok, 4, 16, "cpu")
    assert check["passed"] and check["max_abs_diff"] == 0.0 and check["probes"] > 0
    peek = prepare.causality_check(PeekModel(V), tok, 4, 16, "cpu")
    assert not peek["passed"] and "not causal" in peek["message"]
    assert peek["causal_max_abs_diff"] > 1.0


def test_valid_causal_attention_model_is_never_refused(tok, active_text_dataset):
    """A real (tiny) causal transformer layer passes, in fp32 and bf16, with and without padded vocab."""
    class TinyAttention(torch.nn.Module):
        def __init__(self, vocab, dtype):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(V, 32)
            self.qkv = torch.nn.Linear(32, 96)
            self.head = torch.nn.Linear(32, vocab)
            self.compute_dtype = dtype

        def forward(self, idx):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.compute_dtype is not None):
                x = self.emb(idx)
                q, k, v = self.qkv(x).split(32, dim=-1)
                y = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)
                return self.head(x + y[:, 0]).float()

    for vocab, dtype, batch in ((V, None, 8), (V + 64, torch.bfloat16, 1), (V, torch.bfloat16, 8)):
        check = prepare.causality_check(TinyAttention(vocab, dtype).eval(), tok, batch, 64, "cpu", max_rows=16)
        assert check["passed"], check["message"]


def two_rank_jobs(folder, request) -> list[dict]:
    """tests/fixtures/dist_eval.py in the suite's one torchrun launch (conftest's two_ranks): a bigram
    scored on 2 ranks, then the same with rank 1's model answering NaN, on long_shard's text."""
    shard = write_shard(folder / "metric_long.parquet", random_documents(1000, seed=3))
    script, env = str(REPO / "tests" / "fixtures" / "dist_eval.py"), {"FRONTIER_DATA_DIR": str(
        request.getfixturevalue("text_dataset"))}
    args = [str(shard), "16", str(16 * 200)]
    return [{"name": "metric_world_2", "script": script, "args": [str(folder / "metric_w2.json"), *args], "env": env},
            {"name": "metric_nan_on_rank_1", "script": script, "args": [str(folder / "metric_nan.json"), *args,
                                                                         "nan-on-rank-1"], "env": env}]


@pytest.mark.slow
def test_distributed_evaluate_bpb_gives_the_same_number_at_any_world_size(tok, two_ranks, active_text_dataset):
    """evaluate_bpb called on every rank shares the rows out and adds the per-row sums in row order:
    tests/fixtures/dist_eval.py under torchrun with 2 ranks gives this process's number exactly (the
    sharing is rank-generic, row k on rank k % world; 2 ranks are the CI's standard)."""
    folder, runs = two_ranks
    assert runs["metric_world_2"].returncode == 0, runs["metric_world_2"].stderr[-3000:]
    two = json.loads((folder / "metric_w2.json").read_text())
    model = BigramModel(torch.randn(8192, 8192, generator=torch.Generator().manual_seed(0)))  # dist_eval.py's
    one = prepare.evaluate_bpb(model, tok, 4, 16, "cpu", max_tokens=16 * 200, shard_path=folder / "metric_long.parquet")
    assert one["world_size"] == 1 and two["world_size"] == 2
    for key in ("val_bpb", "total_nats", "total_bytes", "tokens", "rows"):
        assert two[key] == one[key], key
    assert two["cut_positions"] == 15  # the ranks share one cycle of cut positions


@pytest.mark.slow
def test_a_rank_refused_in_the_first_pass_stops_every_rank_before_the_second(two_ranks):
    """The ranks go from the first pass to the second together (the kernel's caches are dropped in
    between): when one rank's model is refused in its first pass, every rank is refused with its
    message, none runs a second pass, and nothing hangs."""
    folder, runs = two_ranks
    assert runs["metric_nan_on_rank_1"].returncode == 0, runs["metric_nan_on_rank_1"].stderr[-3000:]
    ranks = [json.loads((folder / f"metric_nan.json.rank{r}").read_text()) for r in (0, 1)]
    assert ranks[0]["message"] == ranks[1]["message"] and "NaN" in ranks[0]["message"], ranks
    assert ranks[0]["forwards"] == 200 // 2 // 4 and ranks[1]["forwards"] <= 2, ranks  # rank 0: its first pass only
    assert not (folder / "metric_nan.json").exists()
