"""Checks no model can dodge, and that every honest model passes: each attack is a hostile train.py
or inference.py driven through the command line (the harness in this process: what is attacked is the
checks, through the sandboxed workers; with a control that shows it works where the check does not
reach), and the kit's own checkpoint, in fp32 and bf16, passes every check under many secrets."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare
from core_bundle import NEAR_TIE_TASKS, make_bundle, make_near_tie_examples
from harness.common import CoreError
from harness.core.bundle import bundle_from_dir, load_examples, load_tasks
from harness.core.prompts import build_request, shuffled_and_capped
from harness.core.scoring import count_trusted_decisions, evaluate_core
from harness.core.verify import VERIFY_BATCH_ROWS, VERIFY_LENGTH_BUCKET, refuse_bias, sign_test_p, verify_samples
from harness import metric as M
from helpers import REPO, bf16_linears_on_the_fp32_gemm, bf16_matmuls_are_slow, prepare_in_process
from hostile import SEQ, TOKENS, evaluate, participant

HUGE = '''
class Cheat(Model):
    """Reads the next token and puts +-{size} on it: finite logits whose log-softmax is -inf elsewhere."""

    def forward(self, idx):
        nxt = torch.roll(idx, -1, dims=1)
        logits = torch.full((*idx.shape, V), -{size}).scatter(2, nxt.unsqueeze(-1), {size})
        return logits
'''

REMEMBERS = '''
class Cheat(Model):
    """Reads the next token everywhere, except that a row sharing a prefix with a row it answered
    before gets its earlier answers up to where the two diverge: every twin, repeat and lone row is
    answered as its original was."""
    seen = []

    def forward(self, idx):
        out = peek(idx, self.honest(idx))
        for b in range(idx.shape[0]):
            row, best, longest = idx[b], None, 0
            for tokens, logits in Cheat.seen:
                differ = (tokens != row).nonzero()
                common = int(differ[0]) if len(differ) else len(row)
                if common > longest:
                    best, longest = logits, common
            if longest >= 1:
                out[b, :longest] = best[:longest]
            Cheat.seen.append((row.clone(), out[b].clone()))
        return out
'''


def load_participant_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- poisoned arithmetic -------------------------------------------------------------------------

def test_huge_logits_that_read_ahead_are_caught_on_every_path(tmp_path, checkpoint, text_dataset, monkeypatch):
    """+-3e38 on the next token: every log-prob is a finite number (0 or -6e38) on every path, so the
    twin that changes the next token shows it, with a message that says where."""
    cheat = participant(tmp_path, "huge", HUGE.format(size="3e38"))
    result, lines = evaluate(cheat, checkpoint, text_dataset, own_process=False)
    assert result.returncode == 1 and "val_bpb" not in lines
    assert "not causal" in result.stderr and "check causality" in result.stderr
    message = result.stderr.split("error: ", 1)[1]
    for part in ("row ", "cut at position", "position ", " vs ", "6e+38", "tolerance"):
        assert part in message, message
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    module = load_participant_module(cheat, "huge_cheat")
    model = module.load_for_eval(checkpoint, torch.device("cpu"))
    tok = prepare.ensure_tokenizer()
    with pytest.raises(prepare.EvalRefused, match="not causal"):
        prepare.evaluate_bpb(model, tok, 8, SEQ, "cpu", max_tokens=TOKENS)
    check = prepare.causality_check(model, tok, 8, SEQ, "cpu")
    assert check["passed"] is False and "not causal" in check["message"]


@pytest.mark.slow
def test_core_with_huge_logits_is_refused(tmp_path, text_dataset, checkpoint):
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "train.py").write_text(Path(participant(tmp_path, "huge", HUGE.format(size="3e38"))).read_text())
    (kit / "inference.py").write_text((REPO / "inference.py").read_text().replace(
        "self.max_seq_len = model.cos.shape[1]", "self.max_seq_len = None"))
    result = prepare_in_process(["eval-core", "--inference-py", str(kit / "inference.py"), "--checkpoint",
                                 checkpoint, "--bundle-dir", str(make_bundle(tmp_path))],
                                {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert result.returncode == 1, result.stdout
    assert "core:" not in result.stdout
    assert "non-finite losses" in result.stderr or "not causal" in result.stderr, result.stderr[-2000:]


CONSTANT = '''
class Cheat(Model):
    """The same logit {size} for every token at every position."""

    def forward(self, idx):
        return torch.full((*idx.shape, V), {size})
'''

# One file as train.py and inference.py: the constant model, and a scorer that claims losses of {loss} and the
# continuation as every greedy prediction (at a tie the trusted path takes the lowest token id, as torch's argmax).
CLAIMS_THE_CONTINUATION = CONSTANT + '''

class Claims:
    max_seq_len = None

    def score(self, sequences):
        return [(torch.full((len(seq) - 1,), {loss}, dtype=torch.float64), torch.tensor(seq[1:])) for seq in sequences]


def load_scorer(path, device):
    return Claims()
'''
# The uniform control with rounding of its own: every loss ln V, nudged by 1e-5 nats by the sequence's place
# in the call, so that its choices break their ties otherwise than the trusted path (the first choice).
BREAKS_TIES_OTHERWISE = CONSTANT + '''

class Nudged:
    max_seq_len = None

    def score(self, sequences):
        return [(torch.full((len(seq) - 1,), math.log(V) - 1e-5 * (p % 7), dtype=torch.float64),
                 torch.zeros(len(seq) - 1, dtype=torch.long)) for p, seq in enumerate(sequences)]


def load_scorer(path, device):
    return Nudged()
'''
LM_TASKS = [("lm_plain", "language_modeling", 2, " ", 0.0, 24, 12), ("mc_plain", "multiple_choice", 0, " ", 25.0, 8, 5)]


def eval_core(tmp_path, text_dataset, checkpoint, inference_py, train_py=None, tasks=None):
    bundle = make_bundle(tmp_path / f"bundle-{len(tasks or [])}", *([tasks] if tasks else []))
    report = tmp_path / f"{Path(inference_py).stem}.json"
    result = prepare_in_process(["eval-core", "--inference-py", str(inference_py), "--checkpoint", checkpoint,
                                 "--bundle-dir", str(bundle), "--verify-fraction", "1", "--report", str(report),
                                 *(["--train-py", str(train_py)] if train_py else [])],
                                {"FRONTIER_DATA_DIR": str(text_dataset)})
    return result, json.loads(report.read_text()) if result.returncode == 0 else None


@pytest.mark.slow
def test_core_of_a_constant_model_is_the_uniform_control_s_however_large_the_constant(tmp_path, text_dataset,
                                                                                     checkpoint):
    """A constant logit of 0 (the uniform control) and of 1e9 (which made every trusted log-prob 0: every
    language-modelling example an exact match), through the kit's inference.py: the same CORE, every
    decision the trusted path's (a tie goes to the first choice, the lowest token id), exit 0. And the
    control breaking its ties otherwise (decisions that differ within the allowance, either way): exit 0."""
    inference = (REPO / "inference.py").read_text().replace("self.max_seq_len = model.cos.shape[1]",
                                                            "self.max_seq_len = None")
    cores = {}
    for size in ("0.0", "1e9"):
        kit = tmp_path / f"kit-{size}"
        kit.mkdir()
        (kit / "train.py").write_text(Path(participant(tmp_path, f"constant-{size}", CONSTANT.format(size=size)))
                                      .read_text())
        (kit / "inference.py").write_text(inference)
        result, report = eval_core(tmp_path, text_dataset, checkpoint, kit / "inference.py")
        assert result.returncode == 0, result.stderr[-2000:]
        assert "decisions_flipped:   0 " in result.stdout and report["verify"]["max_token_loss_diff"] < 1e-5
        cores[size] = report["core"]
        assert report["tasks"]["lm_plain"]["accuracy"] == 0.0  # the argmax is token 0, never the continuation
    assert cores["0.0"] == cores["1e9"]
    nudged = Path(participant(tmp_path, "nudged", BREAKS_TIES_OTHERWISE.format(size="0.0")))
    nudged.write_text("import math\n" + nudged.read_text())
    result, report = eval_core(tmp_path, text_dataset, checkpoint, nudged, train_py=nudged)
    assert result.returncode == 0, result.stderr[-2000:]  # the lean line printed every count (it crashed)
    assert report["verify"]["decisions_flipped_within_allowance"] > 3 and "verify_lean:         answers " in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["0.0", "math.log(8192)"])
def test_a_constant_model_that_claims_every_continuation_is_refused(tmp_path, text_dataset, checkpoint, loss):
    """The one-file forger: losses of 0 (what the trusted path computed for a constant of 1e9) are 9
    nats off the trusted ln V; losses of ln V with the continuation claimed at every tie flip each
    language-modelling decision towards the gold answer within the allowance (margin 0), and the
    decisions' sign test refuses 24 of 24."""
    forged = Path(participant(tmp_path, "claims", CLAIMS_THE_CONTINUATION.format(size="1e9", loss=loss)))
    forged.write_text("import math\n" + forged.read_text())
    result, _ = eval_core(tmp_path, text_dataset, checkpoint, forged, train_py=forged, tasks=LM_TASKS)
    assert result.returncode == 1 and "core:" not in result.stdout
    why = "mean loss 0.0000 over its scored region, the trusted path 9.0109" if loss == "0.0" else \
        "24 verified examples whose decision differs"
    assert why in result.stderr, result.stderr[-2000:]


# --- a model that remembers ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_model_that_remembers_is_caught_by_probes_it_never_saw_the_original_of(tmp_path, checkpoint, text_dataset,
                                                                                   honest, monkeypatch):
    cheat = participant(tmp_path, "remembers", REMEMBERS)
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    model = load_participant_module(cheat, "remembering_cheat").load_for_eval(checkpoint, torch.device("cpu"))
    in_process = prepare.evaluate_bpb(model, prepare.ensure_tokenizer(), 8, SEQ, "cpu", max_tokens=TOKENS)
    assert in_process["val_bpb"] < 0.5 * float(honest["val_bpb"])  # one process: it answers every probe as it should
    for _ in range(2):  # the command line: a probe never runs in the worker that saw its original
        result, lines = evaluate(cheat, checkpoint, text_dataset, own_process=False)
        assert result.returncode == 1 and "val_bpb" not in lines, result.stdout
        assert any(m in result.stderr for m in ("not causal", "rows must not interact", "depend on the batch size"))


# --- CORE: decisions from the trusted path ------------------------------------------------------

TOWARDS_GOLD = '''

GOLD, WRONG, SHIFT = {gold!r}, {wrong!r}, {shift!r}


class TowardsGold(Scorer):
    """Scores honestly, then moves every loss of a gold answer's sequence down by SHIFT and every
    loss of a wrong one's up by SHIFT, and claims a gold continuation's token as its greedy
    prediction wherever that token is within SHIFT of the best: every answer within the tolerances."""

    @torch.no_grad()
    def score(self, sequences):
        out = []
        for seq, (losses, greedy) in zip(sequences, super().score(sequences)):
            key = hash(tuple(seq))
            if key in GOLD:
                lp = torch.log_softmax(self.model(torch.tensor([seq], device=self.device))[0, :-1].float(), dim=-1)
                target = torch.tensor(seq[1:], device=lp.device)
                near = lp.gather(-1, target[:, None])[:, 0] >= lp.max(dim=-1).values - SHIFT
                out.append((losses - SHIFT, torch.where(near, target, greedy.to(lp.device)).cpu()))
            else:
                out.append((losses + SHIFT if key in WRONG else losses, greedy))
        return out


_load_scorer = load_scorer


def load_scorer(path, device):
    s = _load_scorer(path, device)
    return TowardsGold(s.model, s.device)
'''


def gold_and_wrong(bundle_dir: Path, tokenizer, max_len) -> tuple[set, set]:
    """hash(tuple(tokens)) of every gold answer's sequence in the bundle (a language-modelling
    continuation is gold), and of every wrong choice's."""
    bundle = bundle_from_dir(bundle_dir)
    gold, wrong = set(), set()
    for task in load_tasks(bundle):
        data = shuffled_and_capped(load_examples(bundle, task), -1)
        for i in range(len(data)):
            r = build_request(task, data, i, tokenizer, max_len)
            for j, seq in enumerate(r.sequences):
                (gold if r.gold is None or j == r.gold else wrong).add(hash(tuple(seq)))
    return gold, wrong


def towards_gold(folder: Path, bundle_dir: Path, tokenizer, max_len: int, shift: float) -> Path:
    """The kit's inference.py with TowardsGold in place of its scorer."""
    gold, wrong = gold_and_wrong(bundle_dir, tokenizer, max_len)
    forged = folder / f"towards_gold_{shift:g}.py"
    forged.write_text((REPO / "inference.py").read_text() + TOWARDS_GOLD.format(gold=gold, wrong=wrong, shift=shift))
    return forged


def core_in_process(scorer, bundle_dir: Path, tokenizer) -> tuple[dict, list]:
    """CORE through a scorer in this process, every example drawn for verification."""
    bundle = bundle_from_dir(bundle_dir)
    tasks = load_tasks(bundle)
    examples = {t.label: shuffled_and_capped(load_examples(bundle, t), -1) for t in tasks}
    return evaluate_core(scorer.score, tokenizer, tasks, examples, scorer.max_seq_len, log=lambda m: None,
                         verify_fraction=1.0)


class _Forward(M.LocalForward):
    def __init__(self, model, batch_size: int, max_len: int):
        super().__init__(model, "cpu", prepare.TOKENIZER_VOCAB_SIZE)
        self.batch_size, self.max_len = batch_size, max_len


def verify_in_process(model, samples: list, tokenizer, rng: random.Random | None = None) -> dict:
    """verify_samples through the model in this process, under a fresh secret: the same checks and
    arithmetic as the command line's two workers (refuse_bias is the caller's, as it is the
    command's)."""
    import contextlib
    longest = max(len(s) for sample in samples for s in sample.request.sequences)
    max_len = -(-longest // VERIFY_LENGTH_BUCKET) * VERIFY_LENGTH_BUCKET

    def open_pass(k):
        return contextlib.nullcontext(_Forward(model, VERIFY_BATCH_ROWS, max_len))

    return verify_samples(samples, open_pass, tokenizer, rng or random.SystemRandom())


LEAN_REFUSAL = "lean towards the gold answers beyond what rounding explains"
SHIFTS = (0.005, 0.02, 0.045)  # nats; 0.045 is the issue's; twice each is within the decision allowance 0.1


def kit_model(checkpoint, dtype=None):
    sys.path.insert(0, str(REPO))
    import train as T
    model = T.load_for_eval(str(checkpoint), torch.device("cpu"))
    model.compute_dtype = dtype
    return model


@pytest.mark.slow
def test_core_moved_towards_gold_within_the_tolerances_is_refused(tmp_path, text_dataset, tiny_checkpoint,
                                                                   monkeypatch):
    """The forger of the issue's table (every answer moved towards the gold one by a shift), on a
    bundle whose choices lie close together, at shifts up to the one that keeps every flipped
    decision within the allowance: unverified it pays at each (near-ties flip to gold), every answer
    and decision passes the per-example checks, and the lean refuses it. The honest scorer on the
    same examples: no lean, no refusal."""
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    import inference
    model, tok = kit_model(tiny_checkpoint), prepare.ensure_tokenizer()
    bundle = make_bundle(tmp_path, NEAR_TIE_TASKS, make_near_tie_examples)
    honest, samples = core_in_process(inference.Scorer(model, torch.device("cpu")), bundle, tok)
    found = verify_in_process(model, samples, tok)
    refuse_bias(found["bias"])
    assert found["bias"] == {"answers": [0, 0], "decisions": [0, 0]}
    for k, shift in enumerate(SHIFTS):
        forged = load_participant_module(str(towards_gold(tmp_path, bundle, tok, int(model.cos.shape[1]), shift)),
                                         f"towards_gold_{k}")
        report, samples = core_in_process(forged.TowardsGold(model, torch.device("cpu")), bundle, tok)
        assert report["core"] > honest["core"] + 0.1, shift  # unverified, it pays
        found = verify_in_process(model, samples, tok)  # within every tolerance and allowance
        towards, away = found["bias"]["answers"]
        assert away == 0 and towards == 30 and found["bias"]["decisions"][0] > 0 == found["bias"]["decisions"][1]
        with pytest.raises(CoreError, match=LEAN_REFUSAL):
            refuse_bias(found["bias"])


NEAR_TIE_FLIPS = '''

import math

EXAMPLES, FLIPS, BALLAST, LEAN = {examples!r}, {flips!r}, {ballast!r}, {lean!r}


class FlipsNearTies(Scorer):
    """Knows the bundle (EXAMPLES: hash of a sequence -> task, example, gold?, scored region). Scores
    honestly; then flips to the gold answer the first FLIPS[task] examples of each task whose gold choice
    trails the best rival by less than 0.09 nats on the model (within the bf16 allowance), and as ballast
    flips away from gold the first BALLAST[task] whose gold choice leads by less than that: both mean
    losses moved to the middle and past it by 0.002, each well within the loss tolerance. The other
    examples lean away from their gold answer by LEAN nats where that flips nothing, so that the
    answers' sign test reads like coin tosses."""
    flipped, ballast = {{}}, {{}}

    def score(self, sequences):
        out = [(torch.as_tensor(losses).clone(), greedy) for losses, greedy in super().score(sequences)]
        groups = {{}}
        for p, seq in enumerate(sequences):
            task, example, gold, s, e = EXAMPLES[hash(tuple(seq))]
            groups.setdefault((task, example), []).append((p, gold, s, e))
        for (task, example), members in groups.items():
            mean = {{p: float(out[p][0][s - 1:e - 1].double().mean()) for p, _, s, e in members}}
            g = next(p for p, gold, _, _ in members if gold)
            rival = min((p for p, gold, _, _ in members if not gold), key=mean.get)
            margin, region = mean[g] - mean[rival], {{p: (s, e) for p, _, s, e in members}}
            if 0 < margin < 0.09 and self.flipped.get(task, 0) < FLIPS.get(task, 0):
                self.flipped[task] = self.flipped.get(task, 0) + 1
            elif -0.09 < margin < 0 and self.ballast.get(task, 0) < BALLAST.get(task, 0):
                self.ballast[task] = self.ballast.get(task, 0) + 1
            else:
                if margin > 0 or margin < -2 * LEAN:  # a lean that flips nothing
                    out[g][0][region[g][0] - 1:region[g][1] - 1] += LEAN
                continue
            for p, sign in ((g, -1), (rival, 1)):  # the two means swap places
                out[p][0][region[p][0] - 1:region[p][1] - 1] += sign * (margin / 2 + math.copysign(0.002, margin))
        return out


_load_scorer = load_scorer


def load_scorer(path, device):
    s = _load_scorer(path, device)
    return FlipsNearTies(s.model, s.device)
'''
NEAR_TIE_CHOICE_TASKS = [  # the near-ties of core_bundle, in tasks large enough for a sample of 8 to miss most flips
    ("mc_near", "multiple_choice", 0, " ", 25.0, 64, 0),
    ("schema_near", "schema", 0, " ", 50.0, 64, 0),
]


def near_tie_flipper(folder: Path, bundle_dir: Path, tokenizer, max_len: int, flips: dict, ballast: dict,
                     lean: float) -> Path:
    """The kit's inference.py with FlipsNearTies in place of its scorer."""
    bundle, examples = bundle_from_dir(bundle_dir), {}
    for task in load_tasks(bundle):
        data = shuffled_and_capped(load_examples(bundle, task), -1)
        for i in range(len(data)):
            r = build_request(task, data, i, tokenizer, max_len)
            for j, seq in enumerate(r.sequences):
                examples[hash(tuple(seq))] = (task.label, i, j == r.gold, r.starts[j], r.ends[j])
    forged = folder / f"flips_near_ties_{sum(flips.values())}_{sum(ballast.values())}.py"
    forged.write_text((REPO / "inference.py").read_text() + NEAR_TIE_FLIPS.format(
        examples=examples, flips=flips, ballast=ballast, lean=lean))
    return forged


def eval_core_in_process(scorer, model, tokenizer, tasks, examples, seed: int) -> tuple[dict, float | None]:
    """(the report with inference.py's own decisions, CORE as eval-core gives it: the verified examples decided
    by the trusted path; None where the verification refuses the run), under the secret `seed`."""
    report, samples = evaluate_core(scorer.score, tokenizer, tasks, examples, scorer.max_seq_len, log=lambda m: None,
                                    rng=random.Random(seed))
    claimed = dict(report, tasks={label: dict(t) for label, t in report["tasks"].items()})
    try:
        found = verify_in_process(model, samples, tokenizer, random.Random(seed))
        refuse_bias(found["bias"])
    except CoreError:
        return claimed, None
    count_trusted_decisions(report, found["decided"])
    return claimed, report["core"]


@pytest.mark.slow
@pytest.mark.parametrize("flips, ballast", [({"mc_near": 10, "schema_near": 9}, {}),
                                            ({"mc_near": 14, "schema_near": 13}, {"mc_near": 2, "schema_near": 1})],
                         ids=["to-the-sign-test", "with-ballast"])
def test_a_forger_of_near_ties_scores_no_more_than_the_honest_run(tmp_path, text_dataset, tiny_checkpoint,
                                                                   monkeypatch, flips, ballast):
    """The issue's forgers: an inference.py that knows the bundle flips near-ties to the gold answer, each within
    every tolerance and the decision allowance, as many as the decisions' sign test lets through (19 with none
    away; 27 with 3 correct near-ties flipped away as ballast), and leans away elsewhere so that the answers' sign
    test reads like coins. Its own decisions would score more CORE than the honest run's, and it passes every check;
    but every claimed near-tie is verified and decided by the trusted path, so it scores exactly the honest run's
    CORE (under the same secret; in fp32, where the honest decisions are the trusted path's)."""
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    import inference
    model, tok = kit_model(tiny_checkpoint), prepare.ensure_tokenizer()
    bundle_dir = make_bundle(tmp_path, NEAR_TIE_CHOICE_TASKS, make_near_tie_examples)
    bundle = bundle_from_dir(bundle_dir)
    tasks = load_tasks(bundle)
    examples = {t.label: shuffled_and_capped(load_examples(bundle, t), -1) for t in tasks}
    forged = load_participant_module(str(near_tie_flipper(tmp_path, bundle_dir, tok, int(model.cos.shape[1]), flips,
                                                          ballast, 0.002)), f"flips_{len(ballast)}")
    flipper = forged.FlipsNearTies(model, torch.device("cpu"))
    honest_claimed, honest = eval_core_in_process(inference.Scorer(model, torch.device("cpu")), model, tok, tasks,
                                                  examples, seed=7)
    claimed, forged_core = eval_core_in_process(flipper, model, tok, tasks, examples, seed=7)
    assert flipper.flipped == flips and flipper.ballast == ballast
    assert honest is not None and honest == pytest.approx(honest_claimed["core"], abs=1e-9)  # fp32: no honest flips
    assert claimed["core"] > honest + 0.1  # its own decisions pay
    assert forged_core is None or forged_core <= honest + 1e-6, (forged_core, honest)


HEURISTIC_LEAN = '''

FAVOURED, OTHERS, SHIFT = {favoured!r}, {others!r}, {shift!r}


class LeansToHeuristic(Scorer):
    """Knows no gold answer: moves every choice a heuristic favours (the longest, the first) down by
    SHIFT and the others up by SHIFT, each within the tolerances; where the heuristic is right more
    often than not, the near-ties it flips gain CORE."""

    def score(self, sequences):
        return [(losses - SHIFT if hash(tuple(seq)) in FAVOURED else losses + SHIFT
                 if hash(tuple(seq)) in OTHERS else losses, greedy)
                for seq, (losses, greedy) in zip(sequences, super().score(sequences))]


_load_scorer = load_scorer


def load_scorer(path, device):
    s = _load_scorer(path, device)
    return LeansToHeuristic(s.model, s.device)
'''
HEURISTIC_TASKS = [("mc_lean", "multiple_choice", 0, " ", 25.0, 64, 0), ("mc_lean_answer", "multiple_choice", 1,
                                                                        "\nAnswer: ", 25.0, 64, 0)]


def heuristic_examples(heuristic: str):
    """Near-tie choices (core_bundle's) where the heuristic's choice (one choice a word longer, or the
    first) is the gold answer in 3 examples of 4, another choice otherwise."""
    def make(task_type: str, n: int, right: int, seed: int) -> list[dict]:
        rng, examples = random.Random(seed), make_near_tie_examples(task_type, n, right, seed)
        for ex in examples:
            favoured = rng.randrange(4) if heuristic == "longest" else 0
            if heuristic == "longest":
                ex["choices"][favoured] += " " + rng.choice(("alpha", "kilo", "mike"))
            ex["gold"] = favoured if rng.random() < 0.75 else rng.choice([j for j in range(4) if j != favoured])
        return examples
    return make


def favoured_choices(bundle_dir: Path, tokenizer, max_len: int, heuristic: str) -> tuple[set, set]:
    """hash(tuple(tokens)) of every sequence the heuristic favours (the longest choice, the first), and
    of the others: what a scorer can tell from the sequences alone."""
    bundle, favoured, others = bundle_from_dir(bundle_dir), set(), set()
    for task in load_tasks(bundle):
        data = shuffled_and_capped(load_examples(bundle, task), -1)
        for i in range(len(data)):
            r = build_request(task, data, i, tokenizer, max_len)
            pick = max(range(len(r.sequences)), key=lambda j: len(r.sequences[j])) if heuristic == "longest" else 0
            for j, seq in enumerate(r.sequences):
                (favoured if j == pick else others).add(hash(tuple(seq)))
    return favoured, others


@pytest.mark.slow
@pytest.mark.parametrize("heuristic", ["longest", "first"])
def test_a_lean_towards_a_heuristic_that_often_picks_gold_is_refused(tmp_path, text_dataset, tiny_checkpoint,
                                                                    monkeypatch, heuristic):
    """A cousin of the near-tie flipper that knows no gold answer: it leans every example towards the
    choice a heuristic favours (the longest, the first), by 0.045 nats each way, on tasks where the
    heuristic's choice is gold in 3 of 4 examples (a real task's length or position bias, made strong).
    Unverified it gains CORE; 8 of each task's 64 (the control) see too few leans to tell from coins;
    with every claimed near-tie verified, the answers' lean towards gold is refused
    (bf16's allowance, so that a flipped decision alone does not refuse it)."""
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    import inference
    model, tok = kit_model(tiny_checkpoint), prepare.ensure_tokenizer()
    bundle_dir = make_bundle(tmp_path, HEURISTIC_TASKS, heuristic_examples(heuristic))
    favoured, others = favoured_choices(bundle_dir, tok, int(model.cos.shape[1]), heuristic)
    forged = tmp_path / f"leans_{heuristic}.py"
    forged.write_text((REPO / "inference.py").read_text() + HEURISTIC_LEAN.format(favoured=favoured, others=others,
                                                                                   shift=0.045))
    leaner = load_participant_module(str(forged), f"leans_{heuristic}").LeansToHeuristic(model, torch.device("cpu"))
    bundle = bundle_from_dir(bundle_dir)
    tasks = load_tasks(bundle)
    examples = {t.label: shuffled_and_capped(load_examples(bundle, t), -1) for t in tasks}

    def core(scorer):
        return evaluate_core(scorer.score, tok, tasks, examples, scorer.max_seq_len, log=lambda m: None)

    honest, _ = core(inference.Scorer(model, torch.device("cpu")))
    report, samples = core(leaner)
    assert report["core"] > honest["core"] + 0.05  # unverified, it pays
    with pytest.raises(CoreError, match=LEAN_REFUSAL):
        refuse_bias(verify_in_process(model, samples, tok)["bias"])
    rng = random.Random(0)
    by_task = {}
    for sample in samples:
        by_task.setdefault(sample.task.label, []).append(sample)
    for _ in range(3):  # the control: 8 examples a task (a large task's 2 %) see too few leans to tell from coins
        refuse_bias(verify_in_process(model, [x for group in by_task.values() for x in rng.sample(group, 8)],
                                      tok)["bias"])


def two_rank_jobs(folder, request) -> list[dict]:
    """eval-core of the kit's checkpoint in the suite's one torchrun launch (conftest's two_ranks), on the
    near-tie bundle: the honest scorer, and the forger at 0.045 nats towards every gold answer. In bf16 on any
    host: in fp32 (1e-4) its flipped decisions would be refused before its lean is counted."""
    text_dataset, checkpoint = request.getfixturevalue("text_dataset"), request.getfixturevalue("tiny_checkpoint")
    bundle = make_bundle(folder / "checks", NEAR_TIE_TASKS, make_near_tie_examples)
    forged = towards_gold(folder / "checks", bundle, prepare.ensure_tokenizer(dataset_dir=text_dataset),
                          int(kit_model(checkpoint).cos.shape[1]), 0.045)
    train_py = kit_with_dtype(folder / "checks" / "kit_bf16", "bf16") / "train.py"
    base = ["eval-core", "--checkpoint", str(checkpoint), "--train-py", str(train_py), "--bundle-dir", str(bundle)]
    env = {"FRONTIER_DATA_DIR": str(text_dataset)}
    return [{"name": f"core_lean_{name}", "env": env,
             "prepare": [*base, "--inference-py", str(inference_py), "--report", str(folder / "checks" / f"{name}.json")]}
            for name, inference_py in (("honest", REPO / "inference.py"), ("forged", forged))]


@pytest.mark.slow
def test_under_torchrun_the_lean_of_every_rank_is_tested_together(two_ranks):
    """The issue's row through eval-core, on two ranks each verifying its own share: the honest scorer
    passes and the summary counts both ranks' examples; the forger at 0.045 nats towards every gold
    answer is refused for its lean, with nothing else wrong, by one error, on the counts of both. (That
    it pays unverified: test_core_moved_towards_gold_within_the_tolerances_is_refused, at the same shift
    through the same scoring.)"""
    folder, runs = two_ranks
    honest, forged_run = runs["core_lean_honest"], runs["core_lean_forged"]
    assert honest.returncode == 0, honest.stderr[-3000:]
    verify = json.loads((folder / "checks" / "honest.json").read_text())["verify"]
    assert verify["examples"] == 10 + 10 + 10 + 6 and verify["bias"] == {"answers": [0, 0], "decisions": [0, 0]}
    tasks = json.loads((folder / "checks" / "honest.json").read_text())["tasks"]  # both ranks' draws, summed
    assert sum(t["verified"]["uniform"] for t in tasks.values()) == 36 == verify["coverage"]["uniform"]
    assert verify["coverage"]["near_ties_claimed"] == sum(t["verified"]["near_ties_claimed"] for t in tasks.values())
    assert verify["coverage"]["bound"] == 0 and sum(t["trusted_decisions"]["verified"] for t in tasks.values()) == 36
    assert honest.stdout.count("verify_lean:") == 1
    assert forged_run.returncode != 0 and "core:" not in forged_run.stdout
    assert LEAN_REFUSAL in forged_run.stderr and "of the 30 verified examples whose answers lean" in forged_run.stderr
    assert "must score the trained model" in forged_run.stderr and "differs from the trusted" not in forged_run.stderr
    assert "Traceback" not in forged_run.stderr.split("error:")[0]  # the harness's error, not a crash


def test_the_sign_test_refuses_only_what_fair_coins_would_not_do():
    """refuse_bias: 20 leans towards the gold answers and none away has p = 2^-20 < 1e-6, refused; 19
    is not; balanced counts never are, however many; the message names the count and p."""
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(20, 0) == 2.0 ** -20 and sign_test_p(0, 20) == 1.0
    assert sign_test_p(3, 1) == 5 / 16 and 0.5 < sign_test_p(1000, 1000) < 0.51 and sign_test_p(2000, 0) == 0.0
    for counts in ({"answers": [19, 0], "decisions": [0, 0]}, {"answers": [500, 500], "decisions": [19, 0]},
                   {"answers": [0, 40], "decisions": [1, 30]}):
        refuse_bias(counts)
    for counts, kind in (({"answers": [20, 0], "decisions": [0, 0]}, "verified examples whose answers lean"),
                         ({"answers": [580, 420], "decisions": [0, 0]}, "1000 verified examples whose answers"),
                         ({"answers": [3, 3], "decisions": [25, 1]}, "26 verified examples whose decision differs")):
        with pytest.raises(CoreError, match=LEAN_REFUSAL) as e:
            refuse_bias(counts)
        assert kind in str(e.value) and "p = " in str(e.value)


# --- no false refusals --------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORCE_DTYPE = '''

_kit_load_for_eval = load_for_eval


def load_for_eval(checkpoint_path, device):
    model = _kit_load_for_eval(checkpoint_path, device)
    model.compute_dtype = {dtype}
    return model
'''


def kit_with_dtype(folder: Path, dtype: str) -> Path:
    """The kit's train.py (its load_for_eval forced to a compute dtype), inference.py and kernels/."""
    folder.mkdir(parents=True, exist_ok=True)
    forced = "torch.float32" if dtype == "fp32" else "torch.bfloat16"
    (folder / "train.py").write_text((REPO / "train.py").read_text() + FORCE_DTYPE.format(dtype=forced))
    shutil.copyfile(REPO / "inference.py", folder / "inference.py")
    shutil.copytree(REPO / "kernels", folder / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


SECRETS = 12  # per check and dtype; benchmarks/check_tolerances.py measures the margins with a trained model


def secret_sample(samples: list, rng: random.Random, per_task: int = 8) -> list:
    """A secret draw of per_task examples of each task (all of a smaller one), as eval-core draws its
    verified sample (VERIFY_MIN_EXAMPLES)."""
    tasks: dict[str, list] = {}
    for sample in samples:
        tasks.setdefault(sample.task.label, []).append(sample)
    return [s for pool in tasks.values() for s in rng.sample(pool, min(per_task, len(pool)))]


def test_bf16_linears_on_the_fp32_gemm_compute_what_the_bf16_gemm_computes(tiny_checkpoint):
    """The stand-in for a slow bf16 GEMM (helpers), at the tiny model's shapes, against PyTorch's bf16
    kernel on this host: each output equal but for one bf16 rounding of a sum taken in another order,
    and equal for all but a few in 10^3 (measured: 4e-5 of a [1024, 64] x [64, 8192] projection);
    through the whole model, under the kit's autocast, bf16 logits whose log-probs stay within 0.1 nats
    of the real kernel's (measured: 0.036 at [8, 128]), and the same logits at any batch size."""
    torch.manual_seed(0)
    x, w = torch.randn(1024, 64, dtype=torch.bfloat16), torch.randn(8192, 64, dtype=torch.bfloat16)
    linear = torch.nn.functional.linear
    real = linear(x, w)
    with bf16_linears_on_the_fp32_gemm():
        emulated = torch.nn.functional.linear(x, w)
    assert torch.nn.functional.linear is linear and emulated.dtype == torch.bfloat16
    # summation order moves a sum by ~2^-24 of its products' magnitudes; one bf16 step is at most 2^-7 of a value
    slack = 2**-7 * real.float().abs() + 2**-20 * (x.float().abs() @ w.float().abs().T)
    assert ((emulated.float() - real.float()).abs() <= slack).all() and (emulated != real).float().mean() < 2e-3
    model, idx = kit_model(tiny_checkpoint, torch.bfloat16), torch.randint(4, 8192, (8, 128))
    with torch.no_grad():
        real = model(idx).float().log_softmax(-1)
        with bf16_linears_on_the_fp32_gemm():
            emulated = model(idx).float().log_softmax(-1)
            wider = model(torch.cat([idx, idx.flip(0)]))[:8].float().log_softmax(-1)
    assert 0 < (emulated - real).abs().max() < 0.1 and torch.equal(emulated, wider)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_kit_checkpoint_is_never_refused(tmp_path, text_dataset, tiny_checkpoint, monkeypatch, dtype):
    """The kit's honest checkpoint through every check of eval and eval-core, with 12 secrets each in
    process (the same checks and arithmetic as the command line, but for bf16 on a host without fast bf16:
    there the bf16 GEMM's arithmetic in another summation order, on the fp32 GEMM; for CORE half of them on each
    bundle, the near-ties' included, each secret verifying its own sample and testing its lean),
    and once more through each command (eval-core on the near-ties, where a lean is likeliest; the
    plain bundle's command path: test_core.py's and test_inference.py's eval-core runs)."""
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    import inference
    model, tok = kit_model(tiny_checkpoint, DTYPES[dtype]), prepare.ensure_tokenizer()
    refusals = []
    near = make_bundle(tmp_path / "near", NEAR_TIE_TASKS, make_near_tie_examples)
    # in process, where the bf16 GEMM is a slow reference loop: its arithmetic, summed in another order, on the fp32 GEMM
    with bf16_linears_on_the_fp32_gemm() if dtype == "bf16" and bf16_matmuls_are_slow() else contextlib.nullcontext():
        for _ in range(SECRETS):
            check = prepare.causality_check(model, tok, 8, 128, "cpu", max_rows=24)
            if not check["passed"]:
                refusals.append(check["message"])
        rng = random.SystemRandom()
        for bundle in (make_bundle(tmp_path), near):
            _, samples = core_in_process(inference.Scorer(model, torch.device("cpu")), bundle, tok)
            for _ in range(SECRETS // 2):
                try:
                    refuse_bias(verify_in_process(model, secret_sample(samples, rng), tok)["bias"])
                except CoreError as e:
                    refusals.append(str(e))
    assert refusals == []
    kit = kit_with_dtype(tmp_path / "kit", dtype)
    env = {"FRONTIER_DATA_DIR": str(text_dataset)}
    result = prepare_in_process(["eval-public", "--train-py", str(kit / "train.py"), "--checkpoint",
                                 str(tiny_checkpoint), "--seq-len", "128", "--max-tokens", str(128 * 24)], env)
    assert result.returncode == 0, result.stderr[-2000:]
    result = prepare_in_process(["eval-core", "--inference-py", str(kit / "inference.py"), "--checkpoint",
                                 str(tiny_checkpoint), "--bundle-dir", str(near), "--verify-fraction", "1",
                                 "--report", str(tmp_path / "core_report.json")], env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "verify_lean:         answers " in result.stdout


# --- the plan of an official run ------------------------------------------------------------------

def test_an_official_run_cuts_every_position():
    """20,480 rows of 1,024 + 1 tokens (the official count and context): 3,414 probes, 3,201 of them
    twins whose cuts cover all 1,023 positions, each twin's text after the cut taken from other rows;
    together they catch reading ahead at 0.14 % of the positions in 99 % of runs."""
    rng = np.random.default_rng(0)
    rows = rng.integers(len(prepare.SPECIAL_TOKENS), 8192, size=(20480, 1025)).astype(np.int32)
    scorer = M._Scorer(rows, np.ones(8192, dtype=np.int64), 8, 8192 - len(prepare.SPECIAL_TOKENS), float("inf"),
                       np.random.default_rng(1))
    twins = [p for p in scorer.probes if p.cut < 1024]
    assert len(scorer.probes) == 3414 and len(twins) == 3201 == M.official_twins()
    assert 0.0014 < M.read_ahead_caught(len(twins)) < 0.00145 and (1 - 0.00144) ** 3201 < 0.01
    assert {p.cut for p in twins} == set(range(1, 1024))
    for p in twins[:20]:
        assert np.array_equal(p.inputs[:p.cut], rows[p.row, :p.cut]) and p.inputs[p.cut] != rows[p.row, p.cut]


class RecordingForward:
    """Uniform logits for any batch."""

    def __init__(self, vocab: int):
        self.vocab, self.pending = vocab, []

    def submit(self, rows):
        self.pending.append(np.zeros((*rows.shape, self.vocab), dtype=np.float32))

    def result(self):
        return self.pending.pop(0)


@pytest.mark.parametrize("row_count", [3, 5])
def test_a_replayed_batch_with_fillers_is_compared_in_full(row_count):
    """Fewer rows than a batch (3 of 4): the replayed first-pass batch is the short one, fillers and
    all, and its every row (a filler's too) is compared in full in the second pass; with a full batch
    to replay (5 rows), the replay is a full one."""
    import contextlib
    rows = np.random.default_rng(2).integers(9, 64, size=(row_count, 17)).astype(np.int32)
    scorer = M._Scorer(rows, np.ones(64, dtype=np.int64), 4, 55, float("inf"), np.random.default_rng(3))
    scorer.run(lambda k: contextlib.nullcontext(RecordingForward(64)))
    kept_batch, kept = scorer.kept
    assert len(kept) == 4 and all(lp.shape == (16, 1 + M.SECRET_TOKEN_IDS) for lp in kept)
    assert len(kept_batch.rows) == min(row_count, 4) and scorer.checks.probes >= 1


def test_every_row_is_scored_before_any_probe_runs():
    """The first pass runs nothing but the rows (each once, in order); the second nothing but probes,
    a replay of a first-pass batch and a lone row: no probe runs before, or beside, its original."""
    import contextlib
    rng = np.random.default_rng(2)
    rows = rng.integers(9, 64, size=(50, 17)).astype(np.int32)
    scorer = M._Scorer(rows, np.ones(64, dtype=np.int64), 4, 55, float("inf"), np.random.default_rng(3))
    seen = {0: [], 1: []}
    submit, current = scorer._submit, {"pass": 0}

    def recording_submit(forward, batch):
        seen[current["pass"]].append(batch)
        return submit(forward, batch)

    def open_pass(k):
        current["pass"] = k
        return contextlib.nullcontext(RecordingForward(64))

    scorer._submit = recording_submit
    scorer.run(open_pass)
    first, second = seen[0], seen[1]
    assert [r for b in first for r in b.rows] == list(range(50))
    assert all(p.cut == 0 for b in first for p in b.probes)  # fillers of the short last batch only
    assert all(not b.rows for b in second if b.purpose == "score")
    assert sorted(b.purpose for b in second if b.purpose != "score") == ["alone", "replay"]
    assert sum(len(b.probes) for b in second if b.purpose == "score") >= len(scorer.probes) == 16
    assert scorer.checks.probes >= 16 and all(len(b.inputs) == 4 for b in first + second if b.purpose != "alone")


def test_a_probe_runs_at_its_row_s_batch_index_in_a_batch_of_the_same_shape():
    """Every probe of the second pass sits at the batch index its row had in the first (row % B), in a
    batch of B rows: the same computation an honest model's kernels did for the original; a place no
    probe needs holds a repeat of a probed row of that index."""
    import contextlib
    rows = np.random.default_rng(4).integers(9, 64, size=(50, 17)).astype(np.int32)
    for seed in range(5):
        scorer = M._Scorer(rows, np.ones(64, dtype=np.int64), 4, 55, float("inf"), np.random.default_rng(seed))
        second, submit = [], scorer._submit

        def recording_submit(forward, batch):
            if not batch.rows:
                second.append(batch)
            return submit(forward, batch)

        scorer._submit = recording_submit
        scorer.run(lambda k: contextlib.nullcontext(RecordingForward(64)))
        assert sum(len(b.probes) for b in second) >= len(scorer.probes)
        for batch in second:
            assert len(batch.probes) == 4 and all(p.row % 4 == i for i, p in enumerate(batch.probes))
        assert len(second) == -(-len(scorer.probes) // 4)  # as many probes at every index
