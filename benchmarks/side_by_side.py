"""The kit's `--preset cpu` against nanochat at equal wall time, on a text of your own, with one scorer.

    python benchmarks/side_by_side.py --nanochat nanochat-92d63d4.tar.gz --text ~/mytext --work ~/sbs --seconds 425
    python benchmarks/side_by_side.py ... --nanochat-shapes defaults,kit   # nanochat at two shapes
    python benchmarks/side_by_side.py ... --multiples 3 --kit-args "--seq-len 512"   # 3x, the rows plan.py advises

--text is a folder of .txt, .jsonl or .parquet files (a `text` column or key), prepared as a dataset of its
own in WORK (`prepare.py setup --source dir:TEXT --build-tokenizer-if-missing`: its last shard held out as
public_val, a BPE tokenizer trained on the rest, written into nanochat too; the machine's active dataset stays).
For each multiple m: nanochat's base_train for m x SECONDS of its training time (nanochat_peer.py train) at each
of --nanochat-shapes (`defaults`: its CPU shape, depth 4, rows of 512; `kit`: the kit's preset shape, full
context), run again once where it misses its target by more than 5 %; then the kit's `train.py --preset cpu
--time-budget T` (and --kit-args), T = the seconds nanochat's first shape trained; every checkpoint scored by
`prepare.py eval-public --seq-len 512` (the longest context all trained on) on the same tokens. Every run trains
and is scored in the dtype `--preset cpu` takes on this machine. A finished part is kept: rerun after a crash.
It prints one markdown table (also WORK/table.md). At 1x of 425 s a multiple takes ~25 minutes per nanochat
shape on 2 cores (--max-tokens 524288). Run it alone: the comparison is of speed."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "benchmarks" / "nanochat_peer.py"
ADAPTER = REPO / "benchmarks" / "nanochat_adapter.py"
NANOCHAT_SHAPES = {
    "defaults": ["--depth", "4", "--seq-len", "512", "--device-batch-size", "8", "--total-batch-size", "4096"],
    "kit": ["--depth", "3", "--seq-len", "256", "--device-batch-size", "16", "--total-batch-size", "4096",
            "--extra", "--aspect-ratio", "64", "--head-dim", "64", "--window-pattern", "L"],
}
SCORE_CONTEXT = 512
TIME_SLACK = 0.05  # nanochat's training seconds may miss the target by this share before it is run again
PROGRESS_SECONDS = 60


class Failed(Exception):
    pass


def run(cmd: list, env: dict, log: Path) -> None:
    """Run a step with its output in `log`, printing its last line once a minute; a failure names the step and
    the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[side-by-side] {' '.join(map(str, cmd))}  (log: {log})", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        while True:
            try:
                rc = p.wait(timeout=PROGRESS_SECONDS)
                break
            except subprocess.TimeoutExpired:
                last = (log.read_text(errors="replace").strip().splitlines() or ["(no output yet)"])[-1]
                print(f"[side-by-side]   {time.monotonic() - t0:.0f}s: {last[:160]}", flush=True)
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise Failed(f"{Path(str(cmd[1])).name} {cmd[2] if len(cmd) > 2 else ''} exited with {rc}: {tail[0][:300]} "
                     f"(log: {log})")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def preset_dtype() -> str:
    """The dtype --preset cpu trains in on this machine (bf16 or fp32), as train.py measures it."""
    sys.path.insert(0, str(REPO))
    import train
    recipe = train.parse_command_line(["--preset", "cpu"])[0]
    return train.dtype_name(train.device_profile_for(recipe, "cpu").compute_dtype)


def scoring_adapter(work: Path, dtype: str) -> Path:
    """nanochat's adapter set to score in `dtype`, the dtype the kit's checkpoint trained and is scored in."""
    dtype = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[dtype]
    text = ADAPTER.read_text()
    if "\nSCORE_DTYPE = None" not in text:
        raise Failed(f"{ADAPTER} has no SCORE_DTYPE line to set")
    path = work / "score" / ADAPTER.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace("\nSCORE_DTYPE = None", f"\nSCORE_DTYPE = {dtype}", 1))
    return path


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


def missed(summary: dict, target: float) -> bool:
    return abs(summary["training_seconds"] - target) > TIME_SLACK * target


def train_nanochat(work: Path, here: Path, shape: str, target: float, env: dict, dtype: str) -> dict:
    """nanochat's run at a shape for `target` training seconds: kept, or run (once more where it misses)."""
    out = here / f"nanochat-{shape}"
    summary = read_json(out / "summary.json")
    for attempt in range(2):
        if summary and "failed" not in summary and not (attempt == 0 and missed(summary, target)
                                                         and not summary.get("rerun")):
            break
        run([sys.executable, PEER, "train", "--work", work / "peer", "--out", out, "--device", "cpu",
             "--dtype", dtype, "--seconds", f"{target:g}", *NANOCHAT_SHAPES[shape]], env, here / f"nanochat-{shape}.log")
        summary = read_json(out / "summary.json")
        if summary and attempt == 0 and missed(summary, target):
            print(f"[side-by-side] nanochat ({shape}) trained {summary['training_seconds']:.0f}s for a target of "
                  f"{target:.0f}s: more than {TIME_SLACK:.0%} off, running it again", flush=True)
            summary["rerun"] = True
            (out / "summary.json").write_text(json.dumps(summary))
    return summary


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
    dtype = preset_dtype()
    adapter = scoring_adapter(work, dtype)
    rows = []
    for m in args.multiples:
        here, target = work / f"{m:g}x", m * args.seconds
        nanochat = {shape: train_nanochat(work, here, shape, target, env, dtype) for shape in args.nanochat_shapes}
        seconds = nanochat[args.nanochat_shapes[0]]["training_seconds"]
        kit = read_json(here / "kit" / "summary.json")
        if not kit:
            run([sys.executable, REPO / "train.py", "--preset", "cpu", "--time-budget", f"{seconds:.1f}",
                 "--dtype", dtype, "--no-eval-public", "--device", "cpu", *args.kit_args.split(), "--out-dir",
                 here / "kit"], env, here / "kit.log")
            kit = read_json(here / "kit" / "summary.json")
        bpb = {shape: score(adapter, here / f"nanochat-{shape}" / "final.pt", here / f"nanochat-{shape}-score.json",
                            env, args.max_tokens) for shape in args.nanochat_shapes}
        kit_bpb = score(REPO / "train.py", here / "kit" / "final.pt", here / "kit-score.json", env, args.max_tokens)
        shape = " ".join(["--preset cpu", *args.kit_args.split()]) + f": d{kit['depth']}, rows of {kit['seq_len']}"
        rows.append({"multiple": m, "target": target, "seconds": seconds, "nanochat": nanochat,
                     "kit": {**kit, "first_step_seconds": kit_first_step(here / "kit"), "shape": shape,
                             "tokens": kit["num_steps"] * kit_batch_tokens()},
                     "nanochat_bpb": bpb, "kit_bpb": kit_bpb, "score_dtype": kit["compute_dtype"]})
    return rows


def kit_first_step(out: Path) -> float:
    """The kit run's first step's seconds (the cold compile), from its metrics.jsonl."""
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["dt"]


def kit_batch_tokens() -> int:
    sys.path.insert(0, str(REPO))
    import train
    return train.PRESETS["cpu"]["total_batch_size"]


def nanochat_label(shape: str, summary: dict) -> str:
    """What nanochat ran, read from its checkpoint's config and its log."""
    cfg = summary.get("checkpoint", {}).get("model_config", {})
    width, heads = cfg.get("n_embd"), cfg.get("n_head")
    attention = "windows on SDPA's dense mask" if summary.get("sliding_window_warning") else "full context"
    return (f"nanochat {shape} (d{cfg.get('n_layer', '?')}, w{width}, {heads} heads of "
            f"{width // heads if width and heads else '?'}, {cfg.get('window_pattern', '?')}: {attention}, "
            f"rows of {cfg.get('sequence_len', '?')}, {summary['tokens_per_step']:,} tokens a step, "
            f"{summary['num_params'] / 1e6:.1f}M params, {summary.get('compute_dtype', '?')})")


def table(rows: list[dict], text: str) -> str:
    first = next(iter(rows[0]["nanochat"])) if rows else "?"
    lines = [f"Text: {Path(text).name}; every checkpoint scored at context {SCORE_CONTEXT} by prepare.py eval-public, "
             f"in {rows[0]['score_dtype'] if rows else '?'}.", "",
             f"| time | run | steps | tokens (M) | tokens/s | first step s | MFU | val_bpb | vs nanochat {first} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for shape, nc in r["nanochat"].items():
            mfu = f"{nc['mfu_percent_mean']:.1f} %" if nc.get("mfu_percent_mean") else "–"
            off = " **missed its target by more than 5 %**" if missed(nc, r["target"]) else ""
            change = 100 * (r["nanochat_bpb"][shape] - r["nanochat_bpb"][first]) / r["nanochat_bpb"][first]
            lines.append(f"| {r['multiple']:g}x (target {r['target']:.0f} s, trained {nc['training_seconds']:.0f} s"
                         f"{off}) | {nanochat_label(shape, nc)} | {nc['steps']} | "
                         f"{(nc.get('tokens') or nc['steps'] * nc['tokens_per_step']) / 1e6:.2f} | "
                         f"{nc['tokens_per_second']:,.0f} | {nc.get('first_step_dt_s') or 0:.1f} | {mfu} | "
                         f"{r['nanochat_bpb'][shape]:.4f} | {'–' if shape == first else f'{change:+.1f} %'} |")
        kit = r["kit"]
        change = 100 * (r["kit_bpb"] - r["nanochat_bpb"][first]) / r["nanochat_bpb"][first]
        lines.append(f"| {r['multiple']:g}x (trained {kit.get('training_seconds', 0):.0f} s) | kit `--preset cpu` "
                     f"({kit['shape']}, {kit['compute_dtype']}; start-up {float(kit.get('startup_seconds', 0)):.0f} s) "
                     f"| {kit['num_steps']} | "
                     f"{kit['tokens'] / 1e6:.2f} | {kit['tokens_per_second']:,.0f} | "
                     f"{kit['first_step_seconds']:.1f} | {kit['mfu_percent']:.1f} % | {r['kit_bpb']:.4f} | "
                     f"{change:+.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanochat", required=True, help="a nanochat snapshot (nanochat-<commit>.tar.gz)")
    parser.add_argument("--text", required=True, help="a folder of .txt, .jsonl or .parquet files (a `text` column)")
    parser.add_argument("--work", required=True, help="the work folder (data, nanochat, runs, scores, table.md)")
    parser.add_argument("--seconds", type=float, required=True, help="nanochat's training seconds at 1x")
    parser.add_argument("--multiples", default="1", help="comma-separated multiples of --seconds (default 1)")
    parser.add_argument("--nanochat-shapes", default="defaults",
                        help=f"comma-separated, of {', '.join(NANOCHAT_SHAPES)} (default: defaults); the kit gets the "
                             "first one's training seconds")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens scored (default: the official count)")
    parser.add_argument("--kit-args", default="", help="flags added to the kit's --preset cpu (e.g. \"--seq-len 512\" "
                        "for a 3x cell, as tools/plan.py --shapes advises)")
    args = parser.parse_args(argv)
    try:
        args.multiples = [float(m) for m in args.multiples.split(",")]
        if args.seconds <= 0 or any(m <= 0 for m in args.multiples):
            raise ValueError
    except ValueError:
        print(f"side_by_side: error: --seconds and --multiples must be positive numbers, got {args.seconds}, "
              f"{args.multiples}", file=sys.stderr)
        return 1
    args.nanochat_shapes = [s for s in args.nanochat_shapes.split(",") if s]
    unknown = [s for s in args.nanochat_shapes if s not in NANOCHAT_SHAPES]
    if unknown or not args.nanochat_shapes:
        print(f"side_by_side: error: --nanochat-shapes: unknown {unknown}; the shapes are {', '.join(NANOCHAT_SHAPES)}",
              file=sys.stderr)
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
