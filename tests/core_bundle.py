"""A synthetic CORE bundle in the real format (core.yaml, eval_meta_data.csv, eval_data/*.jsonl),
built so that the toy scorer in fixtures/toy_inference.py gets known answers:
  - multiple choice: the toy picks the choice containing MAGIC ("§");
  - schema: the toy picks the context option that ends with MAGIC;
  - language modelling: the toy predicts every token except those of POISON ("¤").
Each task says how many of its examples the toy gets right."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

MAGIC, POISON = "§", "¤"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike oscar papa".split()

# label, type, shots, delimiter, random baseline (percent), examples, examples the toy gets right
TASKS = [
    ("mc_plain", "multiple_choice", 0, " ", 25.0, 8, 5),
    ("mc_answer", "multiple_choice", 2, "\nAnswer: ", 50.0, 10, 7),
    ("schema_task", "schema", 0, " ", 50.0, 6, 4),
    ("lm_plain", "language_modeling", 2, " ", 0.0, 8, 6),
    ("lm_answer", "language_modeling", 0, "\nAnswer: ", 0.0, 5, 2),
]


def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_examples(task_type: str, n: int, right: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        ok = i < right
        if task_type == "multiple_choice":
            k = rng.choice([2, 3, 4])
            choices = [_words(rng, 2) for _ in range(k)]
            magic = rng.randrange(k)
            choices[magic] = f"{MAGIC} {_words(rng, 1)}"
            gold = magic if ok else (magic + 1) % k
            examples.append({"query": f"Question {i}: {_words(rng, 5)}?", "choices": choices, "gold": gold})
        elif task_type == "schema":
            k = 2
            options = [f"Context {i} {_words(rng, 3)}" for _ in range(k)]
            magic = rng.randrange(k)
            options[magic] += f" {MAGIC}"
            gold = magic if ok else 1 - magic
            examples.append({"context_options": options, "continuation": _words(rng, 3), "gold": gold})
        else:
            cont = _words(rng, 2) if ok else f"{_words(rng, 1)} {POISON}"
            examples.append({"context": f"  Passage {i}: {_words(rng, 6)}  ", "continuation": cont})
    return examples


# Tasks whose choices differ in one word and then share a long tail: a model's mean losses over
# them lie close together, so any model has near-ties to flip (make_near_tie_examples).
NEAR_TIE_TASKS = [
    ("mc_near", "multiple_choice", 0, " ", 25.0, 10, 0),
    ("mc_near_answer", "multiple_choice", 1, "\nAnswer: ", 25.0, 10, 0),
    ("schema_near", "schema", 0, " ", 50.0, 10, 0),
    ("lm_near", "language_modeling", 0, " ", 0.0, 6, 0),
]


def make_near_tie_examples(task_type: str, n: int, right: int, seed: int) -> list[dict]:
    """Examples whose choices (context options) differ only in their first word, then share 15
    words; the gold answer is drawn at random (`right` is not used)."""
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        tail = _words(rng, 15)
        if task_type == "multiple_choice":
            words = rng.sample(WORDS, 4)
            examples.append({"query": f"Question {i}: {_words(rng, 5)}?", "choices": [f"{w} {tail}" for w in words],
                             "gold": rng.randrange(4)})
        elif task_type == "schema":
            words = rng.sample(WORDS, 2)
            examples.append({"context_options": [f"Context {i} {w}" for w in words], "continuation": tail,
                             "gold": rng.randrange(2)})
        else:
            examples.append({"context": f"Passage {i}: {_words(rng, 6)}", "continuation": _words(rng, 2)})
    return examples


def make_bundle(root: Path, tasks=TASKS, make=make_examples) -> Path:
    """Write the bundle under root/eval_bundle and return that folder: each task's examples from
    make(task_type, examples, right, seed)."""
    bundle = root / "eval_bundle"
    (bundle / "eval_data" / "synthetic").mkdir(parents=True, exist_ok=True)
    lines = ["icl_tasks:"]
    for k, (label, task_type, shots, delim, rb, n, right) in enumerate(tasks):
        uri = f"synthetic/{label}.jsonl"
        with open(bundle / "eval_data" / uri, "w", encoding="utf-8") as f:
            for ex in make(task_type, n, right, seed=k):
                f.write(json.dumps(ex) + "\n")
        lines += [f"- label: {label}", f"  dataset_uri: {uri}", f"  num_fewshot: [{shots}]",
                  f"  icl_task_type: {task_type}"]
        if delim != " " or k % 2:  # the default delimiter, written out for some tasks and implied for others
            lines.append(f"  continuation_delimiter: {json.dumps(delim)}")
    (bundle / "core.yaml").write_text("\n".join(lines) + "\n")
    with open(bundle / "eval_meta_data.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline",
                    "Centered Metric?", "Description"])
        for label, task_type, shots, _, rb, n, _ in tasks:
            w.writerow([label, "synthetic", task_type, shots, n, rb, "Yes", "made up"])
    return bundle


def expected_core(tasks=TASKS) -> tuple[dict, float]:
    acc = {label: right / n for label, _, _, _, _, n, right in tasks}
    centered = {label: (acc[label] - 0.01 * rb) / (1 - 0.01 * rb) for label, _, _, _, rb, _, _ in tasks}
    return acc, sum(centered.values()) / len(centered)
