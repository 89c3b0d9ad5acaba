"""The kit's `--preset cpu` against nanochat at equal wall time, on a text of your own, with one scorer.

    python benchmarks/side_by_side.py --nanochat nanochat-92d63d4.tar.gz --text ~/mytext --work ~/sbs --seconds 425
    python benchmarks/side_by_side.py ... --multiples 1,3        # and at 3x the time

--text is a folder of .txt/.jsonl/.parquet files (a `dir:` source). The work folder gets the text prepared
as its own dataset (`prepare.py setup --source dir:TEXT --build-tokenizer-if-missing`: a BPE tokenizer
trained on its training split, in a cache of its own, so the machine's active dataset stays what it was),
nanochat unpacked and patched (benchmarks/nanochat_peer.py prepare: nanochat's tokenizer files are written
from that tokenizer, so both models see the same tokens), then for each multiple m:
1. nanochat's base_train in its CPU shape (depth 4, width 256, rows of 512, 4,096 tokens a step) for
   m x SECONDS of its own training time (nanochat_peer.py train), in the machine's fast dtype;
2. the kit's `train.py --preset cpu --time-budget T`, T = the training seconds nanochat reported, in the
   same dtype (`--dtype auto`);
3. both checkpoints scored by the kit's scorer (`prepare.py eval-public --seq-len 512`, the same tokens of
   the text's public_val for both; 512 is the longest context both trained on).
It prints one markdown table and writes it to WORK/table.md. A finished part (its summary and its score
on disk) is kept and read back, never run again: rerun after a crash to finish the rest. Run it alone."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "benchmarks" / "nanochat_peer.py"
ADAPTER = REPO / "benchmarks" / "nanochat_adapter.py"
NANOCHAT_SHAPE = ["--depth", "4", "--seq-len", "512", "--device-batch-size", "8", "--total-batch-size", "4096"]
SCORE_CONTEXT = 512


class Failed(Exception):
    pass


def run(cmd: list[str], env: dict, log: Path) -> None:
    """Run a step with its output in `log`; a failure names the step and the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[side-by-side] {' '.join(map(str, cmd))}  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise Failed(f"{Path(cmd[1]).name} {cmd[2] if len(cmd) > 2 else ''} exited with {rc}: {tail[0][:300]} "
                     f"(log: {log})")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def score(train_py: Path, checkpoint: Path, report: Path, env: dict, max_tokens: int | None) -> float:
    """val_bpb of a checkpoint at SCORE_CONTEXT, by the kit's scorer (kept in `report` once done)."""
    done = read_json(report)
    if done is None:
        limit = ["--max-tokens", str(max_tokens)] if max_tokens else []
        run([sys.executable, REPO / "prepare.py", "eval-public", "--train-py", train_py, "--checkpoint", checkpoint,
             "--seq-len", str(SCORE_CONTEXT), "--device", "cpu", "--report", report, *limit], env,
            report.with_suffix(".log"))
        done = read_json(report)
    if done is None or "val_bpb" not in done:
        raise Failed(f"{report} holds no val_bpb")
    return float(done["val_bpb"])


def side_by_side(args) -> list[dict]:
    work = Path(args.work).expanduser().resolve()
    text = Path(args.text).expanduser().resolve()
    if not text.is_dir():
        raise Failed(f"--text {text} is not a folder")
    env = dict(os.environ, FRONTIER_CACHE_DIR=str(work / "cache"), FRONTIER_DATA_DIR=str(work / "data"))
    env.pop("FRONTIER_OUT_DIR", None)
    if not (work / "data" / "manifest.json").exists():
        run([sys.executable, REPO / "prepare.py", "setup", "--source", f"dir:{text}", "--data-dir", work / "data",
             "--build-tokenizer-if-missing"], env, work / "setup.log")
    if not (work / "peer" / "nanochat").exists():
        run([sys.executable, PEER, "prepare", "--snapshot", Path(args.nanochat).expanduser().resolve(), "--work",
             work / "peer"], env, work / "peer-prepare.log")
    rows = []
    for m in args.multiples:
        here = work / f"{m:g}x"
        nanochat = read_json(here / "nanochat" / "summary.json")
        if not nanochat or "failed" in nanochat:
            run([sys.executable, PEER, "train", "--work", work / "peer", "--out", here / "nanochat", "--device", "cpu",
                 "--dtype", "auto", "--seconds", f"{m * args.seconds:g}", *NANOCHAT_SHAPE], env,
                here / "nanochat.log")
            nanochat = read_json(here / "nanochat" / "summary.json")
        seconds = nanochat["training_seconds"]
        kit = read_json(here / "kit" / "summary.json")
        if not kit:
            run([sys.executable, REPO / "train.py", "--preset", "cpu", "--time-budget", f"{seconds:.1f}",
                 "--dtype", "auto", "--no-eval-public", "--device", "cpu", "--out-dir", here / "kit"], env,
                here / "kit.log")
            kit = read_json(here / "kit" / "summary.json")
        nanochat_bpb = score(ADAPTER, here / "nanochat" / "final.pt", here / "nanochat-score.json", env,
                             args.max_tokens)
        kit_bpb = score(REPO / "train.py", here / "kit" / "final.pt", here / "kit-score.json", env, args.max_tokens)
        rows.append({"multiple": m, "seconds": seconds, "nanochat": nanochat, "kit": kit,
                     "nanochat_bpb": nanochat_bpb, "kit_bpb": kit_bpb})
    return rows


def table(rows: list[dict], text: str) -> str:
    lines = [f"Text: {text}; scored at context {SCORE_CONTEXT} by prepare.py eval-public.", "",
             "| time | run | steps | tokens/s | MFU | val_bpb | vs nanochat |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        nc, kit = r["nanochat"], r["kit"]
        mfu = f"{nc['mfu_percent_mean']:.1f} %" if nc.get("mfu_percent_mean") else "–"
        dtype = nc.get("env", {}).get("NANOCHAT_DTYPE", "?")
        lines.append(f"| {r['multiple']:g}x ({r['seconds']:.0f} s) | nanochat d4 (w256, rows of 512, batch 4,096, "
                     f"{dtype}) | {nc['steps']} | {nc['tokens_per_second']:,.0f} | {mfu} | "
                     f"{r['nanochat_bpb']:.4f} | – |")
        change = 100 * (r["kit_bpb"] - r["nanochat_bpb"]) / r["nanochat_bpb"]
        lines.append(f"| | kit `--preset cpu` (rows of {kit.get('seq_len', '?')}, {kit['compute_dtype']}) | "
                     f"{kit['num_steps']} | {kit['tokens_per_second']:,.0f} | {kit['mfu_percent']:.1f} % | "
                     f"{r['kit_bpb']:.4f} | {change:+.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanochat", required=True, help="a nanochat snapshot (nanochat-<commit>.tar.gz)")
    parser.add_argument("--text", required=True, help="a folder of .txt/.jsonl/.parquet files")
    parser.add_argument("--work", required=True, help="the work folder (data, nanochat, runs, scores, table.md)")
    parser.add_argument("--seconds", type=float, required=True, help="nanochat's training seconds at 1x")
    parser.add_argument("--multiples", default="1", help="comma-separated multiples of --seconds (default 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens scored (default: the official count)")
    args = parser.parse_args(argv)
    try:
        args.multiples = [float(m) for m in args.multiples.split(",")]
        if args.seconds <= 0 or any(m <= 0 for m in args.multiples):
            raise ValueError
    except ValueError:
        print(f"side_by_side: error: --seconds and --multiples must be positive numbers, got {args.seconds}, "
              f"{args.multiples}", file=sys.stderr)
        return 1
    try:
        rows = side_by_side(args)
    except Failed as e:
        print(f"side_by_side: error: {e}", file=sys.stderr)
        return 1
    out = table(rows, args.text)
    path = Path(args.work).expanduser().resolve() / "table.md"
    path.with_suffix(".tmp").write_text(out)
    os.replace(path.with_suffix(".tmp"), path)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
