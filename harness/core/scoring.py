"""CORE's score through inference.py: each example's decision (the lowest mean loss over the
scored regions, or an exact greedy match), centered accuracy, and evaluate_core, which also draws
the secret sample of examples that verify.py scores again."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from harness.common import CoreError
from harness.core.bundle import Task
from harness.core.prompts import Request, build_request

EXAMPLES_PER_CALL = 256  # examples whose sequences go to the scorer in one call (it batches them)
# Verification. Every example whose claimed decision is a near-tie (claimed_near_tie: where a decision that differs
# from the trusted path's could pass every per-example check) is verified, and every verified example counts the
# trusted path's decision, not inference.py's: a claim never decides an example the harness holds the answer to.
# What inference.py still decides alone is its claims far from a tie, where a flipped decision breaks a tolerance
# wherever it is verified: a secret uniform sample of each task, drawn before scoring, sized so that such flips gain a
# forger at most FORGER_GAIN_BOUND of CORE at a REFUSAL_RISK chance of refusal (uniform_sample_size).
VERIFY_FRACTION = 0.02  # of each task's examples, in the uniform sample ...
VERIFY_MIN_EXAMPLES = 8  # ... and at least this many per task (all of a smaller task), and at least:
FORGER_GAIN_BOUND = 0.005  # CORE: the most flips outside the near-ties gain at ...
REFUSAL_RISK = 0.5  # ... this chance of refusal


def flip_worth(examples: int, random_baseline: float, tasks: int) -> float:
    """The CORE that one decision of a task is worth: its share of the task's centered accuracy, over the tasks."""
    return 1 / (examples * (1 - 0.01 * random_baseline) * tasks)


def flip_cost(drawn: int, examples: int) -> float:
    """-ln of the chance that one flipped decision among a rank's `examples` escapes a uniform draw of `drawn`
    (inf: all drawn). f flips escape with at most e^-(f x cost), without replacement as with it."""
    return math.inf if drawn >= examples else -math.log1p(-drawn / examples)


def uniform_sample_size(examples: int, worth: float, fraction: float) -> int:
    """The uniform sample of a rank's `examples` of a task: `fraction` of them, at least VERIFY_MIN_EXAMPLES, and at
    least as many as make the first flip there cost -ln(1 - REFUSAL_RISK) x worth / FORGER_GAIN_BOUND: flips in any
    tasks then escape together with a chance of 1 - REFUSAL_RISK only while they gain at most FORGER_GAIN_BOUND."""
    needed = -math.log1p(-REFUSAL_RISK) * worth / FORGER_GAIN_BOUND
    bound = math.ceil(examples * -math.expm1(-needed) - 1e-9)
    return min(examples, max(VERIFY_MIN_EXAMPLES, math.ceil(fraction * examples), bound))


# inference.py's answers against the trusted path's (train.py's model, other batches and padding, no
# prefix cache). Measured (benchmarks/check_tolerances.py --examples 40: a CPU-preset model trained 2
# minutes, 879 imitated examples of the 22 tasks at up to 1,024 tokens, CPU): bf16 per-token log-probs
# differ by up to 0.0442 nats and mean losses by up to 0.0187 (fp32: 3.8e-6 and 1.9e-6); the bf16 gap is
# the logits' own rounding (a bf16 logit near 16 moves in steps of 0.0625). Each tolerance is at least
# 2.5 times the honest difference it bounds, rounded up. verify.py applies them; they stand here because
# claimed_near_tie, which picks the examples to verify, reads them.
VERIFY_LOSS_TOLERANCE = 0.1  # nats: a choice's mean loss, inference.py's vs the trusted one (5.3x 0.0187)
# a claimed greedy token's log-prob may trail the trusted best by this: at a near-tie both log-probs
# move, so an honest gap reaches twice the per-token difference (2 x 0.0442 x 2.5 = 0.22)
VERIFY_GREEDY_TOLERANCE = 0.25
# each claimed token loss of a scored region, inference.py's vs the trusted one (5.7x 0.0442): it bounds
# the claimed loss of a token an exact match hinges on, which claimed_near_tie reads
VERIFY_TOKEN_TOLERANCE = 0.25


# scored[i] = (losses, greedy) of sequence i: losses[t] = -log p(seq[t+1] | seq[:t+1]),
# greedy[t] = the argmax prediction for seq[t+1].

def region_mean_losses(request: Request, scored) -> list[float]:
    """The mean loss over each sequence's scored region, in float64, exactly its losses' common value
    where they are all equal (a plain fp32 mean, nanochat's, is not always: n copies of ln 8192 average
    to another float for many n): so a uniform model's choices tie exactly on every path of the harness,
    and a tie goes to the first choice (nan for an empty region)."""
    return [mean_exact_for_equal(np.asarray(losses, dtype=np.float64)[s - 1:e - 1])
            for (losses, _), s, e in zip(scored, request.starts, request.ends)]


def mean_exact_for_equal(values: np.ndarray) -> float:
    return float(values[0] + np.mean(values - values[0])) if len(values) else float("nan")


def is_correct(task_type: str, request: Request, scored) -> bool:
    if task_type == "language_modeling":
        (_, greedy), seq = scored[0], request.sequences[0]
        s, e = request.starts[0], request.ends[0]
        return bool(np.array_equal(np.asarray(greedy)[s - 1:e - 1], np.asarray(seq[s:e])))
    means = region_mean_losses(request, scored)
    return means.index(min(means)) == request.gold


def centered_accuracy(accuracy: float, random_baseline_percent: float) -> float:
    rb = 0.01 * random_baseline_percent
    return (accuracy - rb) / (1.0 - rb)


@dataclass
class Sample:
    """An example drawn for verification, with what inference.py answered for it."""
    task: Task
    request: Request
    claimed: list  # (losses, greedy) per sequence
    index: int = -1  # the example's place in its task's (shuffled) list
    uniform: bool = False  # drawn in the uniform sample (else: a claimed near-tie)


def claimed_near_tie(task_type: str, request: Request, claimed) -> bool:
    """Whether inference.py's own answers (claimed: (losses, greedy) per sequence) put an example where
    a decision that differs from the trusted path's could pass trusted_decision_check, so that
    evaluate_core verifies it more often. A choice: the claimed best mean loss leads the next by less
    than 2 x VERIFY_LOSS_TOLERANCE (a flip moves both by up to one tolerance). An exact match: a
    token of the claimed match has a claimed loss above ln 2 - VERIFY_TOKEN_TOLERANCE (where the
    trusted path ranks another token first, the continuation's probability is below 1/2, its loss
    above ln 2). A claimed miss is the same flip the other way, verified alike so that honest flips
    are sampled as often away from the gold answer as towards it: where the trusted path ranks the
    continuation first at every missed token, each is within VERIFY_GREEDY_TOLERANCE of the claimed
    prediction there, so its loss is at least ln(1 + e^-0.25). Bounds are inclusive (<=, >=), so
    that a 50/50 split, rounded, still counts. Empty scored regions decide nothing and count for
    neither."""
    if task_type != "language_modeling":
        means = sorted(m for m, s, e in zip(region_mean_losses(request, claimed), request.starts, request.ends)
                       if e > s)
        return len(means) > 1 and means[1] - means[0] <= 2 * VERIFY_LOSS_TOLERANCE
    (losses, greedy), s, e = claimed[0], request.starts[0], request.ends[0]
    if e <= s:
        return False
    losses = np.asarray(losses, dtype=np.float64)[s - 1:e - 1]
    missed = np.asarray(greedy)[s - 1:e - 1] != np.asarray(request.sequences[0][s:e])
    if not missed.any():
        return bool(losses.max() >= math.log(2) - VERIFY_TOKEN_TOLERANCE)
    # a missed token the trusted path ranks first is within the greedy tolerance of the claimed one:
    # its probability is at most 1 / (1 + e^-VERIFY_GREEDY_TOLERANCE), its loss at least the log of the inverse
    return bool((losses[missed] >= math.log1p(math.exp(-VERIFY_GREEDY_TOLERANCE)) - VERIFY_TOKEN_TOLERANCE).all())


def evaluate_core(score, tokenizer, tasks: list[Task], examples: dict[str, list[dict]], max_len: int | None,
                  examples_per_call: int = EXAMPLES_PER_CALL, log=print, rank: int = 0, world_size: int = 1,
                  verify_fraction: float = VERIFY_FRACTION, rng: random.Random | None = None
                  ) -> tuple[dict, list[Sample]]:
    """Accuracy, centered accuracy and time per task, and CORE, from inference.py's decisions; plus the examples to
    verify: a secret uniform draw made before scoring (uniform_sample_size), and every example inference.py's own
    answers put at a near-tie. score(sequences) -> [(losses, greedy)]. Under torchrun each rank scores every
    world_size-th example (as nanochat strides them) and the counts are summed (the samples stay per rank).
    count_trusted_decisions then puts the trusted path's decisions in place of the verified examples' claims."""
    rng = rng or random.SystemRandom()
    results, samples, total_t0 = {}, [], time.time()
    for task in tasks:
        t0 = time.time()
        data = examples[task.label]
        if len(data) <= task.num_fewshot:
            raise CoreError(f"task {task.label!r} has {len(data)} examples, too few for {task.num_fewshot} shots")
        mine = list(range(rank, len(data), world_size))
        worth = flip_worth(len(data), task.random_baseline, len(tasks))
        wanted = 0 if verify_fraction <= 0 else uniform_sample_size(len(mine), worth, verify_fraction)
        drawn = set(rng.sample(mine, wanted))
        correct, near = 0, []
        for lo in range(0, len(mine), examples_per_call):
            chunk = mine[lo:lo + examples_per_call]
            requests = [build_request(task, data, i, tokenizer, max_len) for i in chunk]
            scored = score([s for r in requests for s in r.sequences])
            k = 0
            for i, r in zip(chunk, requests):
                answer = scored[k:k + len(r.sequences)]
                k += len(r.sequences)
                correct += is_correct(task.task_type, r, answer)
                if i in drawn:
                    samples.append(Sample(task, r, answer, i, uniform=True))
                if wanted > 0 and claimed_near_tie(task.task_type, r, answer):
                    near.append((i, answer))  # the request is built again below: it is the large part
        samples += [Sample(task, build_request(task, data, i, tokenizer, max_len), answer, i)
                    for i, answer in near if i not in drawn]
        if world_size > 1:
            import torch.distributed as dist
            total = torch.tensor([correct], dtype=torch.long)
            dist.all_reduce(total)
            correct = int(total.item())
        accuracy = correct / len(data)
        centered = centered_accuracy(accuracy, task.random_baseline)
        seconds = time.time() - t0
        results[task.label] = {"accuracy": accuracy, "centered": centered, "correct": correct, "examples": len(data),
                               "random_baseline": task.random_baseline, "task_type": task.task_type,
                               "num_fewshot": task.num_fewshot, "seconds": seconds,
                               "verified": {"examples": len(mine), "uniform": wanted, "near_ties_claimed": len(near),
                                            "worth": worth}}
        log(f"{task.label:<34} accuracy: {accuracy:.4f} | centered: {centered:.4f} | "
            f"examples: {len(data):>5} | time: {seconds:.2f}s")
    core = sum(r["centered"] for r in results.values()) / len(results)
    return ({"core": core, "tasks": results, "seconds": time.time() - total_t0,
             "examples": sum(r["examples"] for r in results.values()), "world_size": world_size}, samples)


def count_trusted_decisions(report: dict, decided: dict) -> None:
    """Put the trusted path's decisions in place of inference.py's for the verified examples, in place:
    decided[label] = [verified examples, of them correct on the trusted path, of them correct as claimed] (every
    rank's together); each task's correct count, accuracy and centered accuracy, and CORE, follow."""
    for label, (verified, trusted, claimed) in decided.items():
        t = report["tasks"][label]
        t["correct"] += trusted - claimed
        t["accuracy"] = t["correct"] / t["examples"]
        t["centered"] = centered_accuracy(t["accuracy"], t["random_baseline"])
        t["trusted_decisions"] = {"verified": verified, "changed_by": trusted - claimed}
    report["core"] = sum(t["centered"] for t in report["tasks"].values()) / len(report["tasks"])
