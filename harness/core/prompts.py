"""CORE's prompts: each task's examples shuffled and capped; for one example (build_request), its
few-shot examples, its prompts by task type, their tokens with BOS in front, the scored region of
each sequence and truncation from the left."""
from __future__ import annotations

import random
from dataclasses import dataclass

from harness.common import CoreError
from harness.core.bundle import Task

SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234


def shuffled_and_capped(examples: list, max_per_task: int) -> list:
    data = list(examples)
    random.Random(SHUFFLE_SEED).shuffle(data)
    return data[:max_per_task] if max_per_task > 0 else data


def fewshot_indices(idx: int, n: int, k: int) -> list[int]:
    if k <= 0:
        return []
    return random.Random(FEWSHOT_SEED + idx).sample([i for i in range(n) if i != idx], k)


def render_multiple_choice(item: dict, delimiter: str, shots: list[dict]) -> list[str]:
    prefix = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
    return [f"{prefix}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_schema(item: dict, delimiter: str, shots: list[dict]) -> list[str]:
    prefix = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
    return [f"{prefix}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]


def render_language_modeling(item: dict, delimiter: str, shots: list[dict]) -> list[str]:
    """[prompt without the continuation (stripped), prompt with it]."""
    prefix = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    without = f"{prefix}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


def common_prefix_length(seqs: list[list[int]]) -> int:
    shortest = min(len(s) for s in seqs)
    for i in range(shortest):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return shortest


def common_suffix_length(seqs: list[list[int]]) -> int:
    shortest = min(len(s) for s in seqs)
    for i in range(1, shortest + 1):
        if any(s[-i] != seqs[0][-i] for s in seqs):
            return i - 1
    return shortest


@dataclass
class Request:
    """The sequences of one example and, for each, the scored region [start, end)."""
    sequences: list[list[int]]
    starts: list[int]
    ends: list[int]
    gold: int | None


def scored_regions(task_type: str, tokens: list[list[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    if task_type == "multiple_choice":
        start = common_prefix_length(tokens)
        return tokens, [start] * len(tokens), [len(t) for t in tokens]
    if task_type == "schema":
        suffix = common_suffix_length(tokens)
        return tokens, [len(t) - suffix for t in tokens], [len(t) for t in tokens]
    without, with_ = tokens
    if not (len(without) < len(with_) and with_[:len(without)] == without):
        raise CoreError("the prompt without the continuation does not tokenize to a prefix of the prompt with it")
    return [with_], [len(without)], [len(with_)]


def truncate_left(seq: list[int], start: int, end: int, max_len: int | None) -> tuple[list[int], int, int]:
    """Keep the last max_len tokens; shift the region with them."""
    if max_len is None or len(seq) <= max_len:
        return seq, start, end
    crop = len(seq) - max_len
    if start - crop < 1:
        raise CoreError(f"the scored region ({end - start} tokens) does not fit the scorer's max_seq_len {max_len}")
    return seq[crop:], start - crop, end - crop


def build_request(task: Task, data: list[dict], idx: int, tokenizer, max_len: int | None) -> Request:
    item = data[idx]
    shots = [data[i] for i in fewshot_indices(idx, len(data), task.num_fewshot)]
    render = {"multiple_choice": render_multiple_choice, "schema": render_schema,
              "language_modeling": render_language_modeling}[task.task_type]
    tokens = tokenizer.encode(render(item, task.delimiter, shots), prepend=tokenizer.get_bos_token_id())
    seqs, starts, ends = scored_regions(task.task_type, tokens)
    cut = [truncate_left(s, a, b, max_len) for s, a, b in zip(seqs, starts, ends)]
    return Request([c[0] for c in cut], [c[1] for c in cut], [c[2] for c in cut], item.get("gold"))
