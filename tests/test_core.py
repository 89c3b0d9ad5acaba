"""The CORE harness: exact semantics on a synthetic bundle, the toy scorer, errors, downloads."""
from __future__ import annotations

import contextlib
import http.server
import io
import json
import math
import random
import threading
import zipfile

import numpy as np
import pytest
import torch

import prepare
from harness.checks import checked_log_probs
from harness.common import CoreError
from harness.core import verify
from harness.core.bundle import Task, bundle_from_dir, ensure_bundle, load_examples, load_tasks
from harness.core.prompts import (Request, fewshot_indices, render_language_modeling, render_multiple_choice,
                                  render_schema, scored_regions, shuffled_and_capped, truncate_left)
from harness.core.scoring import (FORGER_GAIN_BOUND, Sample, centered_accuracy, claimed_near_tie,
                                  count_trusted_decisions, evaluate_core, flip_cost, flip_worth, is_correct,
                                  uniform_sample_size)
from harness import download
from core_bundle import expected_core, make_bundle
from helpers import REPO, can_drop_kernel_caches, prepare_in_process

TOY = REPO / "tests" / "fixtures" / "toy_inference.py"


# --- prompts ----------------------------------------------------------------------------------

def test_multiple_choice_prompts_are_rendered_exactly():
    shots = [{"query": "Q1", "choices": ["a", "b"], "gold": 1}, {"query": "Q2", "choices": ["c", "d"], "gold": 0}]
    item = {"query": "Q3", "choices": ["x", "y z"], "gold": 0}
    assert render_multiple_choice(item, " ", shots) == ["Q1 b\n\nQ2 c\n\nQ3 x", "Q1 b\n\nQ2 c\n\nQ3 y z"]
    assert render_multiple_choice(item, "\nAnswer: ", []) == ["Q3\nAnswer: x", "Q3\nAnswer: y z"]


def test_schema_prompts_are_rendered_exactly():
    shots = [{"context_options": ["A1", "A2"], "continuation": "then", "gold": 1}]
    item = {"context_options": ["B1", "B2 "], "continuation": "now.", "gold": 0}
    assert render_schema(item, " ", shots) == ["A2 then\n\nB1 now.", "A2 then\n\nB2  now."]
    assert render_schema(item, "\nAnswer: ", []) == ["B1\nAnswer: now.", "B2 \nAnswer: now."]


def test_language_modelling_prompts_strip_contexts_and_the_prompt_without():
    shots = [{"context": " c1  ", "continuation": "k1"}]
    item = {"context": "\tctx2 \n", "continuation": "ans"}
    assert render_language_modeling(item, " ", shots) == ["c1 k1\n\nctx2", "c1 k1\n\nctx2 ans"]
    assert render_language_modeling(item, "\nAnswer: ", []) == ["ctx2\nAnswer:", "ctx2\nAnswer: ans"]


# --- sampling ---------------------------------------------------------------------------------

def test_shuffle_then_cap():
    data = list(range(50))
    expected = list(range(50))
    random.Random(1337).shuffle(expected)
    assert shuffled_and_capped(data, -1) == expected
    assert shuffled_and_capped(data, 7) == expected[:7]
    assert data == list(range(50))  # the input is untouched


def test_fewshot_indices_reproduce_the_seed_and_exclude_the_example():
    for n, k in ((10, 3), (25, 10), (4, 3)):
        for idx in range(n):
            got = fewshot_indices(idx, n, k)
            assert got == random.Random(1234 + idx).sample([i for i in range(n) if i != idx], k)
            assert idx not in got and len(set(got)) == k
    assert fewshot_indices(3, 10, 0) == []


# --- scored regions ---------------------------------------------------------------------------

def test_scored_regions_on_hand_checked_tokens():
    mc = [[1, 5, 6, 7, 8], [1, 5, 6, 9], [1, 5, 6, 7, 2, 3]]
    assert scored_regions("multiple_choice", mc) == (mc, [3, 3, 3], [5, 4, 6])
    schema = [[1, 4, 4, 8, 9], [1, 5, 8, 9], [1, 6, 6, 6, 8, 9]]
    assert scored_regions("schema", schema) == (schema, [3, 2, 4], [5, 4, 6])
    assert scored_regions("language_modeling", [[1, 2, 3], [1, 2, 3, 4, 5]]) == ([[1, 2, 3, 4, 5]], [3], [5])
    with pytest.raises(CoreError, match="prefix"):
        scored_regions("language_modeling", [[1, 2, 3], [1, 2, 4, 5]])


def test_truncation_keeps_the_last_tokens_and_shifts_the_region():
    assert truncate_left(list(range(10)), 7, 10, 6) == ([4, 5, 6, 7, 8, 9], 3, 6)
    assert truncate_left(list(range(10)), 7, 10, None) == (list(range(10)), 7, 10)
    with pytest.raises(CoreError, match="max_seq_len"):
        truncate_left(list(range(10)), 2, 10, 5)


def test_decisions():
    import torch
    req = Request([[1, 2, 3, 4], [1, 2, 5, 6]], [2, 2], [4, 4], gold=1)
    losses_a, losses_b = torch.tensor([9.0, 1.0, 1.0]), torch.tensor([9.0, 0.5, 1.0])
    g = torch.zeros(3, dtype=torch.long)
    assert is_correct("multiple_choice", req, [(losses_a, g), (losses_b, g)])
    assert not is_correct("multiple_choice", req, [(losses_b, g), (losses_b, g)])  # ties go to the first
    lm = Request([[1, 2, 3, 4]], [2], [4], gold=None)
    assert is_correct("language_modeling", lm, [(losses_a, torch.tensor([0, 3, 4]))])
    assert not is_correct("language_modeling", lm, [(losses_a, torch.tensor([0, 3, 5]))])


def test_centering():
    assert centered_accuracy(0.25, 25.0) == 0.0
    assert centered_accuracy(1.0, 62.0) == pytest.approx(1.0)
    assert centered_accuracy(0.0, 50.0) == pytest.approx(-1.0)
    assert centered_accuracy(0.3, 0.0) == pytest.approx(0.3)


# --- end to end with the toy scorer -------------------------------------------------------------

def _eval_core(args, env):
    return prepare_in_process(["eval-core", *args], env)


def test_toy_scorer_gets_exactly_the_expected_accuracies_and_core(tmp_path, text_dataset):
    bundle = make_bundle(tmp_path)
    ckpt = tmp_path / "final.pt"
    ckpt.write_bytes(b"the toy ignores it")
    result = _eval_core(["--inference-py", str(TOY), "--checkpoint", str(ckpt), "--bundle-dir", str(bundle),
                         "--verify-fraction", "0", "--examples-per-call", "3"], {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "core_report.json").read_text())
    accuracies, core = expected_core()
    assert {k: v["accuracy"] for k, v in report["tasks"].items()} == accuracies
    assert report["core"] == pytest.approx(core, abs=1e-12)
    assert f"core:                {core:.4f}" in result.stdout
    assert report["official"] is False and report["checkpoint_sha256"] == prepare.sha256_file(ckpt)
    assert any("local bundle folder" in r for r in report["not_official_because"])
    assert any("verification is off" in r for r in report["not_official_because"])
    assert len(report["inference_py_sha256"]) == 64
    for label in accuracies:
        assert f"{label:<34} accuracy:" in result.stdout


def two_rank_jobs(folder, request) -> list[dict]:
    """eval-core of the toy scorer in the suite's one torchrun launch (conftest's two_ranks)."""
    (folder / "core").mkdir()
    checkpoint = folder / "core" / "final.pt"  # the report lands beside it
    checkpoint.write_bytes(b"the toy ignores it")
    return [{"name": "eval_core_2_ranks", "prepare": ["eval-core", "--inference-py", str(TOY), "--checkpoint",
                                                      str(checkpoint), "--bundle-dir", str(make_bundle(folder / "core")),
                                                      "--verify-fraction", "0"],
             "env": {"FRONTIER_DATA_DIR": str(request.getfixturevalue("text_dataset"))}}]


@pytest.mark.slow
def test_torchrun_strides_examples_over_ranks(two_ranks):
    folder, runs = two_ranks
    result = runs["eval_core_2_ranks"]
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((folder / "core" / "core_report.json").read_text())
    accuracies, core = expected_core()
    assert report["world_size"] == 2 and report["core"] == pytest.approx(core, abs=1e-12)
    assert {k: v["accuracy"] for k, v in report["tasks"].items()} == accuracies
    assert result.stdout.count("core:") == 1


def test_evaluate_core_in_process_matches_and_batches(tmp_path, text_dataset, monkeypatch):
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    import importlib.util
    spec = importlib.util.spec_from_file_location("toy", TOY)
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    bundle = bundle_from_dir(make_bundle(tmp_path))
    tasks = load_tasks(bundle)
    assert [t.delimiter for t in tasks] == [" ", "\nAnswer: ", " ", " ", "\nAnswer: "]
    examples = {t.label: shuffled_and_capped(load_examples(bundle, t), -1) for t in tasks}
    one, many = toy.load_scorer(None, None), toy.load_scorer(None, None)
    tok = prepare.ensure_tokenizer()
    a, _ = evaluate_core(one.score, tok, tasks, examples, None, examples_per_call=1, log=lambda m: None)
    b, sample = evaluate_core(many.score, tok, tasks, examples, None, examples_per_call=256, log=lambda m: None)
    assert a["core"] == b["core"] == expected_core()[1]
    assert one.calls == sum(t[5] for t in __import__("core_bundle").TASKS) and many.calls == len(tasks)
    assert {s.task.label for s in sample} == {t.label for t in tasks}  # every task is sampled for verification
    capped = {t.label: shuffled_and_capped(load_examples(bundle, t), 4) for t in tasks[:1]}
    report, _ = evaluate_core(many.score, tok, tasks[:1], capped, None, log=lambda m: None)
    assert report["tasks"]["mc_plain"]["examples"] == 4


# --- verification sized to what a forger can gain ------------------------------------------------

def _trusted_lps(logits: torch.Tensor, tokens: list[int], claimed_greedy) -> tuple[torch.Tensor, ...]:
    """What verify.run_rows computes for one row: log-softmax at [target, claimed greedy], the top 2, the argmax."""
    ids = torch.stack([torch.as_tensor(tokens[1:]), torch.as_tensor(claimed_greedy)], dim=1)
    return checked_log_probs(logits, ids, top=2)


def test_every_flip_that_passes_the_checks_is_a_claimed_near_tie():
    """The near-tie set is sound: of 4,000 random examples (choices and exact matches, the model's
    logits drawn so that ties are common) with claims moved towards the gold answer as far as every
    per-example check allows (mean losses by up to the loss tolerance; for an exact match, continuation
    tokens claimed as greedy wherever within the greedy tolerance, their losses lowered by up to the
    token tolerance and the others' raised to keep the mean), each
    decision that differs from the trusted path's and passes trusted_decision_check (bf16's allowance,
    the widest) is one evaluate_core counts as a claimed near-tie; flips happen, and so do examples
    that are not near-ties."""
    rng = torch.Generator().manual_seed(0)
    flips, not_near = [0, 0], 0
    for trial in range(4000):
        lm = trial % 2 == 1
        k, n = (1, 6) if lm else (int(torch.randint(2, 5, (1,), generator=rng)), 8)
        start = n - (3 if lm else 4)
        seqs = [[int(t) for t in torch.randint(0, 16, (n,), generator=rng)] for _ in range(k)]
        logits = [torch.randn(n - 1, 16, generator=rng) * float(torch.rand(1, generator=rng) * 4) for _ in range(k)]
        if lm:  # the continuation and one rival far ahead of the rest: p(continuation) near 1/2
            rows = torch.arange(n - 1)
            logits[0][rows, torch.as_tensor(seqs[0][1:])] += 8
            rival = torch.randint(0, 16, (n - 1,), generator=rng)
            logits[0][rows, rival] += 8 + 0.6 * (torch.rand(n - 1, generator=rng) - 0.5)
        gold = None if lm else int(torch.randint(0, k, (1,), generator=rng))
        request = Request(seqs, [start] * k, [n] * k, gold)
        lps, claimed = [], []
        for j, (seq, x) in enumerate(zip(seqs, logits)):
            lp_all = x.log_softmax(-1)
            target = lp_all.gather(-1, torch.as_tensor(seq[1:])[:, None])[:, 0]
            greedy = lp_all.argmax(-1)
            noise = (torch.rand(n - 1, generator=rng) - 0.5) * 0.14
            noise[start - 1:] -= noise[start - 1:].mean()
            shift = (-0.099 if j == gold else 0.099) * float(torch.rand(1, generator=rng))
            if lm:  # claim the continuation wherever it is within the greedy tolerance of the best, its loss lowered
                moved = (target >= lp_all.max(-1).values - 0.249) & (greedy != torch.as_tensor(seq[1:]))
                greedy = torch.where(moved, torch.as_tensor(seq[1:]), greedy)
                region, m = n - start, int(moved[start - 1:].sum())  # the others raised by 0.2 to keep the mean
                lowered = max(-0.249, (-0.099 * region - (region - m) * 0.2) / max(m, 1))
                noise, shift = torch.where(moved, lowered, 0.2), 0.0
            losses = -target + noise + shift
            claimed.append((losses.double().numpy(), greedy.numpy()))
            lps.append(_trusted_lps(x, seq, greedy))
        sample = Sample(Task("t", "language_modeling" if lm else "multiple_choice", 0, " ", "", 25.0), request,
                        claimed, trial)
        try:
            found = verify.trusted_decision_check(sample, lps)
        except CoreError:
            continue
        near = claimed_near_tie(sample.task.task_type, request, claimed)
        not_near += not near
        if found["flipped"]:
            flips[lm] += 1
            assert near, (trial, found)
    assert min(flips) > 20 and not_near > 200, (flips, not_near)


def test_a_token_off_the_trusted_loss_is_refused_though_its_mean_agrees():
    """A claimed mean loss within the tolerance hides nothing in its tokens: one token 0.3 nats off
    (balanced by the others) is refused, 0.2 is not."""
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
    seq = list(range(8))
    lp = _trusted_lps(x, seq, x.argmax(-1))
    honest = -lp[0][:, 0].double().numpy()
    for off, refused in ((0.2, False), (0.3, True)):
        losses = honest.copy()
        losses[3:] += np.array([off, -off / 3, -off / 3, -off / 3])
        sample = Sample(Task("t", "multiple_choice", 0, " ", "", 25.0), Request([seq, seq], [4, 4], [8, 8], 0),
                        [(losses, x.argmax(-1).numpy())] * 2, 0)
        with pytest.raises(CoreError, match="a token of sequence 0") if refused else contextlib.nullcontext():
            verify.trusted_decision_check(sample, [lp, lp])


def test_every_claimed_near_tie_is_verified_beside_the_uniform_sample(tmp_path, text_dataset, monkeypatch):
    """evaluate_core draws the uniform sample and then every claimed near-tie: a scorer whose answers tie every
    choice has all of each task's examples verified; one whose answers are far from ties, the uniform sample alone,
    and each drawn once."""
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    bundle = bundle_from_dir(make_bundle(tmp_path))
    tasks = [t for t in load_tasks(bundle) if t.task_type != "language_modeling"]
    examples = {t.label: shuffled_and_capped(load_examples(bundle, t), -1) for t in tasks}
    tok = prepare.ensure_tokenizer()

    def scorer(tie: bool):
        def score(seqs):
            return [(np.full(len(s) - 1, 1.0 if tie else 1.0 + 0.5 * k), np.zeros(len(s) - 1, int))
                    for k, s in enumerate(seqs)]
        return score

    for tie in (True, False):
        report, samples = evaluate_core(scorer(tie), tok, tasks, examples, None, log=lambda m: None,
                                        verify_fraction=0.02, rng=random.Random(0))
        for t in tasks:
            v, n = report["tasks"][t.label]["verified"], len(examples[t.label])
            drawn = [s.index for s in samples if s.task.label == t.label]
            uniform = uniform_sample_size(n, flip_worth(n, t.random_baseline, len(tasks)), 0.02)
            assert len(drawn) == len(set(drawn)) == (n if tie else uniform) and v["uniform"] == uniform
            assert sum(s.uniform for s in samples if s.task.label == t.label) == uniform
            assert v["near_ties_claimed"] == (n if tie else 0)


def test_the_uniform_sample_bounds_what_flips_outside_the_near_ties_gain():
    """Each flip outside the claimed near-ties is refused wherever the uniform sample meets it, so at a 50 % chance of
    refusal flips gain at most ln 2 x max(worth / cost): the sample is sized to keep that within FORGER_GAIN_BOUND,
    for a large task and a small one alike, on one rank or several, and coverage() states the bound."""
    for n, baseline in ((10042, 25.0), (273, 50.0), (32, 0.0), (100, 50.0)):
        for ranks in (1, 8):
            mine = -(-n // ranks)
            worth = flip_worth(n, baseline, 22)
            m = uniform_sample_size(mine, worth, 0.02)
            assert math.log(2) * worth / flip_cost(m, mine) <= FORGER_GAIN_BOUND + 1e-12 or m == mine
            assert m == mine or math.log(2) * worth / flip_cost(m - 1, mine) > FORGER_GAIN_BOUND or \
                m - 1 < max(8, math.ceil(0.02 * mine))  # the least that does it, or the floor's
            assert m >= min(mine, 8)
    tasks = {"big": {"examples": 10000, "random_baseline": 25.0}, "small": {"examples": 100, "random_baseline": 50.0}}
    worth = {label: flip_worth(t["examples"], t["random_baseline"], 2) for label, t in tasks.items()}
    one_rank = {"big": {"examples": 10000, "uniform": 200, "near_ties_claimed": 3000, "worth": worth["big"]},
                "small": {"examples": 100, "uniform": 8, "near_ties_claimed": 40, "worth": worth["small"]}}
    found = verify.coverage(tasks, [one_rank])
    assert found["task"] == "small" and found["near_ties_claimed"] == 3040 and found["uniform"] == 208
    assert found["bound"] == pytest.approx(math.log(2) * worth["small"] / -math.log(1 - 8 / 100))
    one_rank["small"]["uniform"] = 100  # all of a task verified: nothing hides there
    assert verify.coverage(tasks, [one_rank])["task"] == "big"
    # two ranks: the one that draws least of its share sets the bound
    split = [{"big": {"examples": 5000, "uniform": 100, "near_ties_claimed": 0, "worth": worth["big"]}},
             {"big": {"examples": 5000, "uniform": 50, "near_ties_claimed": 0, "worth": worth["big"]}}]
    assert verify.coverage({"big": tasks["big"]}, split)["bound"] == pytest.approx(
        math.log(2) * worth["big"] / -math.log(1 - 50 / 5000))


def test_the_trusted_decisions_replace_the_claims_of_the_verified_examples():
    report = {"core": 0.0, "tasks": {
        "a": {"correct": 30, "examples": 100, "random_baseline": 25.0, "accuracy": 0.3, "centered": 0.0},
        "b": {"correct": 50, "examples": 50, "random_baseline": 50.0, "accuracy": 1.0, "centered": 1.0}}}
    count_trusted_decisions(report, {"a": [40, 20, 25], "b": [10, 10, 10]})
    assert report["tasks"]["a"]["correct"] == 25 and report["tasks"]["a"]["accuracy"] == 0.25
    assert report["tasks"]["a"]["trusted_decisions"] == {"verified": 40, "changed_by": -5}
    assert report["core"] == pytest.approx((centered_accuracy(0.25, 25.0) + 1.0) / 2)


def test_a_task_s_flips_are_tested_on_their_own():
    """Flips away from gold in one task do not pay for flips towards it in another: 25 towards in a
    small task beside 25 away in a large one pass the sign test over all tasks and are refused by the
    small task's own; the message names the task."""
    bias = {"answers": [0, 0], "decisions": [25, 25], "decisions_by_task": {"small": [25, 0], "large": [0, 25]}}
    with pytest.raises(CoreError, match="of task 'small'"):
        verify.refuse_bias(bias)
    verify.refuse_bias({**bias, "decisions_by_task": {"small": [13, 12], "large": [12, 13]}})


# --- clear errors -------------------------------------------------------------------------------

@pytest.mark.slow
def test_clear_errors(tmp_path, text_dataset):
    env = {"FRONTIER_DATA_DIR": str(text_dataset)}
    ckpt = tmp_path / "final.pt"
    ckpt.write_bytes(b"x")
    good = make_bundle(tmp_path / "good")
    bad_line = make_bundle(tmp_path / "badline")
    with open(bad_line / "eval_data" / "synthetic" / "lm_plain.jsonl", "a") as f:
        f.write('{"context": "no continuation field"}\n')
    bad_type = make_bundle(tmp_path / "badtype")
    (bad_type / "core.yaml").write_text((bad_type / "core.yaml").read_text().replace("schema\n", "ranking\n", 1))
    no_iface = tmp_path / "no_iface.py"
    no_iface.write_text("def score(x):\n    return x\n")
    slow = tmp_path / "slow.py"
    slow.write_text("import time\n\nclass S:\n    max_seq_len = None\n\n    def score(self, seqs):\n"
                    "        time.sleep(60)\n\ndef load_scorer(path, device):\n    return S()\n")
    base = ["--inference-py", str(TOY), "--checkpoint", str(ckpt), "--verify-fraction", "0"]
    cases = [
        (["--bundle-dir", str(tmp_path / "nothing")] + base, "no CORE bundle at"),
        (["--bundle-dir", str(bad_line)] + base, "lm_plain.jsonl:9: a language_modeling example needs"),
        (["--bundle-dir", str(bad_type)] + base, "icl_task_type 'ranking'"),
        (["--bundle-dir", str(good), "--inference-py", str(no_iface), "--checkpoint", str(ckpt), "--verify-fraction",
          "0"], "defines no load_scorer"),
        (["--bundle-dir", str(good), "--inference-py", str(REPO / "inference.py"), "--checkpoint", str(ckpt),
          "--verify-fraction", "0"], "load_scorer could not load"),
        (["--bundle-dir", str(good), "--inference-py", str(TOY), "--checkpoint", str(ckpt), "--train-py",
          str(tmp_path / "nope.py")], "nope.py: no such file"),
        (["--bundle-dir", str(good), "--tasks", "mc_plain,nope"] + base, "--tasks: unknown ['nope']"),
        (["--bundle-dir", str(good), "--inference-py", str(slow), "--checkpoint", str(ckpt), "--verify-fraction", "0",
          "--timeout", "6"], "CORE did not finish within 6s"),  # the scorer's load: under 2 s alone
    ]
    (tmp_path / "nothing").mkdir()
    for args, message in cases:
        result = prepare_in_process(["eval-core", *args], env)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    broken_json = make_bundle(tmp_path / "badjson")
    with open(broken_json / "eval_data" / "synthetic" / "mc_plain.jsonl", "a") as f:
        f.write("{not json\n")
    result = prepare_in_process(["eval-core", "--bundle-dir", str(broken_json)] + base, env)
    assert result.returncode == 1 and "mc_plain.jsonl:9: not valid JSON" in result.stderr


# --- the bundle download ------------------------------------------------------------------------

def _serve(payload: bytes):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/eval_bundle.zip"


def _zipped_bundle(tmp_path) -> bytes:
    bundle = make_bundle(tmp_path / "src")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for p in sorted(bundle.rglob("*")):
            z.write(p, p.relative_to(bundle.parent))
    return buf.getvalue()


def test_bundle_download_is_recorded_pinned_and_read_from_the_archive(tmp_path, isolated_cache, monkeypatch, capsys):
    import hashlib
    payload = _zipped_bundle(tmp_path)
    digest = hashlib.sha256(payload).hexdigest()
    httpd, url = _serve(payload)
    try:
        with pytest.raises(CoreError, match="pinned bundle is 00"):
            ensure_bundle(url=url, sha256="00" * 32)
        assert f"eval_bundle.zip sha256 {digest}" in capsys.readouterr().out  # recorded and printed
        assert (isolated_cache / "eval_bundle.zip.sha256").read_text().split()[0] == digest
        (isolated_cache / "eval_bundle.zip").unlink()
        bundle = ensure_bundle(url=url, sha256=digest)
    finally:
        httpd.shutdown()
    assert bundle.pinned and bundle.sha256 == digest and bundle.source.endswith("eval_bundle.zip")
    assert [t.label for t in load_tasks(bundle)][0] == "mc_plain"
    assert not list(isolated_cache.glob("*.tmp")) and not (isolated_cache / "eval_bundle").exists()
    unpinned = ensure_bundle()  # cached: no network needed; no pin configured
    assert not unpinned.pinned and unpinned.sha256 == digest
    monkeypatch.setenv("FRONTIER_EVAL_BUNDLE_SHA256", digest)
    assert ensure_bundle().pinned
    archive = isolated_cache / "eval_bundle.zip"  # a bundle changed on disk after its download
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 1
    archive.write_bytes(bytes(data))
    with pytest.raises(CoreError, match="pinned bundle is"):
        ensure_bundle()
    monkeypatch.delenv("FRONTIER_EVAL_BUNDLE_SHA256")
    with pytest.raises(CoreError, match="changed since it was downloaded"):
        ensure_bundle()


def test_a_download_that_is_not_a_zip_fails_clearly(tmp_path, isolated_cache, monkeypatch):
    monkeypatch.setattr(download, "DOWNLOAD_BACKOFF_SECONDS", 0.01)
    httpd, url = _serve(b"<html>not found</html>")
    try:
        with pytest.raises(prepare.DownloadError, match="eval_bundle.zip: download failed"):
            ensure_bundle(url=url)
    finally:
        httpd.shutdown()
    assert not (isolated_cache / "eval_bundle.zip").exists()


# --- the real inference.py ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.xdist_group("kernel-caches")  # its drop would empty the page-cache test's board
def test_real_inference_py_scores_a_trained_checkpoint_and_is_verified(tmp_path, text_dataset, tiny_checkpoint):
    """The official path: the pinned archive (served locally), the kit's inference.py, verification on,
    the kernel's caches dropped before the second verifying worker (where the harness may)."""
    import hashlib
    payload = _zipped_bundle(tmp_path)
    httpd, url = _serve(payload)
    env = {"FRONTIER_DATA_DIR": str(text_dataset), "FRONTIER_EVAL_BUNDLE_SHA256": hashlib.sha256(payload).hexdigest(),
           "FRONTIER_KEEP_KERNEL_CACHES": "0"}
    try:
        result = _eval_core(["--inference-py", str(REPO / "inference.py"), "--checkpoint", str(tiny_checkpoint),
                             "--bundle-url", url, "--verify-fraction", "0.5", "--report", str(tmp_path / "r.json")],
                            env)
    finally:
        httpd.shutdown()
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    if not can_drop_kernel_caches():
        assert report["official"] is False and any("could not be dropped" in r for r in report["not_official_because"])
        pytest.skip("the rest is the official path: this machine cannot drop the kernel's caches (not root)")
    assert report["official"] is True and report["not_official_because"] == [], report["not_official_because"]
    assert "official:            True" in result.stdout
    assert [w["label"] for w in report["workers"]] == ["inference.py", "train.py", "train.py.2"]
    assert [w.get("caches_dropped_seconds") is not None for w in report["workers"]] == [False, False, True]
    assert report["verify"]["examples"] >= 5 * 4 and report["verify"]["twins"] >= 5 * 4
    assert report["verify"]["max_abs_loss_diff"] < 1e-3 and report["verify"]["max_causal_diff"] == 0.0
    assert -1.0 <= report["core"] <= 1.0 and report["train_py_sha256"] == prepare.sha256_file(REPO / "train.py")
    bundle = make_bundle(tmp_path)
    env = {"FRONTIER_DATA_DIR": str(text_dataset)}

    cheat = tmp_path / "cheat_inference.py"  # scores something other than the trained model
    cheat.write_text((REPO / "inference.py").read_text() +
                     "\n\nclass Off(Scorer):\n    def score(self, seqs):\n"
                     "        return [(l * 0.5, g) for l, g in super().score(seqs)]\n\n\n"
                     "_load_scorer = load_scorer\n\n\n"
                     "def load_scorer(path, device):\n    s = _load_scorer(path, device)\n"
                     "    return Off(s.model, s.device)\n")
    result = _eval_core(["--inference-py", str(cheat), "--checkpoint", str(tiny_checkpoint), "--train-py",
                         str(REPO / "train.py"), "--bundle-dir", str(bundle)], env)
    assert result.returncode == 1 and "must score the trained model" in result.stderr


@pytest.mark.parametrize("constant", [1e3, 1e9, 1e30, -3e38])
def test_the_trusted_path_scores_a_constant_row_as_uniform_and_its_ties_as_misses(constant):
    """Constant logits: every log-prob and both of the top two are -ln V exactly, however large the
    constant; the argmax is token 0 (torch's: the lowest id of a tie), so a continuation that ties is
    not an exact match, as nanochat decides (it was one: 'the continuation is at least the best')."""
    x = torch.full((5, 64), constant)
    seq = [3, 7, 9, 11, 13, 17]
    lp, top, argmax = _trusted_lps(x, seq, seq[1:])
    assert (lp == -np.log(64)).all() and (top == -np.log(64)).all() and (argmax == 0).all()
    request = Request([seq], [3], [6], None)
    for claimed, lean in ((list(seq[1:]), 1), ([0] * 5, 0)):
        sample = Sample(Task("t", "language_modeling", 0, " ", "", 0.0), request,
                        [(np.full(5, np.log(64)), np.array(claimed))], 0)
        found = verify.trusted_decision_check(sample, [(lp, top, argmax)])
        assert found["decision_lean"] == lean and found["flipped"] == bool(lean) and found["margin_flipped"] == 0


def test_the_second_pass_shadows_only_the_batches_that_hold_a_uniform_row():
    """Every sequence of every verified example runs in the first pass; the second runs a same-shape shadow of each
    batch that holds a row of the uniform sample, and no other: the twins check causality on a secret sample,
    while the near-ties get their trusted decisions from the first pass alone."""
    vocab, rng = 64, np.random.default_rng(0)

    class Tokenizer:
        def get_vocab_size(self):
            return vocab

        def get_bos_token_id(self):
            return 0

    class Forward:  # uniform logits, every batch recorded
        max_len = 64

        def __init__(self, log):
            self.log, self.pending = log, []

        def submit(self, rows):
            self.log.append(rows.copy())
            self.pending.append(np.zeros((*rows.shape, vocab), dtype=np.float32))

        def result(self):
            return self.pending.pop(0)

    task, samples = Task("t", "multiple_choice", 0, " ", "", 50.0), []
    for k in range(12):  # two choices of 20 + k tokens: a batch of 4 rows holds two examples
        seqs = [[int(t) for t in rng.integers(1, vocab, 20 + k)] for _ in range(2)]
        claimed = [(np.full(len(s) - 1, math.log(vocab)), np.zeros(len(s) - 1, dtype=np.int64)) for s in seqs]
        samples.append(Sample(task, Request(seqs, [12, 12], [len(s) for s in seqs], 0), claimed, k,
                              uniform=k in (3, 8)))
    passes = []

    def open_pass(k):
        passes.append([])
        return contextlib.nullcontext(Forward(passes[-1]))

    found = verify.verify_samples(samples, open_pass, Tokenizer(), random.Random(1))
    first, second = passes
    assert sum(len(b) for b in first) == 24 and len(first) == 6
    assert len(second) == 2 and all(b.shape == first[0].shape for b in second)  # the batches of 2-3 and 8-9
    assert found["shadow_rows"] == 8 and 0 < found["twins"] <= 4
    assert found["decided"] == {"t": [12, 12, 12]}  # a tie goes to the first choice, the gold one, on both paths
