"""Which shape wins at a budget: train a small grid of shapes (depth, width, head size, sequence
length, batch) for the same charged time with the same seed, score every checkpoint with the
official evaluation on the same fixed tokens of public_val, and print a table and the winner.

    python benchmarks/preset_sweep.py --budget 300                  # the CPU preset's 5 minutes
    python benchmarks/preset_sweep.py --budget 300 --shapes now,nanochat-cpu
    python benchmarks/preset_sweep.py --budget 300 --device cuda --base-preset gpu --shapes ...

Each shape trains in its own process (`python train.py --preset BASE <shape flags> --time-budget
BUDGET --no-eval-public`), one after the other: run it alone on the machine. The table's last
columns (tokens per parameter, steps) are what the budget planner's rule is read from."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import prepare  # noqa: E402
from harness.metric import evaluate_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# name -> train.py flags (on top of --preset BASE). Widths: depth x aspect ratio, rounded up to the head size.
SHAPES = {
    "now": [],  # the base preset as it stands
    # the CPU preset before this sweep chose depth 3, width 192, rows of 256, batch 4K:
    "d4-w384-s1024-b8k": ["--depth", "4", "--aspect-ratio", "96", "--head-dim", "128", "--seq-len", "1024",
                          "--total-batch-size", "8192"],
    "nanochat-cpu": ["--depth", "4", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                     "--total-batch-size", "4096"],  # d4, width 256, head 64, seq 512, batch 4096
    "d4-w256-s1024-b4k": ["--depth", "4", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "1024",
                          "--total-batch-size", "4096"],
    "d4-w256-s512-b2k": ["--depth", "4", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "2048"],
    "d3-w192-s512-b4k": ["--depth", "3", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "4096"],
    "d6-w384-s512-b4k": ["--depth", "6", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "4096"],
    "d2-w128-s512-b4k": ["--depth", "2", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "4096"],
    "d3-w192-s512-b2k": ["--depth", "3", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "2048"],
    "d3-w192-s512-b8k": ["--depth", "3", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "8192", "--device-batch-size", "16"],
    "d3-w192-s256-b4k": ["--depth", "3", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "256",
                         "--total-batch-size", "4096", "--device-batch-size", "16"],  # one micro-batch, like the others
    "d4-w192-s512-b4k": ["--depth", "4", "--aspect-ratio", "48", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "4096"],
}


def summary(stdout: str) -> dict:
    after = stdout.split("\n---\n", 1)[-1]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in after.splitlines() if ":" in line)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=300.0, help="charged seconds of training per shape")
    parser.add_argument("--base-preset", default="cpu")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--eval-tokens", type=int, default=2**19, help="public_val tokens every checkpoint is scored on")
    parser.add_argument("--out", default=None, help="folder for the checkpoints and logs (default: a temp folder)")
    args = parser.parse_args()
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="preset-sweep-"))
    tokenizer = prepare.ensure_tokenizer()
    rows = []
    for name in names:
        folder = out / name
        cmd = [sys.executable, str(REPO / "train.py"), "--preset", args.base_preset, *SHAPES[name],
               "--time-budget", str(args.budget), "--no-eval-public", "--seed", str(args.seed), "--device",
               args.device, "--out-dir", str(folder)]
        t0 = time.time()
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0:
            print(f"{name}: training failed (see {folder / 'train.log'})", flush=True)
            continue
        s = summary(run.stdout)
        result = evaluate_checkpoint(REPO / "train.py", folder / "final.pt", tokenizer, prepare.EVAL_BATCH_SIZE,
                                     prepare.EVAL_SEQ_LEN, args.device, max_tokens=args.eval_tokens)
        params = float(s["num_params_M"]) * 1e6
        tokens = float(s["total_tokens_M"]) * 1e6
        rows.append({"name": name, "params_M": params / 1e6, "steps": int(s["num_steps"]), "tokens_M": tokens / 1e6,
                     "tokens_per_param": tokens / params, "tok_s": float(s["tokens_per_second"]),
                     "startup_s": float(s["startup_seconds"]), "val_bpb": result["val_bpb"],
                     "flags": " ".join(SHAPES[name])})
        r = rows[-1]
        print(f"{name:<20} {r['params_M']:6.2f}M params | {r['steps']:5d} steps | {r['tokens_M']:6.2f}M tokens | "
              f"{r['tokens_per_param']:6.2f} tok/param | {r['tok_s']:8.0f} tok/s | val_bpb {r['val_bpb']:.4f} | "
              f"{time.time() - t0:.0f}s", flush=True)
    if not rows:
        raise SystemExit("no shape trained")
    print("---")
    print(f"budget: {args.budget:.0f}s charged per shape, seed {args.seed}, device {args.device}, "
          f"base preset {args.base_preset}, scored on {args.eval_tokens} tokens of public_val at context "
          f"{prepare.EVAL_SEQ_LEN}")
    print("| shape | params | steps | tokens | tokens/param | tokens/s | val_bpb |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: r["val_bpb"]):
        print(f"| {r['name']} | {r['params_M']:.2f}M | {r['steps']} | {r['tokens_M']:.2f}M | "
              f"{r['tokens_per_param']:.1f} | {r['tok_s']:.0f} | {r['val_bpb']:.4f} |")
    best = min(rows, key=lambda r: r["val_bpb"])
    print(f"winner: {best['name']} ({best['flags'] or 'the base preset'}): val_bpb {best['val_bpb']:.4f}, "
          f"{best['tokens_per_param']:.1f} tokens per parameter, {best['steps']} steps in {args.budget:.0f}s")


if __name__ == "__main__":
    main()
