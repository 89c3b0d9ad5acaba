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
VERIFY_FRACTION = 0.02  # of each task's examples, re-scored through the trusted path (secret sample)
VERIFY_MIN_EXAMPLES = 8  # ... and at least this many per task (all of a smaller task)
# Besides that uniform sample, the examples whose claimed decision is a near-tie (verify.claimed_near_tie:
# where a flipped decision could pass every per-example check) are verified: all of a task's (per rank) up
# to NEAR_TIE_VERIFY_ALL, else this share of them (at least NEAR_TIE_VERIFY_ALL). A weak model's choices
# are nearly all near-ties (benchmarks/check_tolerances.py: every choice task of a CPU-preset model), so
# an official bundle verifies about 5,100 of its 92,241 examples instead of 1,875. Sized so that what a
# forger can hide (verify.coverage) is what the sign test lets through in the smallest task: all of a
# task's 128 puts winograd's 273 there, and a larger share would verify thousands more for nothing.
NEAR_TIE_VERIFY_ALL = 128
NEAR_TIE_VERIFY_FRACTION = 0.05


# scored[i] = (losses, greedy) of sequence i: losses[t] = -log p(seq[t+1] | seq[:t+1]),
# greedy[t] = the argmax prediction for seq[t+1].

def region_mean_losses(request: Request, scored) -> list[float]:
    return [float(np.mean(np.asarray(losses, dtype=np.float64)[s - 1:e - 1]))
            for (losses, _), s, e in zip(scored, request.starts, request.ends)]


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


def near_ties_to_verify(claimed: int) -> int:
    """How many of a task's claimed near-ties are verified (all of a few, a share of many)."""
    return min(claimed, max(NEAR_TIE_VERIFY_ALL, math.ceil(NEAR_TIE_VERIFY_FRACTION * claimed)))


def evaluate_core(score, tokenizer, tasks: list[Task], examples: dict[str, list[dict]], max_len: int | None,
                  examples_per_call: int = EXAMPLES_PER_CALL, log=print, rank: int = 0, world_size: int = 1,
                  verify_fraction: float = VERIFY_FRACTION, rng: random.Random | None = None
                  ) -> tuple[dict, list[Sample]]:
    """Accuracy, centered accuracy and time per task, and CORE; plus the secret sample for
    verification: a uniform draw made before scoring, and a draw from the examples inference.py's
    own answers put at a near-tie, made after. score(sequences) -> [(losses, greedy)]. Under
    torchrun each rank scores every world_size-th example (as nanochat strides them) and the counts
    are summed (the samples stay per rank)."""
    from harness.core.verify import claimed_near_tie  # here: verify.py imports this module
    rng = rng or random.SystemRandom()
    results, samples, total_t0 = {}, [], time.time()
    for task in tasks:
        t0 = time.time()
        data = examples[task.label]
        if len(data) <= task.num_fewshot:
            raise CoreError(f"task {task.label!r} has {len(data)} examples, too few for {task.num_fewshot} shots")
        mine = list(range(rank, len(data), world_size))
        wanted = 0 if verify_fraction <= 0 else min(len(mine), max(VERIFY_MIN_EXAMPLES,
                                                                    math.ceil(verify_fraction * len(mine))))
        drawn = set(rng.sample(mine, wanted))
        correct, near_drawn, near_rest = 0, 0, []
        for lo in range(0, len(mine), examples_per_call):
            chunk = mine[lo:lo + examples_per_call]
            requests = [build_request(task, data, i, tokenizer, max_len) for i in chunk]
            scored = score([s for r in requests for s in r.sequences])
            k = 0
            for i, r in zip(chunk, requests):
                answer = scored[k:k + len(r.sequences)]
                k += len(r.sequences)
                correct += is_correct(task.task_type, r, answer)
                near = wanted > 0 and claimed_near_tie(task.task_type, r, answer)
                if i in drawn:
                    samples.append(Sample(task, r, answer, i))
                    near_drawn += near
                elif near:
                    near_rest.append((i, answer))  # the request is rebuilt for the few drawn: it is the large part
        near_claimed = near_drawn + len(near_rest)
        near_extra = max(0, near_ties_to_verify(near_claimed) - near_drawn)
        samples += [Sample(task, build_request(task, data, i, tokenizer, max_len), answer, i)
                    for i, answer in sorted(rng.sample(near_rest, min(near_extra, len(near_rest))), key=lambda x: x[0])]
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
                               "verified": {"examples": len(mine), "uniform": wanted, "near_ties_claimed": near_claimed,
                                            "near_ties": min(near_claimed, near_drawn + near_extra)}}
        log(f"{task.label:<34} accuracy: {accuracy:.4f} | centered: {centered:.4f} | "
            f"examples: {len(data):>5} | time: {seconds:.2f}s")
    core = sum(r["centered"] for r in results.values()) / len(results)
    return ({"core": core, "tasks": results, "seconds": time.time() - total_t0,
             "examples": sum(r["examples"] for r in results.values()), "world_size": world_size}, samples)
