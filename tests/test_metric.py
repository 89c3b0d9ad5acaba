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


# --- arithmetic no logit can collapse: the class of a constant, an offset per position, one huge logit ---

class OffsetModel(torch.nn.Module):
    """An honest bigram's logits (`table`) plus offsets[t] at every position t (or a constant), returned in
    `dtype`; with `huge_token`, one logit per position (token (7 t) mod V) set to +`huge` on top."""

    def __init__(self, table, offsets, dtype=torch.float32, huge=None):
        super().__init__()
        self.table, self.offsets, self.dtype, self.huge = table, offsets, dtype, huge

    def forward(self, idx):
        T = idx.shape[1]
        x = (self.table[idx].double() + torch.as_tensor(self.offsets, dtype=torch.float64)[:T, None]).to(self.dtype)
        if self.huge is not None:
            at = (7 * torch.arange(T) % V).expand(idx.shape[0], T)[..., None]
            x = x.scatter(2, at, torch.full(at.shape, self.huge, dtype=self.dtype))
        return x


def exact_bpb(model, tok, docs) -> float:
    """val_bpb of one-row-per-document text, from the logits the model returns, by an independent float64
    log-softmax of each whole row."""
    bos, nats = tok.get_bos_token_id(), 0.0
    for d in docs:
        ids = [bos] + tok.encode(d)
        x = model(torch.tensor([ids[:-1]]))[0].double()
        lp = x - x.max(-1, keepdim=True).values
        lp = lp - lp.exp().sum(-1, keepdim=True).log()
        nats -= float(lp.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
    return nats / (math.log(2) * sum(len(d.encode("utf-8")) for d in docs))


def on_grid(tok, docs, step: float, bound: float) -> torch.Tensor:
    """A bigram's log-probs [V, V] fitted on half the documents (better than uniform on all of them),
    clipped to +-bound and rounded to multiples of `step`."""
    bos, counts = tok.get_bos_token_id(), torch.ones(V, V)
    for d in docs[:20]:
        ids = [bos] + tok.encode(d)
        for a, b in zip(ids, ids[1:]):
            counts[a, b] += 50
    log_probs = (counts / counts.sum(1, keepdim=True)).log().clamp(-bound, bound)
    return (log_probs / step).round() * step


@pytest.mark.parametrize("dtype, constant", [(torch.float32, 1e3), (torch.float32, 1e9), (torch.float32, 1e30),
                                             (torch.float32, -1e30), (torch.float32, 3.4e38),
                                             (torch.bfloat16, 1e30), (torch.bfloat16, -3e38),
                                             (torch.float16, 6e4)])
def test_a_constant_logit_scores_the_uniform_value_however_large(tmp_path, tok, eight_token_docs, dtype, constant):
    """A constant row's log-softmax is -ln V: the harness subtracts the row's maximum before adding
    anything, so c + ln V never rounds back to c (it did for c >= 2.7e8: every log-prob 0, val_bpb 0)."""
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    uniform = _evaluate(UniformModel(V), tok, shard, seq_len=8)
    result = _evaluate(OffsetModel(torch.zeros(V, V), [constant] * 8, dtype), tok, shard, seq_len=8)
    assert result["val_bpb"] == uniform["val_bpb"] == pytest.approx(13 * 320 / result["total_bytes"], rel=1e-12)


@pytest.mark.parametrize("dtype, step, bound, offsets", [
    (torch.float32, 2**-8, 16, [64.0 * (t % 16) for t in range(8)]),  # 18 significant bits of the 24
    (torch.float16, 2**-4, 8, [-16.0 * t for t in range(8)]),  # 10 of 11
    (torch.bfloat16, 2**-2, 4, [8.0 * (t % 4) for t in range(8)]),  # 7 of 8
])
def test_an_offset_per_position_changes_nothing_the_logits_still_carry(tmp_path, tok, eight_token_docs, dtype, step,
                                                                       bound, offsets):
    """Honest logits plus c_t at position t, every sum exact in the dtype: the same log-probs, to the bit."""
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    table = on_grid(tok, eight_token_docs, step, bound)
    honest = _evaluate(OffsetModel(table, [0.0] * 8, dtype), tok, shard, seq_len=8)
    shifted = _evaluate(OffsetModel(table, offsets, dtype), tok, shard, seq_len=8)
    assert shifted["val_bpb"] == honest["val_bpb"] < 13 * 320 / honest["total_bytes"]
    assert abs(honest["val_bpb"] - exact_bpb(OffsetModel(table, [0.0] * 8, dtype), tok, eight_token_docs)) < 1e-7


@pytest.mark.parametrize("dtype, offset", [(torch.float32, 1e9), (torch.float32, 1e30), (torch.float32, -2e38),
                                           (torch.bfloat16, 1e4), (torch.bfloat16, 1e30), (torch.float16, 3e4)])
def test_huge_offsets_score_what_the_logits_returned_carry_and_never_less(tmp_path, tok, eight_token_docs, dtype,
                                                                         offset):
    """Offsets so large that the model's own rounding erases its logits: the number is the exact value of
    the logits it returned (here the uniform one), never less than the honest number."""
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    table = on_grid(tok, eight_token_docs, 2**-8, 16)
    offsets = [offset * (1 + 0.25 * (t % 3)) for t in range(8)]
    honest = _evaluate(OffsetModel(table, [0.0] * 8), tok, shard, seq_len=8)
    model = OffsetModel(table, offsets, dtype)
    shifted = _evaluate(model, tok, shard, seq_len=8)
    assert abs(shifted["val_bpb"] - exact_bpb(model, tok, eight_token_docs)) < 1e-7
    assert shifted["val_bpb"] > honest["val_bpb"]


@pytest.mark.parametrize("dtype, huge", [(torch.float32, 3e38), (torch.float32, 1e20), (torch.bfloat16, 3e38)])
def test_one_huge_logit_with_the_rest_finite_is_scored_exactly(tmp_path, tok, eight_token_docs, dtype, huge):
    """One logit per position at +huge: its token is certain (log-prob 0), every other one is ~huge nats
    away; every number stays finite and exact, and the number is huge, not refused and not small."""
    shard = write_shard(tmp_path / "val.parquet", eight_token_docs)
    model = OffsetModel(on_grid(tok, eight_token_docs, 2**-8, 16), [0.0] * 8, dtype, huge=huge)
    result = _evaluate(model, tok, shard, seq_len=8)
    expected = exact_bpb(model, tok, eight_token_docs)
    assert math.isfinite(result["val_bpb"]) and result["val_bpb"] == pytest.approx(expected, rel=1e-12)
    assert result["val_bpb"] > 1e17


@pytest.mark.parametrize("model, message", [
    (NaNModel(V), "non-finite logits"),
    (WrongShapeModel(V), r"returned shape \(4, 8192\)"),
    (UniformModel(V - 1), "expected logits"),
    (PeekModel(V), "not causal"),
    (BatchMixModel(V), "rows (must not )?interact|batch size"),
    (BatchSizeModel(V), "batch size"),
    (SubclassModel(V), "plain torch.Tensor"),
    (NoisyModel(V), "pure function|rows must not interact|not causal|batch size"),
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
                scorer.run(lambda k: contextlib.nullcontext(M.LocalForward(model, "cpu", 64)))
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


class RoundsByBatchIndex(torch.nn.Module):
    """Honest, with kernels whose rounding depends on where a row sits in its batch (as a bf16 GEMM's can
    at a tile's edge): a bigram's logits plus 0.002 nats times the row's batch index."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, idx):
        return self.table[idx] + 0.002 * torch.arange(idx.shape[0], dtype=torch.float32)[:, None, None]


def test_rounding_that_depends_on_the_batch_index_is_never_refused(tok, long_shard):
    """Twins run at their originals' batch index, so such a model's probes compute what its rows did:
    never refused under 8 secrets. The row alone (batch index 0) moves by up to 0.014 nats, within the
    batch-size tolerance."""
    model = RoundsByBatchIndex(torch.randn(V, V, generator=torch.Generator().manual_seed(0)))
    for _ in range(8):
        result = _evaluate(model, tok, long_shard, seq_len=32, batch_size=8, max_tokens=32 * 200)
        assert result["causality_max_abs_diff"] == 0 and result["replay_max_abs_diff"] == 0
        assert result["batch_size_max_abs_diff"] <= 0.0141
