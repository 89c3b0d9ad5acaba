"""The command line: `python prepare.py setup | eval-public | eval | eval-core`.

Only this process writes result lines on stdout; participant code runs in worker processes whose
output arrives on stderr, each line marked with the worker's name."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from harness.common import HarnessError, atomic_write_json, get_dist_info, log
from harness.config import (CLIMBMIX_BASE_URL, EVAL_BATCH_SIZE, EVAL_SEQ_LEN, EVAL_TIMEOUT_SECONDS, EVAL_TOKENS,
                            SHIPPED_TOKENIZER_DIR, cache_root, default_out_dir, env_report)
from harness.core.command import add_arguments as add_core_arguments
from harness.data import (DEFAULT_NUM_TRAIN_SHARDS, dataset_name, load_manifest, prepare_climbmix,
                          prepare_offline_source, split_shards)
from harness.download import DOWNLOAD_WORKERS
from harness.metric import evaluate_checkpoint
from harness.submission import copy_submission
from harness.tokenizer import ensure_tokenizer, shipped_tokenizer_pins
from harness.worker.sandbox import make_undumpable
from harness.worker.wire import WorkerTimeout


def say_environment() -> None:
    for line in env_report():
        log(line)


def cmd_setup(args) -> int:
    say_environment()
    source = args.source
    name = dataset_name(source)
    if args.num_train_shards is not None and source != "climbmix":
        raise HarnessError("--num-train-shards applies to --source climbmix only")
    if source.startswith("dir:") and not Path(source[4:]).expanduser().is_dir():
        raise HarnessError(f"--source {source}: no such folder (give a folder of .parquet, .jsonl or .txt files)")
    dataset_dir = Path(args.data_dir).expanduser().resolve() if args.data_dir else cache_root() / name
    dataset_dir.mkdir(parents=True, exist_ok=True)
    for stale in dataset_dir.glob("*.tmp"):  # what an interrupted run left
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    t0 = time.time()
    log(f"[setup] source {source} -> {dataset_dir}")
    if source == "climbmix":
        manifest = prepare_climbmix(dataset_dir, args.num_train_shards or DEFAULT_NUM_TRAIN_SHARDS,
                                    args.base_url or os.environ.get("FRONTIER_CLIMBMIX_BASE_URL") or CLIMBMIX_BASE_URL,
                                    args.workers)
    else:
        manifest = prepare_offline_source(source, dataset_dir)
    if args.tokenizer:
        if args.tokenizer not in shipped_tokenizer_pins():
            raise HarnessError(f"--tokenizer {args.tokenizer}: no such shipped tokenizer "
                               f"(shipped: {sorted(shipped_tokenizer_pins())})")
        manifest["tokenizer"] = {"name": args.tokenizer}
    if not (dataset_dir / "manifest.json").exists() or load_manifest(dataset_dir) != manifest:
        atomic_write_json(dataset_dir / "manifest.json", manifest)
    tokenizer = ensure_tokenizer(build_if_missing=args.build_tokenizer_if_missing, dataset_dir=dataset_dir)
    atomic_write_json(cache_root() / "active.json", {"dataset_dir": str(dataset_dir), "source": source})
    train, val = split_shards("train", dataset_dir), split_shards("public_val", dataset_dir)
    pinned = ("shipped and pinned" if tokenizer.path.parent == SHIPPED_TOKENIZER_DIR else
              "built here, pinned in manifest.json" if tokenizer.path.parent == dataset_dir else
              "named and pinned by the environment")
    log(f"[setup] done in {time.time() - t0:.1f}s")
    log(f"train data:      {dataset_dir} ({len(train)} shards)")
    log(f"public_val data: {val[0]}")
    log(f"tokenizer:       {tokenizer.path} (sha256 {tokenizer.sha256}, {pinned})")
    log(f"manifest:        {dataset_dir / 'manifest.json'}")
    log(f"active dataset:  {cache_root() / 'active.json'}")
    return 0


def official_eval_reasons(seq_len: int, max_tokens: int) -> list[str]:
    """Why an evaluation is not the official one (empty: it is)."""
    reasons = []
    if seq_len != EVAL_SEQ_LEN:
        reasons.append(f"--seq-len {seq_len} is not the official context {EVAL_SEQ_LEN}")
    if max_tokens != EVAL_TOKENS:
        reasons.append(f"--max-tokens {max_tokens} is not the official count {EVAL_TOKENS}")
    return reasons


def unofficial_in_plain_words(reasons: list[str]) -> str:
    """One line a newcomer can read: what official: False means here, and how a run becomes official."""
    text = "the same computation as the official one, under conditions the organisers' scorer does not accept"
    if any("the worker can read" in r for r in reasons):
        text += ("; the scored text (or what it was built from) is readable by any process here, as the stdlib "
                 "demo text is Python's own library: a ClimbMix score (prepare.py setup) can be official")
    return text + ". It compares your runs with each other, not with the leaderboard."


def cmd_eval(args) -> int:
    ddp, rank, local_rank, world_size = get_dist_info()
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("gloo")  # the harness processes share out the rows and add the sums
    try:
        return run_eval(args, rank, local_rank)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def run_eval(args, rank: int, local_rank: int) -> int:
    if rank == 0:
        say_environment()
    device = args.device or "auto"  # resolved in the worker: this process never touches an accelerator
    checkpoint = Path(args.checkpoint or Path(default_out_dir()) / "final.pt")
    train_py = Path(args.train_py)
    tokenizer = ensure_tokenizer()
    shard = getattr(args, "val_shard", None)
    if shard is not None and not Path(shard).is_file():
        raise HarnessError(f"--val-shard {shard}: no such file")
    if args.seq_len < 2 or args.batch_size < 1:
        raise HarnessError(f"--seq-len must be >= 2 and --batch-size >= 1, got {args.seq_len} and {args.batch_size}")
    if not args.timeout > 0:
        raise HarnessError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    with copy_submission(train_py, checkpoint) as submission:
        try:
            result = evaluate_checkpoint(submission, tokenizer, args.batch_size, args.seq_len, device,
                                         max_tokens=args.max_tokens, timeout_seconds=args.timeout, shard_path=shard,
                                         shard_sha256=getattr(args, "val_shard_sha256", None), local_rank=local_rank,
                                         label=f"worker{'' if rank == 0 else f':{rank}'}",
                                         use_sandbox=not args.no_sandbox)
        except WorkerTimeout:
            raise HarnessError(f"the evaluation did not finish within {args.timeout:g}s (--timeout); no score. The "
                               "worker and everything it started were stopped.") from None
    if rank != 0:
        return 0
    reasons = official_eval_reasons(args.seq_len, args.max_tokens) + result["not_official_because"]
    result.update(official=not reasons, not_official_because=reasons, checkpoint=str(checkpoint),
                  checkpoint_sha256=submission.sha256["checkpoint"], train_py=str(train_py),
                  train_py_sha256=submission.sha256["train_py"], kernels_sha256=submission.sha256.get("kernels"),
                  tokenizer_sha256=tokenizer.sha256)
    print("---")
    print(f"val_bpb:                 {result['val_bpb']:.6f}")
    print(f"official:                {not reasons}{'  (' + '; '.join(reasons) + ')' if reasons else ''}")
    if reasons:
        print(f"official_means:          {unofficial_in_plain_words(reasons)}")
    print(f"eval_tokens:             {result['tokens']}")
    print(f"eval_bytes:              {result['total_bytes']}")
    print(f"eval_rows:               {result['rows']}")
    print(f"eval_seq_len:            {result['seq_len']}")
    print(f"eval_seconds:            {result['eval_seconds']:.1f}")
    print(f"eval_timeout:            {result['eval_timeout']:g}")
    print(f"eval_over_timeout:       {result['eval_over_timeout']}")
    print(f"causality_passed:        {result['causality_passed']}")
    print(f"causality_max_abs_diff:  {result['causality_max_abs_diff']:.3g}")
    print(f"batch_size_max_abs_diff: {result['batch_size_max_abs_diff']:.3g}")
    print(f"probes:                  {result['probes']} ({result['twins']} twins at {result['cut_positions']} cut "
          "positions)")
    print(f"probe_coverage:          {result['probe_coverage']}")
    print(f"world_size:              {result['world_size']}")
    print(f"shard:                   {result['shards'][0]}")
    print(f"shard_sha256:            {result['shard_sha256'][0]}")
    print(f"device:                  {result['device']}")
    print(f"sandbox:                 {' + '.join(result['sandbox']) or 'none'} (applied in "
          f"{1000 * result['sandbox_seconds']:.0f} ms; worker started in {result['worker_start_seconds']:.1f}s)")
    loads = " and ".join(f"{w['load_seconds']:.1f}s" for w in result["workers"])
    passes = " and ".join(f"{t:.1f}s" for t in result["pass_seconds"])
    dropped = [w["caches_dropped_seconds"] for w in result["workers"][1:] if w["caches_dropped_seconds"] is not None]
    caches = f"; the kernel's caches dropped before the second in {dropped[0]:.1f}s" if dropped else ""
    print(f"workers:                 {len(result['workers'])} (loaded in {loads}; passes {passes}{caches})")
    print(f"checkpoint_sha256:       {result['checkpoint_sha256']}")
    print(f"train_py_sha256:         {result['train_py_sha256']}")
    if result["kernels_sha256"]:
        print(f"kernels_sha256:          {result['kernels_sha256']}")
    print(f"tokenizer_sha256:        {tokenizer.sha256}")
    # beside the checkpoint by default, named by its hash: another checkpoint's report is never overwritten
    report = Path(args.report or checkpoint.parent / f"{args.command}-{result['checkpoint_sha256'][:12]}.json")
    try:
        atomic_write_json(report, result)
        print(f"report:                  {report}")
    except OSError as e:
        print(f"report:                  not written ({report}: {e.strerror})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prepare.py", description="The trusted harness of the trainium-frontier "
                                                                    "kit: data, tokenizer, the official metrics.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("setup", help="download or build the data shards and install the tokenizer",
                       description="Prepare a dataset (shards + tokenizer) and make it the active one.")
    p.add_argument("--source", default="climbmix",
                   help="climbmix (default: public shards, needs the network), stdlib (offline: Python's standard "
                        "library) or dir:PATH (a folder of .parquet/.jsonl/.txt files)")
    p.add_argument("--num-train-shards", type=int, default=None,
                   help=f"ClimbMix training shards to fetch (default {DEFAULT_NUM_TRAIN_SHARDS}); the validation "
                        "shard 6542 is always fetched")
    p.add_argument("--data-dir", default=None, help="where the shards go (default: <cache>/<source>; the cache is "
                                                    "$FRONTIER_CACHE_DIR or $NEURON_COMPETITION_R1_CACHE_DIR, else "
                                                    "~/.cache/trainium-frontier)")
    p.add_argument("--base-url", default=None, help="ClimbMix mirror (default: $FRONTIER_CLIMBMIX_BASE_URL or "
                                                    "the Hugging Face address)")
    p.add_argument("--workers", type=int, default=DOWNLOAD_WORKERS, help="parallel downloads")
    p.add_argument("--tokenizer", default=None, help="use this shipped tokenizer (by name) instead of the source's own")
    p.add_argument("--build-tokenizer-if-missing", action="store_true",
                   help="train the BPE tokenizer from the training shards when none is shipped or built yet")
    p.set_defaults(func=cmd_setup)

    for name, help_text in (("eval-public", "score a checkpoint on the public validation shard"),
                            ("eval", "score a checkpoint on any shard (the organisers run it on the private one)")):
        p = sub.add_parser(name, help=help_text, description=help_text + " with the official evaluate_bpb; the "
                           "model runs in a separate worker process.")
        if name == "eval":
            p.add_argument("--val-shard", required=True, help="parquet shard with a 'text' column")
        p.add_argument("--train-py", default="train.py", help="the participant's train.py (defines load_for_eval; "
                                                              "default: train.py)")
        p.add_argument("--checkpoint", default=None, help="checkpoint written by that train.py (default: "
                                                          "<out dir>/final.pt, the out dir from $FRONTIER_OUT_DIR or "
                                                          "$NEURON_COMPETITION_R1_OUT_DIR, else out)")
        p.add_argument("--device", default=None, help="neuron, cuda or cpu (default: the fastest present)")
        p.add_argument("--batch-size", type=int, default=EVAL_BATCH_SIZE, help="rows per forward (the number does "
                                                                               "not depend on it)")
        p.add_argument("--seq-len", type=int, default=EVAL_SEQ_LEN, help=f"evaluation context (official: "
                                                                         f"{EVAL_SEQ_LEN}; any other is reported as "
                                                                         "unofficial)")
        p.add_argument("--max-tokens", type=int, default=EVAL_TOKENS, help="tokens to score (the official count "
                                                                           "is the default)")
        p.add_argument("--report", default=None, help="write the result as JSON here (default: beside the "
                                                      "checkpoint, <command>-<its sha256>.json)")
        p.add_argument("--timeout", type=float, default=EVAL_TIMEOUT_SECONDS,
                       help=f"seconds for everything: the worker's start, the model's load, the forwards and the "
                            f"checks (default EVAL_TIMEOUT_SECONDS = {EVAL_TIMEOUT_SECONDS}); past it, no score")
        p.add_argument("--no-sandbox", action="store_true",
                       help="run the worker without its OS sandbox (to tell a sandbox problem from a model problem; "
                            "the result is not official)")
        if name == "eval":
            p.add_argument("--val-shard-sha256", default=None,
                           help="the shard's expected SHA-256: a shard that differs is refused")
        p.set_defaults(func=cmd_eval)

    p = sub.add_parser("eval-core", help="score a checkpoint on CORE through the participant's inference.py",
                       description="CORE (Phase 2): the 22 in-context-learning tasks of the eval bundle, scored "
                                   "through inference.py, as nanochat computes it, and verified on a secret sample "
                                   "through train.py's load_for_eval.")
    add_core_arguments(p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):  # argparse would ask for a command
        parser.error(f"unrecognized argument {argv[0]}: the command comes first (setup, eval-public, eval, "
                     "eval-core), e.g. `python prepare.py setup --help`")
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # torchrun stops a rank with SIGTERM: clean up
        signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    if args.command != "setup":
        make_undumpable()  # the scorer's memory and /proc files are closed to every other process of this user
    try:
        return args.func(args)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
