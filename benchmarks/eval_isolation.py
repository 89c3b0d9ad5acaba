"""What containment costs: the official evaluation (train.py's model in a sandboxed worker process,
logits through sealed shared memory) against the same worker without its sandbox, against the
sandbox without its noatime mount namespace (the harness reading ahead what a read would move
instead, as where it lacks CAP_SYS_ADMIN), against the contained run that keeps the kernel's caches
between its workers (FRONTIER_KEEP_KERNEL_CACHES=1: no drop, a warm second start), against the
contained run with its caps measured from user space by the watchdog instead of enforced by the
kernel (no cgroup, no tmpfs: as where the harness may not create them) and against
evaluate_bpb on the same model in this process: same rows, same checks, measured in the same run,
in rotating order, so a shared machine's noise hits all of them.

    python benchmarks/eval_isolation.py [--checkpoint out/final.pt] [--max-tokens 262144] [--rounds 2]
                                        [--modes in_process,worker,contained,read_ahead,kept_caches,
                                                 user_space_caps]
    python benchmarks/eval_isolation.py --readable   # what a worker may read, and reading it ahead twice

Without a checkpoint, a freshly initialised CPU-preset model is saved and used (speed does not
depend on the weights). All paths use the active dataset's public_val and the official context.
Printed: the time of each, rows to result (best of the rounds; in process: the model's load excluded,
contained: both workers' start and load included), the worker's start (interpreter and imports),
the sandbox's set-up on its own (with reading ahead: on the first round, when the atimes of a day
have not been read yet, and after), the copy of the submission, and what the second worker costs."""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import prepare  # noqa: E402
import train as T  # noqa: E402
from harness.metric import evaluate_checkpoint  # noqa: E402
from harness.submission import copy_submission  # noqa: E402
from harness.worker import harness_side  # noqa: E402
from random_model import save_random_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("in_process", "worker", "contained", "read_ahead", "kept_caches", "user_space_caps")
REAL_CREATE = harness_side.kernel_caps.create


def no_kernel_caps(*args, **kwargs):
    raise OSError(0, "not created (benchmarking the watchdog alone)", "")


def kernel_caps_seconds(rounds: int = 20) -> float:
    """One worker's kernel caps created and removed (a cgroup, its limits, a tmpfs), best of rounds."""
    import tempfile
    best = float("inf")
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            t0 = time.perf_counter()
            caps = REAL_CREATE(Path(folder), 1 << 30, 1 << 30, 1000, 100, f"frontier-worker-{os.getpid()}-bench")
            caps.remove()
            best = min(best, time.perf_counter() - t0)
    return best


def readable():
    """Count the files, folders and links under a worker's readable roots, then read ahead twice
    (access_times.settle): the first time reads what a read would move, the second finds nothing."""
    from harness.worker import access_times, sandbox
    roots = access_times.readable_roots(sandbox.worker_rules(Path("/nonexistent"), Path("/nonexistent")))
    counts = {"files": 0, "folders": 0, "links": 0}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            counts["folders"] += 1
            links = {name for name in dirs + files if os.path.islink(os.path.join(folder, name))}
            counts["links"] += len(links)
            counts["files"] += len(set(files) - links)  # folders are counted when the walk enters them
    print(f"readable_roots:          {len(roots)}")
    print(f"readable_entries:        {sum(counts.values())}  ({counts})")
    for k in range(2):
        done = access_times.settle(roots, prepare.EVAL_TIMEOUT_SECONDS)
        print(f"read_ahead_{k}:            {done.seconds:.2f}s: {done.entries} entries looked at, {done.files_read} files "
              f"read, {done.folders_listed} folders listed, {done.links_read} links read")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--max-tokens", type=int, default=2**18)
    parser.add_argument("--batch-size", type=int, default=prepare.EVAL_BATCH_SIZE)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", default=",".join(MODES), help="which of " + ", ".join(MODES))
    parser.add_argument("--readable", action="store_true", help="count what a worker may read; read it ahead twice")
    args = parser.parse_args()
    if args.readable:
        return readable()
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    checkpoint = args.checkpoint or save_random_checkpoint("cpu")
    tokenizer = prepare.ensure_tokenizer()
    seq = prepare.EVAL_SEQ_LEN
    times = {k: [] for k in (*MODES, "total", "start", "sandbox", "copy", "second_load", "second_pass",
                             "read_ahead_first", "read_ahead_later", "drop", "second_load_kept")}
    numbers = {}
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            t0 = time.time()
            if mode == "in_process":
                model = T.load_for_eval(checkpoint, torch.device(args.device))
                result = prepare.evaluate_bpb(model, tokenizer, args.batch_size, seq, args.device,
                                              max_tokens=args.max_tokens)
            else:
                harness_side.ATIME_DEFENCES = ("read ahead",) if mode == "read_ahead" else ("noatime", "read ahead")
                os.environ["FRONTIER_KEEP_KERNEL_CACHES"] = "1" if mode == "kept_caches" else "0"
                harness_side.kernel_caps.create = no_kernel_caps if mode == "user_space_caps" else REAL_CREATE
                with copy_submission(REPO / "train.py", checkpoint) as submission:
                    copied = time.time() - t0
                    result = evaluate_checkpoint(submission, tokenizer, args.batch_size, seq, args.device,
                                                 max_tokens=args.max_tokens, use_sandbox=mode != "worker")
                if mode == "read_ahead":
                    seconds = [w["sandbox_seconds"] for w in result["workers"]]
                    times["read_ahead_first" if not times["read_ahead_first"] else "read_ahead_later"].append(seconds[0])
                    times["read_ahead_later"] += seconds[1:]
                if mode == "contained":
                    times["total"].append(time.time() - t0)
                    times["start"].append(result["worker_start_seconds"])
                    times["sandbox"].append(result["sandbox_seconds"])
                    times["copy"].append(copied)
                    times["second_load"].append(result["workers"][1]["load_seconds"])
                    times["second_pass"].append(result["pass_seconds"][1])
                    if result["workers"][1]["caches_dropped_seconds"] is not None:
                        times["drop"].append(result["workers"][1]["caches_dropped_seconds"])
                if mode == "kept_caches":
                    times["second_load_kept"].append(result["workers"][1]["load_seconds"])
            times[mode].append(result["eval_seconds"])
            numbers[mode] = result["val_bpb"]
            print(f"round {r} {mode:<10}: eval {result['eval_seconds']:6.1f}s, wall {time.time() - t0:6.1f}s, "
                  f"val_bpb {result['val_bpb']:.6f}, {result['tokens']} tokens, {result['probes']} probes", flush=True)
    best = {k: min(v) for k, v in times.items() if v}
    lines = [("in_process_seconds", "in_process", "{:.1f}", f"(best of {args.rounds})"),
             ("worker_seconds", "worker", "{:.1f}", "(two workers without their sandbox; their start and load included)"),
             ("contained_seconds", "contained", "{:.1f}", "(the official path: two sandboxed workers, start and load "
                                                         "included)"),
             ("read_ahead_seconds", "read_ahead", "{:.1f}", "(the same without the noatime namespace: the harness "
                                                           "reads ahead)"),
             ("kept_caches_seconds", "kept_caches", "{:.1f}", "(the same keeping the kernel's caches between the "
                                                             "workers: not official)"),
             ("user_space_caps_seconds", "user_space_caps", "{:.1f}", "(the same with the caps measured by the "
                                                                     "watchdog, not enforced by the kernel: not "
                                                                     "official)"),
             ("drop_caches_seconds", "drop", "{:.2f}", "(dropping the page cache, dentries and inodes before the "
                                                      "second worker)"),
             ("contained_total_seconds", "total", "{:.1f}", "(copy, worker start, sandbox and model load included)"),
             ("worker_start_seconds", "start", "{:.2f}", "(interpreter, numpy and torch imports)"),
             ("sandbox_setup_seconds", "sandbox", "{:.4f}", "(the rules, the noatime namespace, applying them)"),
             ("read_ahead_first_seconds", "read_ahead_first", "{:.2f}", "(sandbox set-up with reading ahead, first "
                                                                       "worker of the first round)"),
             ("read_ahead_later_seconds", "read_ahead_later", "{:.2f}", "(the same for every later worker: stat() only)"),
             ("copy_seconds", "copy", "{:.2f}", "(train.py, kernels/ and the checkpoint, hashed)")]
    print("---")
    print(f"checkpoint:              {checkpoint}")
    print(f"tokens:                  {args.max_tokens}")
    print(f"same_number:             {len(set(numbers.values())) == 1}")
    for name, key, form, note in lines:
        if key in best:
            print(f"{name + ':':<25}{form.format(best[key])}  {note}")
    if "second_load" in best:
        print(f"second_worker_seconds:   {best['second_load']:.2f} to start and load, {best['second_pass']:.1f} for its "
              "pass (the probes of the first pass's rows never run where those rows did)")
    for mode in ("worker", "contained", "read_ahead"):
        if mode in best and "in_process" in best:
            print(f"{mode + '_overhead:':<25}{100 * (best[mode] / best['in_process'] - 1):+.1f} %")
    if "second_load_kept" in best and "second_load" in best:
        print(f"second_worker_cold:      {best['second_load']:.2f}s to start and load after the drop, "
              f"{best['second_load_kept']:.2f}s with the caches kept")
    if "kept_caches" in best and "contained" in best:
        print(f"contained_vs_kept:       {100 * (best['contained'] / best['kept_caches'] - 1):+.1f} %")
    if "user_space_caps" in best and "contained" in best:
        print(f"kernel_caps_vs_watchdog: {100 * (best['contained'] / best['user_space_caps'] - 1):+.1f} %")
        try:
            print(f"kernel_caps_setup:       {kernel_caps_seconds() * 1000:.1f} ms  (one worker's cgroup, limits and "
                  "tmpfs created and removed, best of 20)")
        except OSError as e:
            print(f"kernel_caps_setup:       not available here ({e.strerror or e})")
    if "read_ahead" in best and "contained" in best:
        print(f"read_ahead_vs_contained: {100 * (best['read_ahead'] / best['contained'] - 1):+.1f} %")

if __name__ == "__main__":
    main()
