"""CORE (Phase 2), the trusted side: the pinned eval bundle, prompts, tokenization, scored regions,
decisions, scores, and the verification that makes them trustworthy, exactly as nanochat
computes the DCLM CORE metric. Driven from the command line:

    python prepare.py eval-core --inference-py inference.py --checkpoint out/final.pt
    torchrun --standalone --nproc_per_node=8 prepare.py eval-core ...   # examples strided over 8 ranks

The participant's inference.py turns token sequences into per-position losses and greedy
predictions, in a worker process (harness/worker/); everything that depends on the task happens
here. Its answers are not taken on trust: a secret random sample of the examples it scored (every
sequence of each sampled example, in every task) is scored again through the trusted path
(train.py's load_for_eval in a model worker, losses and argmax computed here from its logits),
and one sequence of each sampled example is also cut at a secret point inside its scored region
and continued with other text, to check the model does not read ahead. A disagreement beyond a
tolerance well below decision margins refuses the run.

Semantics (nanochat core_eval.py / base_eval.py):
- each task's examples are shuffled with random.Random(1337), then capped at --max-per-task;
- example idx gets few-shot examples random.Random(1234 + idx).sample(all indices but idx, k);
- prompts: multiple choice renders one prompt per choice, schema one per context option,
  language modelling one prompt without and one with the continuation; BOS goes in front;
- scored region: the tokens after the common prefix (multiple choice), the common suffix
  (schema), or the continuation (language modelling); longer sequences keep their last
  max_seq_len tokens;
- multiple choice and schema pick the option with the lowest mean loss over its region (first on
  ties); language modelling is correct when greedy predictions match the continuation exactly;
- centered accuracy = (accuracy - 0.01 * baseline) / (1 - 0.01 * baseline) with the bundle's
  random baselines (percent); CORE = the mean over the tasks.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import random
import secrets
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from harness.checks import CheckLog, checked_log_probs, compare_log_probs, tolerances_for
from harness.common import EvalRefused, HarnessError, atomic_write_bytes, atomic_write_json, get_dist_info, \
    log, sha256_file
from harness.config import SPECIAL_TOKENS, cache_root
from harness.download import download_file
from harness.submission import copy_submission
from harness.worker.harness_side import ModelForward, Worker, score_sequences
from harness.worker.wire import WorkerTimeout

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
# The bundle's SHA-256, once the organisers publish it. Set it here or in $FRONTIER_EVAL_BUNDLE_SHA256:
# every run then checks the archive against it, and only a run on the pinned archive is official.
EVAL_BUNDLE_SHA256 = ""
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
REQUIRED_FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
                   "language_modeling": ("context", "continuation")}
SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234
EXAMPLES_PER_CALL = 256  # examples whose sequences go to the scorer in one call (it batches them)
CORE_TIMEOUT_SECONDS = 3600  # the organisers' limit for CORE; here it covers the workers' loads and the verification too
VERIFY_FRACTION = 0.02  # of each task's examples, re-scored through the trusted path (secret sample)
VERIFY_MIN_EXAMPLES = 8  # ... and at least this many per task (all of a smaller task)
# inference.py's answers against the trusted path's (train.py's model, other batches and padding, no
# prefix cache). Measured (benchmarks/check_tolerances.py --examples 40: a CPU-preset model trained 2
# minutes, 879 imitated examples of the 22 tasks at up to 1,024 tokens, CPU): bf16 per-token log-probs
# differ by up to 0.0442 nats and mean losses by up to 0.0187 (fp32: 3.8e-6 and 1.9e-6); the bf16 gap is
# the logits' own rounding (a bf16 logit near 16 moves in steps of 0.0625). Each tolerance is at least
# 2.5 times the honest difference it bounds, rounded up:
VERIFY_LOSS_TOLERANCE = 0.1  # nats: a choice's mean loss, inference.py's vs the trusted one (5.3x 0.0187)
# a claimed greedy token's log-prob may trail the trusted best by this: at a near-tie both log-probs
# move, so an honest gap reaches twice the per-token difference (2 x 0.0442 x 2.5 = 0.22)
VERIFY_GREEDY_TOLERANCE = 0.25
# A decision of inference.py's that differs from the trusted path's is accepted only where the trusted
# decision is this close to flipping (nats): the honest difference can flip a near-tie, and nothing
# more. Either side of a tie may move, so twice the measured difference, times 2.5, rounded up; a
# choice hinges on mean losses (2 x 0.0187), an exact match on single tokens (2 x 0.0442).
DECISION_ALLOWANCE_NATS = {"choice": 0.1, "exact_match": 0.25}
VERIFY_BATCH_ROWS = 4  # rows per forward of the trusted path
VERIFY_LENGTH_BUCKET = 64  # the trusted path pads each forward to a multiple of this length
VERIFY_SECRET_IDS = 8  # token ids compared at every position of a twin, besides the sequence's own


class CoreError(HarnessError):
    pass


@dataclass
class Task:
    label: str
    task_type: str
    num_fewshot: int
    delimiter: str
    dataset_uri: str
    random_baseline: float  # percent


# ---------------------------------------------------------------------------------------------
# The bundle: the pinned archive (read directly, never unpacked) or a local folder (unofficial)
# ---------------------------------------------------------------------------------------------

@dataclass
class Bundle:
    source: str  # the archive or folder it was read from
    sha256: str | None  # of the archive; None for a folder
    pinned: bool  # the archive's SHA-256 equals a configured pin
    files: dict = field(repr=False, default_factory=dict)  # relative path -> bytes, read once at load time

    def read_text(self, relative: str) -> str:
        if relative not in self.files:
            raise CoreError(f"the CORE bundle ({self.source}) has no {relative}")
        return self.files[relative].decode("utf-8")


def bundle_from_dir(path: Path) -> Bundle:
    """A local bundle folder (path itself or its eval_bundle/ subfolder), read into memory."""
    path = Path(path).expanduser()
    for root in (path, path / "eval_bundle"):
        if (root / "core.yaml").is_file():
            files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
            return Bundle(str(root), None, False, files)
    raise CoreError(f"no CORE bundle at {path} (core.yaml not found). Omit --bundle-dir to download it, or unzip "
                    "eval_bundle.zip there.")


def _zip_root(names: list[str]) -> str | None:
    """The folder prefix of core.yaml inside the archive ('' or 'eval_bundle/'), None if absent."""
    for name in sorted(names, key=len):
        if name == "core.yaml" or name.endswith("/core.yaml"):
            return name[:-len("core.yaml")]
    return None


def _check_zip(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise CoreError(f"{path.name} is not a zip archive")
    with zipfile.ZipFile(path) as z:
        if _zip_root(z.namelist()) is None:
            raise CoreError(f"{path.name} holds no core.yaml")


def bundle_from_zip(path: Path, pinned: bool, sha256: str) -> Bundle:
    with zipfile.ZipFile(path) as z:
        root = _zip_root(z.namelist())
        files = {n[len(root):]: z.read(n) for n in z.namelist() if n.startswith(root) and not n.endswith("/")}
    return Bundle(str(path), sha256, pinned, files)


def configured_pin(sha256: str | None = None) -> str:
    return (sha256 if sha256 is not None else os.environ.get("FRONTIER_EVAL_BUNDLE_SHA256") or EVAL_BUNDLE_SHA256).lower()


def ensure_bundle(bundle_dir=None, url: str | None = None, sha256: str | None = None) -> Bundle:
    """The eval bundle. --bundle-dir: that folder, as is (unofficial). Otherwise the archive in the
    cache, downloaded on first use (its SHA-256 is recorded beside it and printed), checked against
    the configured pin when there is one, and read straight from the archive."""
    if bundle_dir is not None:
        return bundle_from_dir(Path(bundle_dir))
    url = url or os.environ.get("FRONTIER_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL
    pin = configured_pin(sha256)
    archive = cache_root() / "eval_bundle.zip"
    record = cache_root() / "eval_bundle.zip.sha256"
    if archive.exists():
        try:
            _check_zip(archive)
        except CoreError as e:
            log(f"[core] replacing a bad archive: {e}")
            archive.unlink()
    if not archive.exists():
        log(f"[core] downloading the eval bundle from {url}")
        download_file(url, archive, validate=_check_zip)
        digest = sha256_file(archive)
        atomic_write_bytes(record, f"{digest}  eval_bundle.zip\n".encode())
        log(f"[core] eval_bundle.zip sha256 {digest} (recorded in {record})")
    actual = sha256_file(archive)
    if pin and actual != pin:
        raise CoreError(f"{archive} has sha256 {actual}, but the pinned bundle is {pin}. Delete it and rerun to "
                        "download it again; if it persists, the published bundle changed.")
    if not pin and record.exists() and record.read_text().split()[0] != actual:
        raise CoreError(f"{archive} changed since it was downloaded (sha256 {actual}, recorded "
                        f"{record.read_text().split()[0]} in {record}). Delete both and rerun to download it again.")
    return bundle_from_zip(archive, bool(pin), actual)


def load_tasks(bundle: Bundle) -> list[Task]:
    """The tasks of core.yaml with their random baselines from eval_meta_data.csv."""
    import yaml
    try:
        config = yaml.safe_load(bundle.read_text("core.yaml"))
        entries = config["icl_tasks"]
    except CoreError:
        raise
    except Exception as e:
        raise CoreError(f"{bundle.source}: core.yaml is not a CORE task list ({type(e).__name__}: {e})")
    baselines = {}
    try:
        for row in csv.DictReader(io.StringIO(bundle.read_text("eval_meta_data.csv"))):
            baselines[row["Eval Task"]] = float(row["Random baseline"])
    except (KeyError, ValueError) as e:
        raise CoreError(f"{bundle.source}: eval_meta_data.csv: cannot read the random baselines "
                        f"({type(e).__name__}: {e})")
    tasks = []
    for entry in entries:
        label = entry.get("label", "?")
        if entry.get("icl_task_type") not in TASK_TYPES:
            raise CoreError(f"core.yaml: task {label!r} has icl_task_type {entry.get('icl_task_type')!r}; known types: "
                            f"{', '.join(TASK_TYPES)}")
        if label not in baselines:
            raise CoreError(f"eval_meta_data.csv has no random baseline for task {label!r}")
        tasks.append(Task(label, entry["icl_task_type"], int(entry["num_fewshot"][0]),
                          entry.get("continuation_delimiter", " "), entry["dataset_uri"], baselines[label]))
    return tasks


def load_examples(bundle: Bundle, task: Task) -> list[dict]:
    relative = f"eval_data/{task.dataset_uri}"
    if relative not in bundle.files:
        raise CoreError(f"task {task.label!r}: data file {relative} is missing from {bundle.source}")
    examples = []
    for n, line in enumerate(bundle.read_text(relative).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line.strip())
        except json.JSONDecodeError as e:
            raise CoreError(f"{relative}:{n}: not valid JSON ({e})")
        missing = [k for k in REQUIRED_FIELDS[task.task_type] if not isinstance(item, dict) or k not in item]
        if missing:
            raise CoreError(f"{relative}:{n}: a {task.task_type} example needs {list(REQUIRED_FIELDS[task.task_type])}; "
                            f"missing {missing}")
        examples.append(item)
    return examples


# ---------------------------------------------------------------------------------------------
# Sampling, prompts and scored regions
# ---------------------------------------------------------------------------------------------

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




# ---------------------------------------------------------------------------------------------
# Decisions
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Scoring through inference.py, with a secret sample kept for verification
# ---------------------------------------------------------------------------------------------

@dataclass
class Sample:
    """An example drawn for verification, with what inference.py answered for it."""
    task: Task
    request: Request
    claimed: list  # (losses, greedy) per sequence
    index: int = -1  # the example's place in its task's (shuffled) list


def evaluate_core(score, tokenizer, tasks: list[Task], examples: dict[str, list[dict]], max_len: int | None,
                  examples_per_call: int = EXAMPLES_PER_CALL, log=print, rank: int = 0, world_size: int = 1,
                  verify_fraction: float = VERIFY_FRACTION, rng: random.Random | None = None
                  ) -> tuple[dict, list[Sample]]:
    """Accuracy, centered accuracy and time per task, and CORE; plus the secret sample for
    verification. score(sequences) -> [(losses, greedy)]. Under torchrun each rank scores every
    world_size-th example (as nanochat strides them) and the counts are summed."""
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
        correct = 0
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
                    samples.append(Sample(task, r, answer, i))
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
                               "num_fewshot": task.num_fewshot, "seconds": seconds}
        log(f"{task.label:<34} accuracy: {accuracy:.4f} | centered: {centered:.4f} | "
            f"examples: {len(data):>5} | time: {seconds:.2f}s")
    core = sum(r["centered"] for r in results.values()) / len(results)
    return ({"core": core, "tasks": results, "seconds": time.time() - total_t0,
             "examples": sum(r["examples"] for r in results.values()), "world_size": world_size}, samples)


# ---------------------------------------------------------------------------------------------
# Verification: the sample again, through the trusted path
# ---------------------------------------------------------------------------------------------

@dataclass
class _Row:
    """A sequence the trusted path runs: an original (every sequence of a sampled example), or its
    shadow in the other pass: a twin cut at `cut` (other text after it) or a repeat (cut None)."""
    tokens: list[int]
    ids: np.ndarray  # int64 [len - 1, k]: the token ids whose log-probs are kept at each position
    key: tuple[int, int]  # (sample, sequence)
    cut: int | None = None


def _padded_length(rows: list[_Row], max_len: int) -> int:
    return min(-(-max(len(r.tokens) for r in rows) // VERIFY_LENGTH_BUCKET) * VERIFY_LENGTH_BUCKET, max_len)


def run_rows(forward: ModelForward, batches: list[list[_Row]], pad_id: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """Each batch through the forward (right-padded to its bucketed length; a causal model never
    sees the padding), two in flight: per row, (log-softmax at its ids [n - 1, k], the two largest
    log-softmax values [n - 1, 2]), computed here in fp32 from the worker's logits."""
    out, queue = [], []

    def take():
        batch = queue.pop(0)
        logits = torch.from_numpy(forward.result())
        got = []
        for r, row in enumerate(batch):
            x = logits[r, :len(row.tokens) - 1]
            lp, lse = checked_log_probs(x, row.ids, "the trusted model")
            got.append((lp, x.topk(2, dim=-1).values - lse))
        out.append(got)

    for batch in batches:
        length = _padded_length(batch, forward.max_len)
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


def _twin_tokens(seq: list[int], cut: int, donors: list[list[int]], rng: random.Random) -> list[int] | None:
    """seq's tokens before cut, then other real text (a donor's tokens from the cut on, repeated to
    fill) whose first token differs from seq's at the cut: the same length as seq."""
    for _ in range(20):
        donor = donors[rng.randrange(len(donors))]
        if len(donor) > cut and donor[cut] != seq[cut]:
            tail = (list(donor[cut:]) * (len(seq) // (len(donor) - cut) + 1))[:len(seq) - cut]
            return list(seq[:cut]) + tail
    return None


def trusted_decision_check(sample: "Sample", lps: list[tuple[torch.Tensor, torch.Tensor]], tol: dict) -> dict:
    """Compare inference.py's answers for one sampled example with the trusted path's log-probs:
    each mean loss within VERIFY_LOSS_TOLERANCE, each claimed greedy token within
    VERIFY_GREEDY_TOLERANCE of the best, and the decision itself (the choice, the exact match)
    equal to the trusted one unless the trusted decision's own margin is below the allowance.
    CoreError on a disagreement; returns the worst differences and the margin."""
    r, task = sample.request, sample.task
    ours = region_mean_losses(r, [(-lp[:, 0].double().numpy(), None) for lp, _ in lps])
    theirs = region_mean_losses(r, sample.claimed)
    worst = {"loss": 0.0, "greedy": 0.0, "margin_flipped": 0.0, "flipped": False}
    for j, (a, b) in enumerate(zip(ours, theirs)):
        worst["loss"] = max(worst["loss"], abs(a - b))
        if not abs(a - b) <= VERIFY_LOSS_TOLERANCE:
            raise CoreError(f"inference.py's answer differs from the trusted model on task {task.label!r}, example "
                            f"{sample.index}: sequence {j} has mean loss {b:.4f} over its scored region, the trusted "
                            f"path {a:.4f} (tolerance {VERIFY_LOSS_TOLERANCE}). The inference path must score the "
                            "trained model")
    claimed_correct = is_correct(task.task_type, r, sample.claimed)
    allowance = tol["decision"]["exact_match" if task.task_type == "language_modeling" else "choice"]
    if task.task_type == "language_modeling":
        (lp, top2), s, e = lps[0], r.starts[0], r.ends[0]
        cont, best, second = lp[s - 1:e - 1, 0], top2[s - 1:e - 1, 0], top2[s - 1:e - 1, 1]
        claimed = lp[s - 1:e - 1, 1]
        gap = float((best - claimed).max())
        worst["greedy"] = gap
        if not gap <= VERIFY_GREEDY_TOLERANCE:
            raise CoreError(f"inference.py's greedy predictions differ from the trusted model on task {task.label!r}, "
                            f"example {sample.index}: a claimed prediction's log-prob trails the best by {gap:.3f} "
                            f"nats (tolerance {VERIFY_GREEDY_TOLERANCE}). The inference path must score the trained "
                            "model")
        trusted_correct = bool((cont >= best).all())
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
                            f"nats (inference.py says {verdict}; allowance {allowance:g}). The inference path must "
                            "score the trained model")
        worst["margin_flipped"], worst["flipped"] = margin, True
    return worst


def verify_samples(samples: list[Sample], open_pass, tokenizer, rng: random.Random) -> dict:
    """Score every sequence of every sampled example through the trusted path, in two passes (for
    the command line: two fresh model workers, one after the other). The first runs the originals,
    batched by length; only then does the second run a shadow of every batch: the same rows at the
    same shape, with one sequence per example replaced by its twin (cut at a secret point of its
    scored region, other text after it) and the others repeated. So a twin runs at its original's
    length, padding and batch size, in a worker that never saw an original. Then: each shadow row
    agrees with its original (before the cut, for a twin) within the dtype's same-shape tolerance,
    and each example's answers and decision agree with inference.py's (trusted_decision_check).
    CoreError on the first disagreement. open_pass(k) is a context manager giving (forward,
    compute dtype) for pass k."""
    vocab, pad = tokenizer.get_vocab_size(), tokenizer.get_bos_token_id()
    secret_ids = np.array(rng.sample(range(vocab - len(SPECIAL_TOKENS)), VERIFY_SECRET_IDS), dtype=np.int64)
    originals: dict[tuple[int, int], _Row] = {}
    for k, sample in enumerate(samples):
        for j, seq in enumerate(sample.request.sequences):
            claimed = np.asarray(sample.claimed[j][1], dtype=np.int64)
            if claimed.size and (claimed.min() < 0 or claimed.max() >= vocab):
                raise CoreError(f"inference.py's greedy predictions on task {sample.task.label!r} hold token ids "
                                f"outside the vocabulary [0, {vocab})")
            ids = np.concatenate([np.asarray(seq[1:], dtype=np.int64)[:, None], claimed[:, None],
                                  np.broadcast_to(secret_ids, (len(seq) - 1, VERIFY_SECRET_IDS))], axis=1)
            originals[k, j] = _Row(list(seq), ids, (k, j))
    twinned = {}  # sample -> (sequence, cut, twin tokens)
    for k, sample in enumerate(samples):
        j = rng.randrange(len(sample.request.sequences))
        seq, s, e = sample.request.sequences[j], sample.request.starts[j], sample.request.ends[j]
        donors = [r.tokens for key, r in originals.items() if key[0] != k]
        if e > s and donors:
            cut = rng.randrange(s, e)
            twin = _twin_tokens(seq, cut, donors, rng)
            if twin is not None:
                twinned[k] = (j, cut, twin)
    rows = sorted(originals.values(), key=lambda r: len(r.tokens))
    batches = [rows[i:i + VERIFY_BATCH_ROWS] for i in range(0, len(rows), VERIFY_BATCH_ROWS)]

    def shadow(batch: list[_Row]) -> list[_Row]:
        out = []
        for row in batch:
            k, j = row.key
            if k in twinned and twinned[k][0] == j:
                out.append(_Row(twinned[k][2], row.ids, row.key, cut=twinned[k][1]))
            else:
                out.append(_Row(row.tokens, row.ids, row.key))
        return out

    trusted: dict[tuple[int, int], tuple] = {}
    shadows: list[tuple[_Row, tuple]] = []
    dtypes = []
    for p, plan in enumerate((batches, [shadow(b) for b in rng.sample(batches, len(batches))])):
        with open_pass(p) as (forward, dtype):
            dtypes.append(dtype)
            results = run_rows(forward, plan, pad)
        for batch, got in zip(plan, results):
            for row, lp in zip(batch, got):
                if p == 0:
                    trusted[row.key] = lp
                else:
                    shadows.append((row, lp))
    if dtypes[0] != dtypes[1]:
        raise CoreError(f"the trusted model reported compute dtype {dtypes[0]} in one worker and {dtypes[1]} in the "
                        "other")
    tol = {**tolerances_for(dtypes[0]), "decision": DECISION_ALLOWANCE_NATS}
    checks = CheckLog()
    for row, (lp, _) in shadows:
        k, j = row.key
        original = trusted[row.key][0]
        columns = [0] + list(range(2, 2 + VERIFY_SECRET_IDS))  # the claimed column refers to the original's text
        upto = row.cut if row.cut is not None else len(original)
        try:
            compare_log_probs("causality" if row.cut is not None else "batch_content", lp[:upto, columns],
                              original[:upto, columns], tol["same_shape"], checks,
                              f"task {samples[k].task.label!r}, example {samples[k].index}, sequence {j}"
                              + (f" cut at position {row.cut}" if row.cut is not None else " run again"))
        except EvalRefused as e:
            raise CoreError(f"the trained model fails the contract: {e}") from None
    worst = {"loss": 0.0, "greedy": 0.0, "margin_flipped": 0.0}
    decisions_flipped = 0
    for k, sample in enumerate(samples):
        found = trusted_decision_check(sample, [trusted[k, j] for j in range(len(sample.request.sequences))], tol)
        decisions_flipped += found.pop("flipped")
        worst = {key: max(worst[key], found[key]) for key in worst}
    return {"examples": len(samples), "sequences": len(originals), "twins": len(twinned),
            "shadow_rows": len(shadows), "decisions_flipped_within_allowance": decisions_flipped,
            "max_abs_loss_diff": worst["loss"], "max_greedy_gap": worst["greedy"],
            "max_causal_diff": max(checks.worst["causality"], checks.worst["batch_content"]),
            "max_flipped_margin": worst["margin_flipped"], "compute_dtype": dtypes[0] or "unknown",
            "tolerances": {"loss": VERIFY_LOSS_TOLERANCE, "greedy": VERIFY_GREEDY_TOLERANCE,
                           "same_shape": tol["same_shape"], "decision": DECISION_ALLOWANCE_NATS}}


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def official_reasons(bundle: Bundle, tasks: list[Task], all_tasks: list[Task], max_per_task: int,
                     verify_fraction: float) -> list[str]:
    """Why a CORE run is not official (empty: it is)."""
    reasons = []
    if bundle.sha256 is None:
        reasons.append(f"a local bundle folder ({bundle.source}), not the pinned archive")
    elif not bundle.pinned:
        reasons.append(f"no bundle pin is configured (this archive's sha256 is {bundle.sha256}; pin it with "
                       "FRONTIER_EVAL_BUNDLE_SHA256)")
    if verify_fraction <= 0:
        reasons.append("verification is off (--verify-fraction 0)")
    if len(tasks) != len(all_tasks):
        reasons.append(f"{len(tasks)} of {len(all_tasks)} tasks")
    if max_per_task > 0:
        reasons.append(f"capped at {max_per_task} examples per task")
    return reasons


def cmd_eval_core(args) -> int:
    ddp, rank, local_rank, world_size = get_dist_info()
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("gloo")  # only counts and verdicts travel between the harness processes
    try:
        return run_eval_core(args, rank, local_rank, world_size)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def _agree(ok: bool, message: str, world_size: int) -> None:
    """Every rank raises if any rank failed (so no rank reports a run another refused)."""
    if world_size > 1:
        import torch.distributed as dist
        verdicts = [None] * world_size
        dist.all_gather_object(verdicts, (ok, message))
        failed = [m for good, m in verdicts if not good]
        if failed:
            raise CoreError(failed[0])
    elif not ok:
        raise CoreError(message)


def run_eval_core(args, rank: int, local_rank: int, world_size: int) -> int:
    from harness.tokenizer import ensure_tokenizer
    device = args.device or "auto"  # resolved in the workers: this process never touches an accelerator
    inference_py = Path(args.inference_py)
    train_py = Path(args.train_py) if args.train_py else inference_py.resolve().parent / "train.py"
    bundle = ensure_bundle(args.bundle_dir, args.bundle_url) if rank == 0 else None
    if world_size > 1:
        import torch.distributed as dist
        dist.barrier()  # rank 0 downloads; the others then find the archive in the cache
    bundle = bundle or ensure_bundle(args.bundle_dir, args.bundle_url)
    all_tasks = load_tasks(bundle)
    tasks = all_tasks
    if args.tasks:
        wanted = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = sorted(set(wanted) - {t.label for t in tasks})
        if unknown:
            raise CoreError(f"--tasks: unknown {unknown}; the bundle has {[t.label for t in tasks]}")
        tasks = [t for t in tasks if t.label in wanted]
    examples = {t.label: shuffled_and_capped(load_examples(bundle, t), args.max_per_task) for t in tasks}
    tokenizer = ensure_tokenizer()
    if args.verify_fraction > 0 and not train_py.is_file():
        raise CoreError(f"{train_py}: no such file (the train.py whose load_for_eval verifies inference.py; "
                        "--train-py names it)")
    rng = random.SystemRandom()  # the secret sample and cut points: unknown to inference.py
    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    if not args.timeout > 0:
        raise CoreError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    deadline = time.monotonic() + args.timeout
    protected = [bundle.source] if bundle.sha256 is not None else []
    not_official: list[str] = []
    workers: list[dict] = []  # what each worker cost: its start, its load, all of it
    verification, failure = None, ""
    with copy_submission(train_py if train_py.is_file() else None, args.checkpoint,
                         inference_py=inference_py) as submission:
        try:
            t_worker = time.time()
            with Worker("scorer", submission, device, deadline=deadline, label="inference.py", local_rank=local_rank,
                        tokenizer=tokenizer, protected=protected, use_sandbox=not args.no_sandbox) as w:
                workers.append({"label": "inference.py", "start_seconds": w.start_seconds,
                                "load_seconds": time.time() - t_worker})
                not_official += w.not_official_because
                say(f"[core] {len(tasks)} tasks, max {args.max_per_task if args.max_per_task > 0 else 'all'} examples "
                    f"each, device {w.info['device']} x {world_size}, verifying {args.verify_fraction:.0%} of the "
                    "examples")
                report, samples = evaluate_core(lambda seqs: score_sequences(w, seqs), tokenizer, tasks, examples,
                                                w.info["max_seq_len"], args.examples_per_call, log=say, rank=rank,
                                                world_size=world_size, verify_fraction=args.verify_fraction, rng=rng)
                report_device = w.info["device"]
            workers[-1]["seconds"] = time.time() - t_worker
            if args.verify_fraction > 0:
                longest = max((len(s) for sample in samples for s in sample.request.sequences), default=2)
                max_len = -(-longest // VERIFY_LENGTH_BUCKET) * VERIFY_LENGTH_BUCKET

                @contextlib.contextmanager
                def open_pass(k: int):
                    t_worker, label = time.time(), f"train.py{'' if k == 0 else '.2'}"
                    with Worker("model", submission, device, deadline=deadline, label=label, local_rank=local_rank,
                                tokenizer=tokenizer, protected=protected, use_sandbox=not args.no_sandbox) as w:
                        workers.append({"label": label, "start_seconds": w.start_seconds,
                                        "load_seconds": time.time() - t_worker})
                        not_official.extend(w.not_official_because)
                        forward = ModelForward(w, VERIFY_BATCH_ROWS, max_len, tokenizer.get_vocab_size())
                        try:
                            yield forward, w.info["compute_dtype"]
                        finally:
                            forward.close()
                    workers[-1]["seconds"] = time.time() - t_worker

                try:
                    verification = verify_samples(samples, open_pass, tokenizer, rng)
                except (CoreError, EvalRefused) as e:
                    failure = str(e)
        except WorkerTimeout:
            raise CoreError(f"CORE did not finish within {args.timeout:g}s (--timeout: the scorer's load and scoring "
                            "and the verification); no score. The workers and everything they started were "
                            "stopped.") from None
    _agree(not failure, failure, world_size)
    if world_size > 1 and verification is not None:
        import torch.distributed as dist
        everyone = [None] * world_size
        dist.all_gather_object(everyone, verification)
        for key in ("examples", "sequences", "twins", "shadow_rows", "decisions_flipped_within_allowance"):
            verification[key] = sum(v[key] for v in everyone)
        for key in ("max_abs_loss_diff", "max_greedy_gap", "max_causal_diff", "max_flipped_margin"):
            verification[key] = max(v[key] for v in everyone)
    if rank != 0:
        return 0
    reasons = official_reasons(bundle, tasks, all_tasks, args.max_per_task, args.verify_fraction) + \
        list(dict.fromkeys(not_official))
    hashes = submission.sha256
    report.update({"official": not reasons, "not_official_because": reasons,
                   "baselines": "bundle eval_meta_data.csv (CORE v1)", "max_per_task": args.max_per_task,
                   "device": report_device, "bundle": bundle.source, "bundle_sha256": bundle.sha256,
                   "checkpoint": str(args.checkpoint), "checkpoint_sha256": hashes["checkpoint"],
                   "train_py": str(train_py), "train_py_sha256": hashes.get("train_py"),
                   "inference_py_sha256": hashes["inference_py"], "kernels_sha256": hashes.get("kernels"),
                   "tokenizer_sha256": tokenizer.sha256, "verify": verification, "workers": workers})
    report_path = Path(args.report) if args.report else Path(args.checkpoint).resolve().parent / "core_report.json"
    atomic_write_json(report_path, report)
    print("---")
    print(f"core:                {report['core']:.4f}")
    print(f"official:            {not reasons}  ({len(tasks)} tasks, {report['examples']} examples"
          f"{'; not official: ' + '; '.join(reasons) if reasons else ''})")
    print(f"core_seconds:        {report['seconds']:.1f}")
    print(f"examples_per_second: {report['examples'] / max(report['seconds'], 1e-9):.1f}")
    if verification:
        print(f"verified_examples:   {verification['examples']} ({verification['sequences']} sequences, "
              f"{verification['twins']} twins, {verification['shadow_rows']} shadow rows, two workers)")
        print(f"verify_max_diff:     {verification['max_abs_loss_diff']:.4f} (mean loss), "
              f"{verification['max_causal_diff']:.3g} (twins and repeats)")
        print(f"decisions_flipped:   {verification['decisions_flipped_within_allowance']} (within "
              f"{DECISION_ALLOWANCE_NATS['choice']:g} nats of a tie on the trusted path, "
              f"{DECISION_ALLOWANCE_NATS['exact_match']:g} for an exact match)")
    print(f"bundle_sha256:       {bundle.sha256 or 'none (a local folder)'}")
    print(f"report:              {report_path}")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--inference-py", required=True, help="the participant's inference.py (defines load_scorer)")
    parser.add_argument("--checkpoint", required=True, help="the trained checkpoint")
    parser.add_argument("--train-py", default=None, help="the train.py that wrote it (default: beside inference.py); "
                                                         "its load_for_eval is the trusted path verification uses")
    parser.add_argument("--bundle-dir", default=None, help="an unpacked eval bundle (unofficial; default: the pinned "
                                                           "archive, downloaded and cached)")
    parser.add_argument("--bundle-url", default=None, help=f"where to download it (default {EVAL_BUNDLE_URL})")
    parser.add_argument("--max-per-task", type=int, default=-1, help="examples per task after the shuffle (-1: all)")
    parser.add_argument("--tasks", default=None, help="comma-separated task labels (default: all of core.yaml)")
    parser.add_argument("--device", default=None, help="neuron, cuda or cpu (default: the fastest present)")
    parser.add_argument("--examples-per-call", type=int, default=EXAMPLES_PER_CALL,
                        help="examples handed to score() at once (1: one example per forward, as nanochat)")
    parser.add_argument("--verify-fraction", type=float, default=VERIFY_FRACTION,
                        help=f"share of each task's examples re-scored through train.py's load_for_eval, at least "
                             f"{VERIFY_MIN_EXAMPLES} per task (0: off, and the run is not official)")
    parser.add_argument("--report", default=None, help="JSON report path (default: core_report.json beside the "
                                                       "checkpoint)")
    parser.add_argument("--timeout", type=float, default=CORE_TIMEOUT_SECONDS,
                        help="seconds for everything: inference.py's load and scoring, and the verification worker's "
                             "load and forwards; past it, no score")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run the workers without their OS sandbox (to tell a sandbox problem from a model "
                             "problem; the result is not official)")
    parser.set_defaults(func=cmd_eval_core)
