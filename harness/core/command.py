"""`prepare.py eval-core`, CORE's command line: its arguments, the workers it starts (inference.py's
scorer, then two train.py model workers for the verification), the verdicts the ranks agree on,
and the report it writes."""
from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

from harness.common import CoreError, EvalRefused, atomic_write_json, get_dist_info
from harness.config import keep_kernel_caches
from harness.core.bundle import EVAL_BUNDLE_URL, Bundle, Task, ensure_bundle, load_examples, load_tasks
from harness.core.prompts import shuffled_and_capped
from harness.core.scoring import (EXAMPLES_PER_CALL, FORGER_GAIN_BOUND, VERIFY_FRACTION, VERIFY_MIN_EXAMPLES,
                                  count_trusted_decisions, evaluate_core)
from harness.core.verify import (BIAS_ALPHA, BIAS_COUNTS, VERIFY_BATCH_ROWS, VERIFY_LENGTH_BUCKET, coverage,
                                 refuse_bias, sign_test_p, verify_samples)
from harness.submission import copy_submission
from harness.tokenizer import ensure_tokenizer
from harness.worker.harness_side import ModelForward, Worker, drop_kernel_caches, score_sequences
from harness.worker.wire import WorkerTimeout

CORE_TIMEOUT_SECONDS = 3600  # the organisers' limit for CORE; here it covers the workers' loads and the verification too


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
    keep_kernel_caches()  # a FRONTIER_KEEP_KERNEL_CACHES that is neither yes nor no fails now, not between the passes
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
                    dropped, reasons = drop_kernel_caches() if k > 0 and not args.no_sandbox else (None, [])
                    t_worker, label = time.time(), f"train.py{'' if k == 0 else '.2'}"
                    with Worker("model", submission, device, deadline=deadline, label=label, local_rank=local_rank,
                                tokenizer=tokenizer, protected=protected, use_sandbox=not args.no_sandbox) as w:
                        workers.append({"label": label, "start_seconds": w.start_seconds,
                                        "load_seconds": time.time() - t_worker, "caches_dropped_seconds": dropped})
                        not_official.extend(reasons + w.not_official_because)
                        forward = ModelForward(w, VERIFY_BATCH_ROWS, max_len, tokenizer.get_vocab_size())
                        try:
                            yield forward
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
        for key in ("max_abs_loss_diff", "max_token_loss_diff", "max_greedy_gap", "max_causal_diff",
                    "max_flipped_margin"):
            verification[key] = max(v[key] for v in everyone)
        verification["bias"] = {kind: [sum(v["bias"][kind][i] for v in everyone) for i in range(2)]
                                for kind in BIAS_COUNTS}
        by_task: dict[str, list[int]] = {}
        for v in everyone:
            for label, counts in v["bias"].get("decisions_by_task", {}).items():
                by_task[label] = [a + b for a, b in zip(by_task.get(label, [0, 0]), counts)]
        if by_task:
            verification["bias"]["decisions_by_task"] = by_task
        verification["decided"] = {label: [sum(v["decided"].get(label, [0, 0, 0])[i] for v in everyone)
                                           for i in range(3)] for label in report["tasks"]}
    drawn = [{label: t["verified"] for label, t in report["tasks"].items()}]  # each rank's draws
    if world_size > 1 and verification is not None:
        import torch.distributed as dist
        drawn = [None] * world_size
        dist.all_gather_object(drawn, {label: t["verified"] for label, t in report["tasks"].items()})
        for label, t in report["tasks"].items():
            t["verified"] = {key: sum(d[label][key] for d in drawn) if key != "worth" else value
                             for key, value in t["verified"].items()}
    if verification is not None:
        verification["coverage"] = coverage(report["tasks"], drawn)
        refuse_bias(verification["bias"])  # every rank holds the same counts, so every rank gives the same verdict
        report["core_claimed"] = report["core"]  # what inference.py's own decisions would have scored
        count_trusted_decisions(report, verification["decided"])
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
        allowance = verification["tolerances"]["decision"]
        print(f"decisions_flipped:   {verification['decisions_flipped_within_allowance']} (within "
              f"{allowance['choice']:g} nats of a tie on the trusted path, {allowance['exact_match']:g} for an exact "
              "match)")
        c, decided = verification["coverage"], verification["decided"]
        changed = sum(trusted - claimed for _, trusted, claimed in decided.values())
        print(f"trusted_decisions:   {sum(v[0] for v in decided.values())} verified examples decided by the trusted "
              f"path ({c['near_ties_claimed']} claimed near-ties, every one, and a uniform sample of {c['uniform']}); "
              f"{changed:+d} correct against inference.py's own decisions (CORE {report['core_claimed']:.4f} as "
              "claimed)")
        print(f"verify_coverage:     at a {c['risk']:.0%} chance of refusal a forger gains at most CORE "
              f"+{c['bound']:.4f} (flipped decisions outside the near-ties, each refused where the uniform sample "
              f"meets it; largest on {c['task']}; the uniform sample is sized for +{FORGER_GAIN_BOUND:g})")
        bias = verification["bias"]
        leans = "; ".join(f"{kind} {bias[kind][0]} towards, {bias[kind][1]} away (p {sign_test_p(*bias[kind]):.2g})"
                          for kind in BIAS_COUNTS)
        print(f"verify_lean:         {leans} (gold answers; refused below p {BIAS_ALPHA:g})")
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
