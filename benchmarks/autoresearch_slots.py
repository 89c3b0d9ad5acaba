"""autoresearch with one slot and with two on this machine: experiments per hour, and the spread of
the baseline's val_bpb when it trains in both slots at once against the same baseline alone in a slot.

    python benchmarks/autoresearch_slots.py              # the real budget, 300 s: about 55 min on 2 cores; run it alone
    python benchmarks/autoresearch_slots.py --budget 10 --eval-tokens 8192 --experiments 1,2,1 \\
        --train-args "--depth 2 --aspect-ratio 32 --head-dim 32 --seq-len 128 --total-batch-size 1024"   # a quick check

Three phases in one clone of this repository's HEAD (the committed kit), each the loop as an agent
runs it (`python loop.py queue` the unchanged baseline N times, then `bash run.sh --slots S`):
  1. slots 1          N1 experiments one after another, each with the whole machine (the loop before slots)
  2. slots 2, both    N2 experiments two at a time, each pinned to half the CPUs
  3. slots 2, alone   N3 experiments one at a time in a 2-slot loop: half the CPUs, the other half idle
First, untimed, one short experiment in each slot fills the compile caches of both slots' checkouts,
as they are after a session's first experiments. Experiments per hour: a phase's experiments over
the wall time of its loop(s). The effect of a busy neighbour on a row: phase 2 against phase 3 (the
same share of the machine); phase 1 is what the same baseline reaches with the whole machine. Every
experiment is the same commit with the same seed, so their val_bpb differ only by what the load did
to their steps in the same charged time.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = (("slots 1", 1, False), ("slots 2, both busy", 2, False), ("slots 2, alone", 2, True))
WARM_UP_BUDGET = 20.0  # seconds: past the start-up steps (where compilation happens) and the save
WARM_UP_EVAL_TOKENS = 8192
# The loop kills a run at twice its budget in wall time, start-up included; a short budget on half a
# 2-core machine spends most of that compiling, so each run here gets this much more room.
START_UP_ROOM = 180.0


def summary(log: str) -> dict:
    after = log.split("\n---\n")[-1] if "\n---\n" in log else ""
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in after.splitlines() if ":" in line)}


def clone_kit(dest: Path) -> Path:
    subprocess.run(["git", "clone", "--quiet", "--shared", str(REPO), str(dest)], check=True)
    subprocess.run(["git", "checkout", "--quiet", "-b", "autoresearch/slots-benchmark"], cwd=dest, check=True)
    return dest


def run_loop(kit: Path, slots: int, queued: int, budget: float, eval_tokens: int, args, log) -> float:
    """Queue the baseline `queued` times, run the loop until they are done; its wall seconds."""
    for _ in range(queued):
        subprocess.run([sys.executable, "loop.py", "queue", "HEAD", "--description", "baseline"],
                       cwd=kit / "autoresearch", check=True, stdout=subprocess.DEVNULL)
    cmd = ["bash", "run.sh", "--slots", str(slots), "--budget", str(budget), "--eval-tokens", str(eval_tokens),
           "--timeout", str(2 * budget + START_UP_ROOM)]
    cmd += ["--device", args.device] if args.device else []
    cmd += ["--train-args", args.train_args] if args.train_args is not None else []
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=kit / "autoresearch", env=dict(os.environ, PYTHON=sys.executable),
                            stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"the loop exited with {result.returncode}: see {log.name}")
    return time.monotonic() - start


def set_aside(kit: Path, dest: Path) -> list[dict]:
    """Move the loop's table (and plot) to dest; its rows, each with its training summary (steps,
    tokens/s) from its run folder."""
    here = kit / "autoresearch"
    by_start = {}
    for entry in (here / "runs").glob("*/entry.json"):
        e = json.loads(entry.read_text())
        by_start[(str(e["slot"]), e["start"])] = entry.parent
    os.replace(here / "results.tsv", dest.with_suffix(".tsv"))
    os.replace(here / "progress.png", dest.with_suffix(".png"))
    with open(dest.with_suffix(".tsv"), newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    for row in rows:
        run_dir = by_start[(row["slot"], row["start"])]
        row["run_dir"] = run_dir
        row.update({f"train_{k}": v for k, v in summary((run_dir / "train.log").read_text()).items()})
    crashed = [r for r in rows if r["status"] == "crash"]
    if crashed:
        raise SystemExit(f"{dest.name}: {len(crashed)} experiment(s) crashed, e.g. {crashed[0]['description']} "
                         f"(logs under {crashed[0]['run_dir']})")
    return rows


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(values):.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=300.0, help="charged training seconds per experiment")
    parser.add_argument("--experiments", default="2,4,2", help="experiments in phases 1, 2 and 3 (default 2,4,2)")
    parser.add_argument("--eval-tokens", type=int, default=2**19,
                        help="public_val tokens per score (the loop's default)")
    parser.add_argument("--device", default=None, help="default: the loop's (the fastest present)")
    parser.add_argument("--train-args", default=None,
                        help="train.py flags (default: the loop's, --preset cpu on a CPU)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the clone and logs go (default: a new "
                                                                     "temporary folder, kept)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.experiments.split(",")]
    if len(counts) != 3 or min(counts) < 1:
        parser.error("--experiments takes three counts of at least 1, e.g. 2,4,2")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="autoresearch-slots-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {work} (the clone, and each phase's loop log, results table and plot)", flush=True)
    kit = clone_kit(work / "kit")
    with open(work / "warm-up.log", "w") as log:
        print(f"warm-up: one {WARM_UP_BUDGET:.0f} s experiment in each of 2 slots (not counted) ...", flush=True)
        run_loop(kit, 2, 2, WARM_UP_BUDGET, WARM_UP_EVAL_TOKENS, args, log)
    set_aside(kit, work / "warm-up")
    phases = []
    for (name, slots, alone), count in zip(PHASES, counts):
        stem = work / name.replace(",", "").replace(" ", "-")
        with open(stem.with_suffix(".log"), "w") as log:
            print(f"{name}: {count} experiment(s) ...", flush=True)
            wall = sum(run_loop(kit, slots, 1, args.budget, args.eval_tokens, args, log) for _ in range(count)) \
                if alone else run_loop(kit, slots, count, args.budget, args.eval_tokens, args, log)
        rows = set_aside(kit, stem)
        phases.append((name, slots, wall, rows))
        print(f"  {len(rows)} in {wall / 60:.1f} min", flush=True)

    print(f"\nbudget {args.budget:.0f} s, {args.eval_tokens} eval tokens, train.py "
          f"{args.train_args if args.train_args is not None else '(the loop default)'}, {os.cpu_count()} CPUs, "
          f"load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| phase | slots | experiments | wall (min) | experiments/hour | val_bpb mean ± sd | min | max "
          "| steps | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, slots, wall, rows in phases:
        bpb = [float(r["val_bpb"]) for r in rows]
        steps = [float(r.get("train_num_steps", "nan")) for r in rows]
        tps = [float(r.get("train_tokens_per_second", "nan")) for r in rows]
        print(f"| {name} | {slots} | {len(rows)} | {wall / 60:.1f} | {len(rows) / (wall / 3600):.2f} | {mean_std(bpb)} "
              f"| {min(bpb):.4f} | {max(bpb):.4f} | {statistics.mean(steps):.0f} | {statistics.mean(tps):,.0f} |")
    print("\n| phase | slot | start | end | val_bpb | steps | tokens/s | charged s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, _, _, rows in phases:
        for r in rows:
            print(f"| {name} | {r['slot']} | {r['start']} | {r['end']} | {r['val_bpb']} "
                  f"| {r.get('train_num_steps', '-')} | {r.get('train_tokens_per_second', '-')} "
                  f"| {r.get('train_charged_seconds', '-')} |")
    both, alone = ([float(r["val_bpb"]) for r in phases[i][3]] for i in (1, 2))
    print(f"\nbaseline val_bpb, two at once minus alone in a slot: "
          f"{statistics.mean(both) - statistics.mean(alone):+.4f} "
          f"(means of {len(both)} and {len(alone)}); spread (max - min) at once {max(both) - min(both):.4f}, "
          f"alone {max(alone) - min(alone):.4f}")
    print(f"experiments per hour, slots 2 over slots 1: "
          f"{(len(phases[1][3]) / phases[1][2]) / (len(phases[0][3]) / phases[0][2]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
