"""
CORE, the trusted side: the eval bundle, prompts, tokenization, scored regions, decisions and
scores, exactly as nanochat computes the DCLM CORE metric. Driven from the command line:

    python prepare.py eval-core --inference-py inference.py --checkpoint out/final.pt
    torchrun --standalone --nproc_per_node=8 prepare.py eval-core ...   # examples strided over 8 ranks

The participant's inference.py only turns token sequences into per-position losses and greedy
predictions (see load_scorer below); everything that depends on the task happens here.

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

import csv
import json
import os
import random
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from prepare import (HarnessError, atomic_write_json, cache_root, call_participant_loader, detect_device_type,
                     download_file, ensure_tokenizer, get_dist_info, load_participant_model, sha256_file)

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
# The organisers publish the bundle's SHA-256 when they pin it; set it here or in
# $FRONTIER_EVAL_BUNDLE_SHA256 and every download is checked against it.
EVAL_BUNDLE_SHA256 = ""
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
REQUIRED_FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
                   "language_modeling": ("context", "continuation")}
SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234
EXAMPLES_PER_CALL = 256  # examples whose sequences go to the scorer in one call (it batches them)
VERIFY_TOLERANCE = 0.1  # nats: inference.py's losses vs the trusted model's, per position


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
# The bundle
# ---------------------------------------------------------------------------------------------

def bundle_root(path: Path) -> Path:
    """The folder holding core.yaml: `path` itself or its eval_bundle/ subfolder."""
    for candidate in (path, path / "eval_bundle"):
        if (candidate / "core.yaml").is_file():
            return candidate
    raise CoreError(f"no CORE bundle at {path} (core.yaml not found). Omit --bundle-dir to download it, or unzip "
                    "eval_bundle.zip there.")


def _check_zip(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise CoreError(f"{path.name} is not a zip archive")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    if not any(n.rstrip("/").endswith("core.yaml") for n in names):
        raise CoreError(f"{path.name} holds no core.yaml")


def ensure_bundle(bundle_dir=None, url: str | None = None, sha256: str | None = None) -> Path:
    """The unpacked bundle: --bundle-dir as given, or downloaded (robustly, SHA-256 checked when
    pinned) and unpacked atomically into the cache."""
    if bundle_dir is not None:
        return bundle_root(Path(bundle_dir).expanduser())
    final = cache_root() / "eval_bundle"
    if (final / "core.yaml").is_file():
        return final
    url = url or os.environ.get("FRONTIER_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL
    pin = sha256 if sha256 is not None else (os.environ.get("FRONTIER_EVAL_BUNDLE_SHA256") or EVAL_BUNDLE_SHA256)
    archive = cache_root() / "eval_bundle.zip"
    if archive.exists():
        try:
            _check_zip(archive)
        except CoreError:
            archive.unlink()
    if not archive.exists():
        print(f"[core] downloading the eval bundle from {url}", flush=True)
        download_file(url, archive, validate=_check_zip)
    actual = sha256_file(archive)
    if pin and actual != pin:
        raise CoreError(f"{archive} has sha256 {actual}, but the pinned bundle is {pin}. Delete it and rerun to "
                        "download it again; if it persists, the published bundle changed.")
    staging = cache_root() / f"eval_bundle.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(archive) as z:
        z.extractall(staging)
    root = bundle_root(staging)
    os.replace(root, final)
    shutil.rmtree(staging, ignore_errors=True)
    print(f"[core] bundle unpacked to {final} (sha256 {actual}{', pinned' if pin else ', no pin configured'})",
          flush=True)
    return final


def load_tasks(root: Path) -> list[Task]:
    """The tasks of core.yaml with their random baselines from eval_meta_data.csv."""
    import yaml
    try:
        config = yaml.safe_load((root / "core.yaml").read_text())
        entries = config["icl_tasks"]
    except Exception as e:
        raise CoreError(f"{root / 'core.yaml'} is not a CORE task list ({type(e).__name__}: {e})")
    baselines = {}
    try:
        with open(root / "eval_meta_data.csv", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                baselines[row["Eval Task"]] = float(row["Random baseline"])
    except (OSError, KeyError, ValueError) as e:
        raise CoreError(f"{root / 'eval_meta_data.csv'}: cannot read the random baselines ({type(e).__name__}: {e})")
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


def load_examples(root: Path, task: Task) -> list[dict]:
    path = root / "eval_data" / task.dataset_uri
    if not path.is_file():
        raise CoreError(f"task {task.label!r}: data file {path} is missing")
    examples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise CoreError(f"{path}:{n}: not valid JSON ({e})")
            missing = [k for k in REQUIRED_FIELDS[task.task_type] if not isinstance(item, dict) or k not in item]
            if missing:
                raise CoreError(f"{path}:{n}: a {task.task_type} example needs {list(REQUIRED_FIELDS[task.task_type])}; "
                                f"missing {missing}")
            examples.append(item)
    return examples


def shuffled_and_capped(examples: list, max_per_task: int) -> list:
    data = list(examples)
    random.Random(SHUFFLE_SEED).shuffle(data)
    return data[:max_per_task] if max_per_task > 0 else data


def fewshot_indices(idx: int, n: int, k: int) -> list[int]:
    if k <= 0:
        return []
    return random.Random(FEWSHOT_SEED + idx).sample([i for i in range(n) if i != idx], k)


# ---------------------------------------------------------------------------------------------
# Prompts and scored regions
# ---------------------------------------------------------------------------------------------

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


def is_correct(task_type: str, request: Request, scored: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """scored[i] = (losses, greedy) of sequence i: losses[t] = -log p(seq[t+1] | seq[:t+1]),
    greedy[t] = the argmax prediction for seq[t+1]."""
    if task_type == "language_modeling":
        (_, greedy), seq = scored[0], request.sequences[0]
        s, e = request.starts[0], request.ends[0]
        return bool(torch.equal(greedy[s - 1:e - 1], torch.tensor(seq[s:e], dtype=greedy.dtype)))
    mean_losses = [losses[s - 1:e - 1].float().mean().item()
                   for (losses, _), s, e in zip(scored, request.starts, request.ends)]
    return mean_losses.index(min(mean_losses)) == request.gold


def centered_accuracy(accuracy: float, random_baseline_percent: float) -> float:
    rb = 0.01 * random_baseline_percent
    return (accuracy - rb) / (1.0 - rb)


# ---------------------------------------------------------------------------------------------
# The participant's scorer
# ---------------------------------------------------------------------------------------------
# inference.py defines load_scorer(checkpoint_path, device) -> scorer, where the scorer has
#   max_seq_len: int | None           longest sequence it takes (longer ones are cut from the left)
#   score(sequences) -> list of (losses, greedy), one per sequence of n tokens:
#       losses  float [n - 1]: -log p(seq[t + 1] | seq[:t + 1])
#       greedy  int   [n - 1]: argmax over the vocabulary for position t + 1

def load_scorer(inference_py, checkpoint, device):
    scorer = call_participant_loader(inference_py, "participant_inference", "load_scorer", checkpoint, device,
                                     "the CORE scorer calls it (see the README, 'Phase 2: CORE')")
    if not callable(getattr(scorer, "score", None)):
        raise CoreError(f"load_scorer returned {type(scorer).__name__}, which has no score(sequences) method")
    return scorer


def checked_scores(scorer, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = scorer.score(sequences)
    if len(out) != len(sequences):
        raise CoreError(f"score() returned {len(out)} results for {len(sequences)} sequences")
    result = []
    for seq, (losses, greedy) in zip(sequences, out):
        losses, greedy = torch.as_tensor(losses).cpu(), torch.as_tensor(greedy).cpu()
        if losses.shape != (len(seq) - 1,) or greedy.shape != (len(seq) - 1,):
            raise CoreError(f"score() must return {len(seq) - 1} losses and predictions for a sequence of {len(seq)} "
                            f"tokens, got shapes {tuple(losses.shape)} and {tuple(greedy.shape)}")
        if not torch.isfinite(losses).all():
            raise CoreError("score() returned non-finite losses")
        result.append((losses, greedy.long()))
    return result


@torch.no_grad()
def trusted_losses(model, seq: list[int], device) -> torch.Tensor:
    """The losses of one sequence from the model of train.py's load_for_eval, computed here."""
    x = torch.tensor([seq], device=device)
    logits = model(x)[0, :-1, :].float()
    return F.cross_entropy(logits, x[0, 1:], reduction="none").cpu()


# ---------------------------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------------------------

def evaluate_core(scorer, tokenizer, root: Path, tasks: list[Task], max_per_task: int = -1,
                  examples_per_call: int = EXAMPLES_PER_CALL, log=print, rank: int = 0, world_size: int = 1) -> dict:
    """Accuracy, centered accuracy and time per task, and CORE. Under torchrun each rank scores
    every world_size-th example (as nanochat strides them) and the counts are summed."""
    max_len = getattr(scorer, "max_seq_len", None)
    results, total_t0 = {}, time.time()
    for task in tasks:
        t0 = time.time()
        data = shuffled_and_capped(load_examples(root, task), max_per_task)
        if len(data) <= task.num_fewshot:
            raise CoreError(f"task {task.label!r} has {len(data)} examples, too few for {task.num_fewshot} shots")
        mine = list(range(rank, len(data), world_size))
        correct = 0
        for lo in range(0, len(mine), examples_per_call):
            requests = [build_request(task, data, i, tokenizer, max_len) for i in mine[lo:lo + examples_per_call]]
            scored = checked_scores(scorer, [s for r in requests for s in r.sequences])
            k = 0
            for r in requests:
                correct += is_correct(task.task_type, r, scored[k:k + len(r.sequences)])
                k += len(r.sequences)
        if world_size > 1:
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
    return {"core": core, "tasks": results, "seconds": time.time() - total_t0,
            "examples": sum(r["examples"] for r in results.values()), "world_size": world_size}


def verify_against_train_py(scorer, train_py, checkpoint, device, tokenizer, root: Path, tasks: list[Task],
                            count: int) -> dict:
    """Spot-check the scorer against train.py's load_for_eval on `count` real prompts: the losses
    must agree (inference.py must score the model that was trained)."""
    model = load_participant_model(train_py, checkpoint, device)
    max_len = getattr(scorer, "max_seq_len", None)
    data = {t.label: shuffled_and_capped(load_examples(root, t), -1) for t in tasks[:count]}
    worst = 0.0
    for j in range(count):
        task = tasks[j % len(tasks)]
        examples = data[task.label]
        seq = build_request(task, examples, (7 * j) % len(examples), tokenizer, max_len).sequences[0]
        theirs = checked_scores(scorer, [seq])[0][0]
        ours = trusted_losses(model, seq, device)
        worst = max(worst, (theirs - ours).abs().max().item())
    if worst > VERIFY_TOLERANCE:
        raise CoreError(f"inference.py's losses differ from {train_py}'s load_for_eval by up to {worst:.3f} nats "
                        f"(tolerance {VERIFY_TOLERANCE}): the inference path must score the trained model")
    return {"sequences": count, "max_abs_loss_diff": worst, "tolerance": VERIFY_TOLERANCE}


def scoring_device(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device(device_type)


def cmd_eval_core(args) -> int:
    ddp, rank, local_rank, world_size = get_dist_info()
    if ddp:
        dist.init_process_group("gloo")  # only the per-task counts travel between ranks
    try:
        return run_eval_core(args, rank, local_rank, world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_eval_core(args, rank: int, local_rank: int, world_size: int) -> int:
    device = scoring_device(args.device or detect_device_type(), local_rank)
    inference_py = Path(args.inference_py)
    train_py = Path(args.train_py) if args.train_py else inference_py.resolve().parent / "train.py"
    root = ensure_bundle(args.bundle_dir, args.bundle_url) if rank == 0 else None
    if world_size > 1:
        dist.barrier()  # rank 0 downloads and unpacks; the others then find it in the cache
    root = root or ensure_bundle(args.bundle_dir, args.bundle_url)
    tasks = load_tasks(root)
    if args.tasks:
        wanted = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = sorted(set(wanted) - {t.label for t in tasks})
        if unknown:
            raise CoreError(f"--tasks: unknown {unknown}; the bundle has {[t.label for t in tasks]}")
        tasks = [t for t in tasks if t.label in wanted]
    tokenizer = ensure_tokenizer()
    scorer = load_scorer(inference_py, args.checkpoint, device)
    verification = None
    if args.verify > 0:
        verification = verify_against_train_py(scorer, train_py, args.checkpoint, device, tokenizer, root, tasks,
                                               args.verify)
    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    say(f"[core] {len(tasks)} tasks, max {args.max_per_task if args.max_per_task > 0 else 'all'} examples each, "
        f"device {device} x {world_size}")
    report = evaluate_core(scorer, tokenizer, root, tasks, args.max_per_task, args.examples_per_call, log=say,
                           rank=rank, world_size=world_size)
    if rank != 0:
        return 0
    official = len(tasks) == len(load_tasks(root)) and args.max_per_task <= 0
    report.update({"official": official, "baselines": "bundle eval_meta_data.csv (CORE v1)",
                   "max_per_task": args.max_per_task, "device": str(device), "bundle": str(root),
                   "checkpoint": str(args.checkpoint), "checkpoint_sha256": sha256_file(Path(args.checkpoint)),
                   "train_py": str(train_py), "train_py_sha256": sha256_file(train_py) if train_py.is_file() else None,
                   "inference_py_sha256": sha256_file(inference_py), "tokenizer_sha256": tokenizer.sha256,
                   "verify": verification})
    report_path = Path(args.report) if args.report else Path(args.checkpoint).resolve().parent / "core_report.json"
    atomic_write_json(report_path, report)
    print("---")
    print(f"core:                {report['core']:.4f}")
    print(f"official:            {official}  ({len(tasks)} tasks, {report['examples']} examples)")
    print(f"core_seconds:        {report['seconds']:.1f}")
    print(f"examples_per_second: {report['examples'] / max(report['seconds'], 1e-9):.1f}")
    if verification:
        print(f"verify_max_diff:     {verification['max_abs_loss_diff']:.4f}")
    print(f"report:              {report_path}")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--inference-py", required=True, help="the participant's inference.py (defines load_scorer)")
    parser.add_argument("--checkpoint", required=True, help="the trained checkpoint")
    parser.add_argument("--train-py", default=None, help="the train.py that wrote it (default: beside inference.py); "
                                                         "used to verify inference.py scores that model")
    parser.add_argument("--bundle-dir", default=None, help="an unpacked eval bundle (default: download and cache it)")
    parser.add_argument("--bundle-url", default=None, help=f"where to download it (default {EVAL_BUNDLE_URL})")
    parser.add_argument("--max-per-task", type=int, default=-1, help="examples per task after the shuffle (-1: all)")
    parser.add_argument("--tasks", default=None, help="comma-separated task labels (default: all of core.yaml)")
    parser.add_argument("--device", default=None, help="neuron, cuda or cpu (default: the fastest present)")
    parser.add_argument("--examples-per-call", type=int, default=EXAMPLES_PER_CALL,
                        help="examples handed to score() at once (1: one example per forward, as nanochat)")
    parser.add_argument("--verify", type=int, default=8, help="prompts re-scored with train.py's load_for_eval (0: off)")
    parser.add_argument("--report", default=None, help="JSON report path (default: core_report.json beside the "
                                                       "checkpoint)")
    parser.set_defaults(func=cmd_eval_core)


if __name__ == "__main__":
    sys.exit("run it as: python prepare.py eval-core --inference-py inference.py --checkpoint out/final.pt")
