"""CORE's verification: the secret sample of inference.py's answers scored again through the
trusted path (train.py's load_for_eval in two model workers, log-probs computed here from their
logits), with twins cut at secret points; any disagreement beyond a tolerance refuses the run."""
from __future__ import annotations

import collections
import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from harness.checks import TOLERANCE_NATS, CheckLog, checked_log_probs, compare_log_probs
from harness.common import CoreError, EvalRefused
from harness.config import SPECIAL_TOKENS
from harness.core.scoring import (REFUSAL_RISK, VERIFY_GREEDY_TOLERANCE, VERIFY_LOSS_TOLERANCE, VERIFY_TOKEN_TOLERANCE,
                                  Sample, flip_cost, is_correct, region_mean_losses)
from harness.worker.harness_side import ModelForward

# A decision of inference.py's that differs from the trusted path's is accepted only where the trusted
# decision is this close to flipping (nats): the honest difference can flip a near-tie, and nothing
# more. Either side of a tie may move, so twice the measured bf16 difference, times 2.5, rounded up;
# a choice hinges on mean losses (2 x 0.0187), an exact match on single tokens (2 x 0.0442). The same
# for every model, as the tolerances are (harness/checks.py): a model in fp32 differs by far less
# (1.9e-6 and 3.8e-6), but nothing the harness can see of a model proves that it computes in fp32.
DECISION_ALLOWANCE_NATS = {"choice": 0.1, "exact_match": 0.25}


# Bias. Honest differences between inference.py and the trusted path are rounding: they lean towards
# an example's gold answer as often as away from it. A forger who moves its answers towards the gold
# ones by less than the tolerances leans towards them on every example it moves. So every sampled
# example's lean is counted (how much further inference.py's gold answer wins than the trusted
# path's: lean_towards_gold), and so is every decision the two disagree on, and the run is refused
# when either count leans towards the gold answers more than fair coins would, but for a chance of
# BIAS_ALPHA (a one-sided sign test: refuse_bias). A lean within BIAS_FLOOR_NATS of 0 counts for
# neither side: no decision that is not that close to a tie hinges on it.
BIAS_FLOOR_NATS = 1e-3
BIAS_ALPHA = 1e-6  # per count and run: the most an honest run is refused by either sign test
VERIFY_BATCH_ROWS = 4  # rows per forward of the trusted path
VERIFY_LENGTH_BUCKET = 64  # the trusted path pads each forward to a multiple of this length
VERIFY_SECRET_IDS = 8  # token ids compared at every position of a twin, besides the sequence's own


@dataclass
class TrustedRow:
    """A sequence the trusted path runs: an original (every sequence of a sampled example), or its
    shadow in the other pass: a twin cut at `cut` (other text after it) or a repeat (cut None)."""
    tokens: list[int]
    ids: np.ndarray  # int64 [len - 1, k]: the token ids whose log-probs are kept at each position
    key: tuple[int, int]  # (sample, sequence)
    cut: int | None = None
    first: int = 0  # the first position whose log-probs anything reads (a shadowed row's: 0; else its scored region's)


def padded_length(rows: list[TrustedRow], max_len: int) -> int:
    return min(-(-max(len(r.tokens) for r in rows) // VERIFY_LENGTH_BUCKET) * VERIFY_LENGTH_BUCKET, max_len)


def run_rows(forward: ModelForward, batches: list[list[TrustedRow]], pad_id: int
             ) -> list[list[tuple[torch.Tensor, ...]]]:
    """Each batch through the forward (right-padded to its bucketed length; a causal model never
    sees the padding), two in flight: per row, (log-softmax at its ids [n - 1, k], the two largest
    log-softmax values [n - 1, 2], the argmax [n - 1]), computed here (checked_log_probs) from the
    worker's logits."""
    out, queue = [], []

    def take():
        batch = queue.pop(0)
        logits = torch.from_numpy(forward.result())
        got = []
        for r, row in enumerate(batch):  # the log-softmax only where it is read: positions before `first` are 0
            x = logits[r, row.first:len(row.tokens) - 1]
            lp, top, argmax = checked_log_probs(x, row.ids[row.first:], "the trusted model", top=2)
            got.append(tuple(torch.cat([t.new_zeros((row.first, *t.shape[1:])), t]) for t in (lp, top, argmax)))
        out.append(got)

    for batch in batches:
        length = padded_length(batch, forward.max_len)
        inputs = np.full((len(batch), length), pad_id, dtype=np.int32)
        for r, row in enumerate(batch):
            inputs[r, :len(row.tokens)] = row.tokens
        if len(queue) == 2:
            take()
        forward.submit(inputs)
        queue.append(batch)
    while queue:
        take()
    return out


def _twin_tokens(seq: list[int], cut: int, donors: list[tuple[int, list[int]]], rng: random.Random,
                 own: int) -> list[int] | None:
    """seq's tokens before cut, then other real text (a donor's tokens from the cut on, repeated to
    fill; a donor: (its sample, its tokens), never the sample `own`) whose first token differs from
    seq's at the cut: the same length as seq."""
    for _ in range(20):
        sample, donor = donors[rng.randrange(len(donors))]
        if sample != own and len(donor) > cut and donor[cut] != seq[cut]:
            tail = (list(donor[cut:]) * (len(seq) // (len(donor) - cut) + 1))[:len(seq) - cut]
            return list(seq[:cut]) + tail
    return None


def trusted_decision_check(sample: "Sample", lps: list[tuple[torch.Tensor, ...]]) -> dict:
    """Compare inference.py's answers for one sampled example with the trusted path's log-probs:
    each mean loss within VERIFY_LOSS_TOLERANCE, each token's loss within VERIFY_TOKEN_TOLERANCE,
    each claimed greedy token within VERIFY_GREEDY_TOLERANCE of the best, and the decision itself
    (the choice, the exact match) equal to the trusted one unless the trusted decision's own margin
    is below DECISION_ALLOWANCE_NATS.
    CoreError on a disagreement; returns the worst differences and the margin."""
    r, task = sample.request, sample.task
    ours = region_mean_losses(r, [(-lp[:, 0].numpy(), None) for lp, *_ in lps])
    theirs = region_mean_losses(r, sample.claimed)
    worst = {"loss": 0.0, "token": 0.0, "greedy": 0.0, "margin_flipped": 0.0, "flipped": False}
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if r.ends[j] <= r.starts[j]:
            continue  # an empty scored region (a choice whose tokens another's begin with): no loss on either side
        worst["loss"] = max(worst["loss"], abs(a - b))
        if not abs(a - b) <= VERIFY_LOSS_TOLERANCE:
            raise CoreError(f"inference.py's answer differs from the trusted model on task {task.label!r}, example "
                            f"{sample.index}: sequence {j} has mean loss {b:.4f} over its scored region, the trusted "
                            f"path {a:.4f} (tolerance {VERIFY_LOSS_TOLERANCE}). The inference path must score the "
                            "trained model")
    for j, ((lp, *_), (losses, _), s, e) in enumerate(zip(lps, sample.claimed, r.starts, r.ends)):
        gap = float(np.abs(-lp[s - 1:e - 1, 0].numpy() -
                           np.asarray(losses, dtype=np.float64)[s - 1:e - 1]).max()) if e > s else 0.0
        worst["token"] = max(worst["token"], gap)
        if not gap <= VERIFY_TOKEN_TOLERANCE:
            raise CoreError(f"inference.py's answer differs from the trusted model on task {task.label!r}, example "
                            f"{sample.index}: a token of sequence {j}'s scored region has a loss {gap:.4f} nats off "
                            f"the trusted path's (tolerance {VERIFY_TOKEN_TOLERANCE}). The inference path must score "
                            "the trained model")
    claimed_correct = is_correct(task.task_type, r, sample.claimed)
    allowance = DECISION_ALLOWANCE_NATS["exact_match" if task.task_type == "language_modeling" else "choice"]
    if task.task_type == "language_modeling":
        (lp, top2, argmax), s, e = lps[0], r.starts[0], r.ends[0]
        cont, best, second = lp[s - 1:e - 1, 0], top2[s - 1:e - 1, 0], top2[s - 1:e - 1, 1]
        claimed = lp[s - 1:e - 1, 1]
        gap = float((best - claimed).max())
        worst["greedy"] = gap
        if not gap <= VERIFY_GREEDY_TOLERANCE:
            raise CoreError(f"inference.py's greedy predictions differ from the trusted model on task {task.label!r}, "
                            f"example {sample.index}: a claimed prediction's log-prob trails the best by {gap:.3f} "
                            f"nats (tolerance {VERIFY_GREEDY_TOLERANCE}). The inference path must score the trained "
                            "model")
        # as nanochat decides: the argmax (a tie goes to the lowest token id) is the continuation at every token
        trusted_correct = bool(continuation_is_argmax(r, argmax).all())
        # the smallest change of the trusted log-probs that would flip its decision
        margin = float((cont - second).min()) if trusted_correct else float((best - cont).max())
        what = "an exact match" if trusted_correct else "not an exact match"
    else:
        choice = ours.index(min(ours))
        trusted_correct = choice == r.gold
        claimed_choice = theirs.index(min(theirs))
        margin = 0.0 if claimed_choice == choice else ours[claimed_choice] - ours[choice]
        what = f"choice {choice}"
    if trusted_correct != claimed_correct:
        if not margin < allowance:
            verdict = "correct" if claimed_correct else "wrong"
            raise CoreError(f"inference.py's decision differs from the trusted model's on task {task.label!r}, "
                            f"example {sample.index}: the trusted path finds {what} by a margin of {margin:.4g} "
                            f"nats (inference.py says {verdict}; allowance {allowance:g}). The inference path "
                            "must score the trained model")
        worst["margin_flipped"], worst["flipped"] = margin, True
    worst["lean"] = lean_towards_gold(sample, ours, theirs, lps)
    worst["decision_lean"] = int(claimed_correct) - int(trusted_correct)  # +1: only inference.py is right
    worst["task"], worst["trusted_correct"], worst["claimed_correct"] = task.label, trusted_correct, claimed_correct
    return worst


def continuation_is_argmax(request, argmax: torch.Tensor) -> torch.Tensor:
    """Whether the trusted argmax is the continuation's token, at each position of the scored region of
    a language-modelling request's sequence."""
    s, e = request.starts[0], request.ends[0]
    return argmax[s - 1:e - 1] == torch.as_tensor(request.sequences[0][s:e])


def lean_towards_gold(sample: "Sample", ours: list[float], theirs: list[float],
                      lps: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """How much further inference.py's answers favour the example's gold answer than the trusted
    path's do (nats; > 0: towards it). A choice: the margin by which the gold choice's mean loss
    beats its best rival, inference.py's minus the trusted one (rounding moves it either way). An
    exact match: over the positions where inference.py's greedy prediction and the trusted argmax
    disagree on whether the continuation's token is the best, how far the trusted path finds the
    claimed prediction behind its best, counted for the continuation where inference.py claims its
    token and against it where inference.py claims another (a language-modelling task's losses
    decide nothing, so they do not count)."""
    r = sample.request
    if sample.task.task_type != "language_modeling":
        rivals = [j for j in range(len(ours)) if j != r.gold]
        if not rivals:
            return 0.0
        claimed_margin = min(theirs[j] for j in rivals) - theirs[r.gold]
        trusted_margin = min(ours[j] for j in rivals) - ours[r.gold]
        return claimed_margin - trusted_margin
    (lp, top2, argmax), s, e = lps[0], r.starts[0], r.ends[0]
    cont, best, claimed = lp[s - 1:e - 1, 0], top2[s - 1:e - 1, 0], lp[s - 1:e - 1, 1]
    claims_continuation = torch.as_tensor(np.asarray(sample.claimed[0][1])[s - 1:e - 1] ==
                                          np.asarray(r.sequences[0][s:e]))
    continuation_is_best = continuation_is_argmax(r, argmax)
    towards = (best - cont)[claims_continuation & ~continuation_is_best].sum()
    away = (best - claimed)[~claims_continuation & continuation_is_best].sum()
    return float(towards - away)


def sign_test_p(towards: int, away: int) -> float:
    """The chance that at least `towards` of towards + away fair coins come up heads: how likely so
    many leans towards the gold answers are when each is as likely to lean either way (exact)."""
    n = towards + away
    return sum(math.comb(n, k) for k in range(towards, n + 1)) / 2 ** n


BIAS_COUNTS = {
    "answers": "verified examples whose answers lean towards the gold answer by more than {floor:g} nats beyond the "
               "trusted path's (a choice's mean loss, an exact match's greedy predictions)",
    "decisions": "verified examples whose decision differs from the trusted path's",
}


def refuse_bias(bias: dict) -> None:
    """CoreError when inference.py leans towards the gold answers beyond what rounding explains:
    bias[kind] = [towards, away] for each of BIAS_COUNTS (the verified examples of every rank
    together), and bias["decisions_by_task"][label] the same for each task's differing decisions (so
    that flips away from gold in a large task cannot pay for flips towards it in a small one), each
    refused where the sign test's p < BIAS_ALPHA."""
    counts = [(kind, "", bias[kind]) for kind in BIAS_COUNTS]
    counts += [("decisions", f" of task {label!r}", c) for label, c in sorted(bias.get("decisions_by_task", {}).items())]
    for kind, where, (towards, away) in counts:
        p = sign_test_p(towards, away)
        if not p >= BIAS_ALPHA:
            raise CoreError(f"inference.py's answers lean towards the gold answers beyond what rounding explains: of "
                            f"the {towards + away} {BIAS_COUNTS[kind].format(floor=BIAS_FLOOR_NATS)}{where}, "
                            f"{towards} favour the gold answer and {away} the trusted path's (honest differences "
                            f"lean either way: p = {p:.2g} that fair coins lean this far, refused below "
                            f"{BIAS_ALPHA:g}). The inference path must score the trained model")


def count_lean(bias: dict, found: dict) -> None:
    """Add one example's leans (trusted_decision_check's) to the counts refuse_bias tests."""
    if abs(found["lean"]) > BIAS_FLOOR_NATS:
        bias["answers"][found["lean"] < 0] += 1
    if found["decision_lean"]:
        bias["decisions"][found["decision_lean"] < 0] += 1
        bias.setdefault("decisions_by_task", {}).setdefault(found["task"], [0, 0])[found["decision_lean"] < 0] += 1


def coverage(tasks: dict, ranks: list[dict]) -> dict:
    """What this run's verification leaves a forger: every claimed near-tie is verified and decided by the trusted
    path, so only flips outside them pay, and each is refused wherever the uniform sample meets it. With cost c = -ln
    of a flip's chance to escape a rank's draw of a task (flip_cost) and w its CORE (the task's worth), flips escape
    together with a chance of at least 1 - REFUSAL_RISK only while sum(c) <= -ln(1 - REFUSAL_RISK), so they gain at
    most -ln(1 - REFUSAL_RISK) x max(w / c) over every task and rank: the bound, with where it is largest.
    tasks[label]: evaluate_core's report of the task; ranks: each rank's draws, {label: its "verified"}."""
    budget = -math.log1p(-REFUSAL_RISK)
    out = {"risk": REFUSAL_RISK, "near_ties_claimed": 0, "uniform": 0, "bound": 0.0, "task": None}
    for drawn in ranks:
        for label, v in drawn.items():
            out["near_ties_claimed"] += v["near_ties_claimed"]
            out["uniform"] += v["uniform"]
            gain = min(budget * v["worth"] / flip_cost(v["uniform"], v["examples"]), v["worth"] * v["examples"])
            if gain > out["bound"]:
                out["bound"], out["task"] = gain, label
    return out


def verify_samples(samples: list[Sample], open_pass, tokenizer, rng: random.Random) -> dict:
    """Score every sequence of every sampled example through the trusted path, in two passes (for
    the command line: two fresh model workers, one after the other). The first runs the originals,
    batched by length; only then does the second run a shadow of every batch that holds a row of the
    uniform sample (a secret sample of the batches: the near-ties need their trusted decisions, and
    the causality checks need a sample): the same rows at the same shape, with one sequence per
    example replaced by its twin (cut at a secret point of its scored region, other text after it)
    and the others repeated. So a twin runs at its original's length, padding and batch size, in a
    worker that never saw an original. Then: each shadow row agrees with its original (before the
    cut, for a twin) within the same-shape tolerance, and each example's answers and decision agree
    with inference.py's (trusted_decision_check). CoreError on the first disagreement. Returns what
    was compared; the trusted path's decisions per task (decided: [examples, trusted correct, claimed
    correct], for count_trusted_decisions); and the leans towards the gold answers counted (bias)
    for refuse_bias, which the caller runs on every rank's counts together. open_pass(k) is a
    context manager giving the forward of pass k."""
    vocab, pad = tokenizer.get_vocab_size(), tokenizer.get_bos_token_id()
    secret_ids = np.array(rng.sample(range(vocab - len(SPECIAL_TOKENS)), VERIFY_SECRET_IDS), dtype=np.int64)
    originals: dict[tuple[int, int], TrustedRow] = {}
    for k, sample in enumerate(samples):
        for j, seq in enumerate(sample.request.sequences):
            claimed = np.asarray(sample.claimed[j][1], dtype=np.int64)
            if claimed.size and (claimed.min() < 0 or claimed.max() >= vocab):
                raise CoreError(f"inference.py's greedy predictions on task {sample.task.label!r} hold token ids "
                                f"outside the vocabulary [0, {vocab})")
            ids = np.concatenate([np.asarray(seq[1:], dtype=np.int64)[:, None], claimed[:, None],
                                  np.broadcast_to(secret_ids, (len(seq) - 1, VERIFY_SECRET_IDS))], axis=1)
            originals[k, j] = TrustedRow(list(seq), ids, (k, j))
    # by length, in a secret order among equal lengths: where a row sits says nothing of why it is verified
    rows = sorted(rng.sample(list(originals.values()), len(originals)), key=lambda r: len(r.tokens))
    batches = [rows[i:i + VERIFY_BATCH_ROWS] for i in range(0, len(rows), VERIFY_BATCH_ROWS)]
    checked = [b for b in batches if any(samples[row.key[0]].uniform for row in b)]
    for row in rows:  # an unshadowed row is read in its scored region only (at least one position: an empty one)
        row.first = min(samples[row.key[0]].request.starts[row.key[1]] - 1, len(row.tokens) - 2)
    shadowed = collections.defaultdict(list)  # sample -> its sequences in the batches the second pass shadows
    for row in (row for batch in checked for row in batch):
        shadowed[row.key[0]].append(row.key[1])
        row.first = 0  # its shadow compares every position before the cut
    twinned, donors = {}, [(key[0], r.tokens) for key, r in originals.items()]  # sample -> (sequence, cut, twin)
    for k in sorted(shadowed):
        j = rng.choice(sorted(shadowed[k]))
        seq, s, e = samples[k].request.sequences[j], samples[k].request.starts[j], samples[k].request.ends[j]
        if e > s and len(samples) > 1:
            cut = rng.randrange(s, e)
            twin = _twin_tokens(seq, cut, donors, rng, k)
            if twin is not None:
                twinned[k] = (j, cut, twin)

    def shadow(batch: list[TrustedRow]) -> list[TrustedRow]:
        out = []
        for row in batch:
            k, j = row.key
            if k in twinned and twinned[k][0] == j:
                out.append(TrustedRow(twinned[k][2], row.ids, row.key, cut=twinned[k][1]))
            else:
                out.append(TrustedRow(row.tokens, row.ids, row.key))
        return out

    trusted: dict[tuple[int, int], tuple] = {}
    shadows: list[tuple[TrustedRow, tuple]] = []
    for p, plan in enumerate((batches, [shadow(b) for b in rng.sample(checked, len(checked))])):
        with open_pass(p) as forward:
            results = run_rows(forward, plan, pad)
        for batch, got in zip(plan, results):
            for row, lp in zip(batch, got):
                if p == 0:
                    trusted[row.key] = lp
                else:
                    shadows.append((row, lp))
    checks = CheckLog()
    for row, (lp, *_) in shadows:
        k, j = row.key
        original = trusted[row.key][0]
        columns = [0] + list(range(2, 2 + VERIFY_SECRET_IDS))  # the claimed column refers to the original's text
        upto = row.cut if row.cut is not None else len(original)
        try:
            compare_log_probs("causality" if row.cut is not None else "batch_content", lp[:upto, columns],
                              original[:upto, columns], TOLERANCE_NATS["same_shape"], checks,
                              f"task {samples[k].task.label!r}, example {samples[k].index}, sequence {j}"
                              + (f" cut at position {row.cut}" if row.cut is not None else " run again"))
        except EvalRefused as e:
            raise CoreError(f"the trained model fails the contract: {e}") from None
    worst = {"loss": 0.0, "token": 0.0, "greedy": 0.0, "margin_flipped": 0.0}
    decisions_flipped, decided = 0, {}
    bias = {kind: [0, 0] for kind in BIAS_COUNTS}  # [towards the gold answers, away from them]
    for k, sample in enumerate(samples):
        found = trusted_decision_check(sample, [trusted[k, j] for j in range(len(sample.request.sequences))])
        decisions_flipped += found.pop("flipped")
        worst = {key: max(worst[key], found[key]) for key in worst}
        count_lean(bias, found)
        counts = decided.setdefault(sample.task.label, [0, 0, 0])
        counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + found["trusted_correct"], \
            counts[2] + found["claimed_correct"]
    return {"examples": len(samples), "sequences": len(originals),
            "twins": sum(row.cut is not None for row, _ in shadows),
            "shadow_rows": len(shadows), "decisions_flipped_within_allowance": decisions_flipped,
            "max_abs_loss_diff": worst["loss"], "max_token_loss_diff": worst["token"],
            "max_greedy_gap": worst["greedy"],
            "max_causal_diff": max(checks.worst["causality"], checks.worst["batch_content"]),
            "max_flipped_margin": worst["margin_flipped"], "bias": bias, "decided": decided,
            "tolerances": {"loss": VERIFY_LOSS_TOLERANCE, "token": VERIFY_TOKEN_TOLERANCE,
                           "greedy": VERIFY_GREEDY_TOLERANCE, "same_shape": TOLERANCE_NATS["same_shape"],
                           "decision": DECISION_ALLOWANCE_NATS}}
