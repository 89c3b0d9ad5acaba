"""Two runs side by side: what each scored, how fast it trained, its shape and the flags that differ, both loss
curves in one picture, and whether the difference is beyond the seed spread measured for that preset and budget.

    python tools/compare.py out/run-20261207-101500-ab12cd out   # the run before, against the latest
    python tools/compare.py BASE EDIT --picture ab.png

A run folder is what train.py leaves (final.pt, summary.json, metrics.jsonl). The score compared is eval-public's
where both folders hold a report of it for their own checkpoint at the same context and token count (`python
prepare.py eval-public --checkpoint DIR/final.pt` writes it beside the checkpoint), else train.py's own estimate
(summary.json's val_bpb, on the same tokens of public_val for the same --eval-tokens). The seed spread is the
range of val_bpb over the seeds of the cpu preset at the runs' budget and compute dtype in
benchmarks/results/seeds.tsv (`python benchmarks/preset_sweep.py --budget 300 --seeds 1,2,3 --eval-tokens 262144
--results benchmarks/results/seeds.tsv` measures it, on the preset's own count of tokens); a difference within
it is not shown to be the edit's effect."""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

SEEDS_TSV = REPO / "benchmarks" / "results" / "seeds.tsv"  # the cpu preset as it ships, several seeds
SPREAD_MIN_SEEDS = 3  # seeds a spread needs before a verdict rests on it


class Failed(Exception):
    pass


def read_run(folder: Path) -> dict:
    """What a run folder says: its summary, progress lines, recipe and options (the checkpoint's meta), and the
    eval-public report of its checkpoint, if one was written."""
    summary_path, checkpoint = folder / "summary.json", folder / "final.pt"
    if not summary_path.is_file() or not checkpoint.is_file():
        raise Failed(f"{folder}: not a finished run folder (no summary.json or final.pt); give the --out-dir of a run")
    summary = json.loads(summary_path.read_text())
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (folder / "metrics.jsonl").is_file() else []
    _, _, meta = T.read_checkpoint(checkpoint)
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    report = folder / f"eval-public-{digest[:12]}.json"
    official = json.loads(report.read_text()) if report.is_file() else None
    return {"folder": folder, "summary": summary, "metrics": metrics, "recipe": meta.get("recipe", {}),
            "options": meta.get("run_options", {}), "train_py": meta.get("train_py_sha256"), "report": official}


def scores(a: dict, b: dict) -> tuple[float, float, str]:
    """The two val_bpb compared, and what they are: eval-public's where both have it on the same tokens, else
    train.py's estimates."""
    ra, rb = a["report"], b["report"]
    if ra and rb and (ra["seq_len"], ra["tokens"]) == (rb["seq_len"], rb["tokens"]):
        return ra["val_bpb"], rb["val_bpb"], f"eval-public, {ra['tokens']:,} tokens at context {ra['seq_len']}"
    if "val_bpb" not in a["summary"] or "val_bpb" not in b["summary"]:
        raise Failed("a run has no val_bpb (trained with --no-eval-public?): score both with python prepare.py "
                     "eval-public --checkpoint DIR/final.pt and compare again")
    tokens = (a["summary"].get("eval_tokens"), b["summary"].get("eval_tokens"))
    if tokens[0] != tokens[1]:
        raise Failed(f"the two estimates are on {tokens[0]} and {tokens[1]} tokens of public_val: score both with "
                     "eval-public, or train with the same --eval-tokens")
    return float(a["summary"]["val_bpb"]), float(b["summary"]["val_bpb"]), \
        f"train.py's estimate, {f'{tokens[0]:,}' if tokens[0] else '?'} tokens of public_val"


def differing_settings(a: dict, b: dict) -> list[str]:
    """The recipe fields and run options that differ, as flags: --name A -> B."""
    out = []
    for what in ("recipe", "options"):
        for key in sorted(set(a[what]) | set(b[what])):
            if key in ("out_dir", "resume") or a[what].get(key) == b[what].get(key):
                continue
            out.append(f"--{key.replace('_', '-')} {a[what].get(key)!r} -> {b[what].get(key)!r}")
    return out


def shape(run: dict) -> str:
    s, r = run["summary"], run["recipe"]
    return f"depth {s.get('depth')}, {s.get('num_params_M')}M parameters, rows of {s.get('seq_len')}, " \
           f"{r.get('total_batch_size')} tokens a step, {s.get('compute_dtype')}"


def seed_spread(run: dict) -> dict | None:
    """The val_bpb of the seeds of the cpu preset as it ships, at this run's budget and compute dtype, from
    SEEDS_TSV: {values, spread (max - min), texts}, or None where this run is not that preset or too few seeds
    were measured. (The spread of a preset carries to an edit of train.py: the edit is what differs.)"""
    preset, mine = T.recipe_settings(T.parse_command_line(["--preset", "cpu"])[0]), run["recipe"]
    if not mine or not SEEDS_TSV.is_file() or any(mine.get(k) != v for k, v in preset.items()
                                             if k not in ("seed", "time_budget", "dtype")):
        return None  # (a flag of the edit's own, off, leaves it the preset)
    with open(SEEDS_TSV) as f:
        rows = [r for r in csv.DictReader(f, delimiter="\t") if (r["base"], r["shape"], r["ingredients"], r["extra"])
                == ("cpu", "now", "as-is", "") and r["length"] == f"{mine['time_budget']:g}s"
                and r["dtype"] == mine["dtype"]]
    by_text: dict[str, list[float]] = {}
    for r in rows:
        by_text.setdefault(r["text"], []).append(float(r["val_bpb"]))
    measured = {text: values for text, values in by_text.items() if len(values) >= SPREAD_MIN_SEEDS}
    if not measured:
        return None
    text, values = max(measured.items(), key=lambda kv: max(kv[1]) - min(kv[1]))
    return {"values": values, "spread": max(values) - min(values), "text": text, "texts": sorted(measured)}


def picture(a: dict, b: dict, labels: tuple[str, str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, label in zip((a, b), labels):
        ax.plot([m["charged_seconds"] for m in run["metrics"]], [m["loss"] for m in run["metrics"]], label=label)
    ax.set(xlabel="charged seconds", ylabel="training loss (smoothed)", title="tools/compare.py")
    ax.legend()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(path)


def compare(a: dict, b: dict) -> tuple[list[tuple[str, str, str]], str]:
    """The table's rows (what, A, B) and the verdict."""
    bpb_a, bpb_b, what = scores(a, b)
    sa, sb = a["summary"], b["summary"]
    rows = [("val_bpb", f"{bpb_a:.4f}", f"{bpb_b:.4f} ({bpb_b - bpb_a:+.4f}; {what})"),
            ("steps", str(sa.get("num_steps")), str(sb.get("num_steps"))),
            ("tokens/s", *(f"{float(s.get('tokens_per_second', 0)):,.0f}" for s in (sa, sb))),
            ("charged seconds", str(sa.get("charged_seconds")), str(sb.get("charged_seconds"))),
            ("shape", shape(a), "the same" if shape(a) == shape(b) else shape(b)),
            ("train.py", (a["train_py"] or "?")[:12], "the same" if a["train_py"] == b["train_py"] else
             (b["train_py"] or "?")[:12])]
    flags = differing_settings(a, b)
    rows.append(("flags that differ", "", "; ".join(flags) if flags else "none"))
    spread_a, spread_b = seed_spread(a), seed_spread(b)
    spread = spread_a if spread_a == spread_b else None
    diff = bpb_b - bpb_a
    if spread is None:
        verdict = ("no seed spread is measured for these runs (the cpu preset at this budget and dtype, in "
                   f"benchmarks/results/seeds.tsv, {SPREAD_MIN_SEEDS} seeds or more): run a few seeds of each side "
                   "(--seed) to tell an effect from noise")
    else:
        n, text = len(spread["values"]), spread["text"]
        beyond = abs(diff) > spread["spread"]
        verdict = (f"B is {'better' if diff < 0 else 'worse'} by {abs(diff):.4f}, "
                   f"{'beyond' if beyond else 'within'} the seed spread of this preset and budget "
                   f"({spread['spread']:.4f}: the range of {n} seeds on {text}, the widest of "
                   f"{', '.join(spread['texts'])})"
                   + ("" if beyond else ": not shown to be the edit's effect; more seeds of each side would tell"))
    return rows, verdict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the first run folder (the baseline)")
    parser.add_argument("b", help="the second run folder (the edit)")
    parser.add_argument("--picture", default=None, help="the picture of both loss curves (default: compare.png in B)")
    args = parser.parse_args(argv)
    try:
        a, b = read_run(Path(args.a)), read_run(Path(args.b))
        rows, verdict = compare(a, b)
    except (Failed, ValueError) as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 1
    width = max(len(r[1]) for r in rows) + 2
    print(f"{'':<18}{'A: ' + args.a:<{width}}B: {args.b}")
    for name, va, vb in rows:
        print(f"{name:<18}{va:<{width}}{vb}")
    print(f"verdict:          {verdict}")
    path = Path(args.picture) if args.picture else Path(args.b) / "compare.png"
    try:
        picture(a, b, (f"A: {args.a}", f"B: {args.b}"), path)
        print(f"picture:          {path}")
    except ImportError:
        print("picture:          skipped (matplotlib is not installed here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
