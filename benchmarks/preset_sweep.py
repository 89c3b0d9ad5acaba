"""Which recipe wins at a budget: train every (shape, ingredients, seed) of a grid for the same charged time
(or the same number of steps), score every checkpoint with the official evaluation on the same fixed tokens
of public_val, and print a table: per seed, the mean, the seed spread and the difference to the reference.

    # the ingredients one at a time on the CPU preset, 2 seeds
    python benchmarks/preset_sweep.py --budget 300 --seeds 1,2 --ingredients off,value-embeds,windows,every
    # the seed spread of the preset as it ships (tools/compare.py reads it from the results)
    python benchmarks/preset_sweep.py --budget 300 --seeds 1,2,3,4,5 --results benchmarks/results/presets.tsv
    # the same at a fixed step count on a larger shape: per-step gain apart from step-time cost
    python benchmarks/preset_sweep.py --max-steps 400 --shapes nanochat-cpu --seeds 1 \
        --ingredients off,value-embeds,windows,every
    # shapes at 1x and 3x the budget, on the stdlib text or another prepared one (--data-dir)
    python benchmarks/preset_sweep.py --budget 900 --shapes now,d3-w192-s512-b4k,nanochat-cpu --ingredients as-is

Ingredient names combine with +: `--ingredients off,value-embeds+windows`. `off` sets every ingredient off
explicitly and `as-is` passes nothing (the preset as it stands: the same model until the presets adopt
ingredients; after, `off` is the preset before and `as-is` after). Each run trains in its own process
(`python train.py --preset BASE <shape> <ingredients> --seed S --time-budget B --no-eval-public`), one
after the other, and is scored by `python prepare.py eval-public --report ...`: run it alone on the
machine. Results land in --out (one folder per run, its log and result.json); a rerun with the same --out
reuses the runs already done, so an interrupted sweep continues where it stopped."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import torch  # noqa: E402
import train as T  # noqa: E402  (the ingredients and their flags)

# name -> train.py flags (on top of --preset BASE). Widths: depth x aspect ratio, rounded up to the head size.
SHAPES = {  # the shapes of benchmarks/results/presets.tsv that a question still asks about
    "now": [],  # the base preset as it stands
    "nanochat-cpu": ["--depth", "4", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                     "--total-batch-size", "4096"],  # d4, width 256, head 64, seq 512, batch 4096
    "d4-w256-s256-b4k": ["--depth", "4", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "256",
                         "--total-batch-size", "4096", "--device-batch-size", "16"],  # one size up
    "d3-w192-s512-b4k": ["--depth", "3", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "4096"],  # the preset's shape at rows of 512
    "d3-w384-s256-b4k": ["--depth", "3", "--aspect-ratio", "128", "--head-dim", "64", "--seq-len", "256",
                         "--total-batch-size", "4096", "--device-batch-size", "16"],  # the wide candidate
    "d6-w384-s512-b4k": ["--depth", "6", "--aspect-ratio", "64", "--head-dim", "64", "--seq-len", "512",
                         "--total-batch-size", "4096"],  # a larger shape, at fixed steps
}

# Every ingredient of train.py off, explicitly (Architecture's defaults): the baseline whatever the preset
# adopts. field -> value
OFF = {f.name: f.default for f in dataclasses.fields(T.Architecture) if "on" in f.metadata}
# name -> what it turns on over OFF. The bigram and trigram tables, smear, backout and the keep-rest sampler,
# measured here and never found to help (benchmarks/results/presets.tsv), are recipes now (docs/recipes.md):
# paste one into train.py to sweep it again.
INGREDIENTS = {
    "off": {},
    "value-embeds": {"value_embeds": "alternate"},  # nanochat's layers: every other one, the last included
    "windows": {"window_pattern": "SSSL"},  # nanochat's pattern; short windows of a quarter of the rows
}
INGREDIENTS["every"] = {k: v for name in ("value-embeds", "windows") for k, v in INGREDIENTS[name].items()}


def ingredient_flags(spec: str) -> list[str]:
    """train.py flags of an ingredient spec: `as-is` (none), or names joined by + on top of OFF."""
    if spec == "as-is":
        return []
    settings = dict(OFF)
    for name in spec.split("+"):
        if name not in INGREDIENTS:
            raise SystemExit(f"unknown ingredient {name!r}; known: as-is, {', '.join(INGREDIENTS)} (joined by +)")
        settings.update(INGREDIENTS[name])
    return [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]


RESULT_FIELDS = ("commit", "base", "shape", "ingredients", "seed", "length", "text", "extra", "device", "eval_tokens",
                 "host", "dtype", "params_M", "steps", "tokens_M", "tok_s", "startup_s", "charged_s", "val_bpb",
                 "wall_s", "command")
# What makes two runs the same run. A run of fixed wall-clock time is only repeated on the same host: what it
# learns in its budget depends on how fast the machine is (one 2-core machine trains 2x the tokens/s of
# another); a run of fixed steps computes the same thing on any host with the same compute dtype.
KEY_FIELDS = ("base", "shape", "ingredients", "seed", "length", "text", "extra", "device", "eval_tokens", "dtype",
              "host")


def same_run(row: dict, key: dict) -> bool:
    """Whether a results line is the run `key` asks for (the host only counts for a wall-clock budget)."""
    fixed_steps = key["length"].endswith("steps")
    return all(row[k] == key[k] for k in KEY_FIELDS if not (k == "host" and fixed_steps))


def host_name(device: str) -> str:
    """The machine a result was measured on: the CPU's model and count, or the accelerator's name."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if device != "cpu":
        return device
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model} x{os.cpu_count()}"


def dtype_name(device: str, extra: str) -> str:
    """The compute dtype train.py picks for the cpu preset's runs here (its --dtype from --extra, else auto)."""
    recipe = T.parse_command_line(["--preset", "cpu", *extra.split()])[0]
    return T.dtype_name(T.device_profile_for(recipe, device).compute_dtype)


class ResultsTable:
    """A TSV of finished runs, one line each with the commit it ran at (a line is written whole: the file is
    rewritten to a temporary name and renamed), so that a sweep interrupted at any point, or continued in
    another session, runs only what the file does not have yet."""

    def __init__(self, path: Path):
        self.path = path
        self.rows = []
        if path.exists():
            lines = path.read_text().splitlines()
            if not lines or lines[0].split("\t") != list(RESULT_FIELDS):
                raise SystemExit(f"{path}: not a results table of this script (its header is not {RESULT_FIELDS})")
            self.rows = [dict(zip(RESULT_FIELDS, line.split("\t"))) for line in lines[1:] if line]

    def find(self, key: dict) -> dict | None:
        for row in self.rows:
            if same_run(row, key):
                return {"params_M": float(row["params_M"]), "steps": int(row["steps"]), "tokens_M": float(row["tokens_M"]),
                        "tok_s": float(row["tok_s"]), "startup_s": float(row["startup_s"]),
                        "charged_s": float(row["charged_s"]), "val_bpb": float(row["val_bpb"]),
                        "wall_s": float(row["wall_s"])}
        return None

    def add(self, key: dict, command: str, result: dict) -> None:
        commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "train.py"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        row = {**key, "commit": commit + ("+" if dirty else ""), "command": command,
               **{k: f"{result[k]:.4f}" if k == "val_bpb" else f"{result[k]:.6g}" for k in
                  ("params_M", "steps", "tokens_M", "tok_s", "startup_s", "charged_s", "val_bpb", "wall_s")}}
        self.rows.append({k: str(row[k]).replace("\t", " ") for k in RESULT_FIELDS})
        text = "\n".join(["\t".join(RESULT_FIELDS)] + ["\t".join(r[k] for k in RESULT_FIELDS) for r in self.rows])
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, self.path)


def summary(stdout: str) -> dict:
    after = stdout.split("\n---\n", 1)[-1]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in after.splitlines() if ":" in line)}


def run_one(folder: Path, cmd: list[str], score_cmd: list[str], env: dict, host: str) -> dict | None:
    """Train and score one run in `folder` (or read its result.json from an earlier sweep on this host)."""
    done = folder / "result.json"
    if done.exists():
        earlier = json.loads(done.read_text())
        if earlier.get("host") == host:
            return earlier
        print(f"  {done} is from another host ({earlier.get('host', 'unrecorded')}): running it again", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    (folder / "train.log").write_text(" ".join(cmd) + "\n" + run.stdout + run.stderr)
    if run.returncode != 0:
        print(f"  training failed (see {folder / 'train.log'})", flush=True)
        return None
    s = summary(run.stdout)
    reported = [line.split("compute dtype:", 1)[1].split("|")[0].strip() for line in run.stdout.splitlines()
                if "compute dtype:" in line]
    report = folder / "eval.json"
    scored = subprocess.run([*score_cmd, "--checkpoint", str(folder / "out" / "final.pt"), "--report", str(report)],
                            cwd=REPO, env=env, capture_output=True, text=True)
    (folder / "eval.log").write_text(scored.stdout + scored.stderr)
    if scored.returncode != 0:
        print(f"  scoring failed (see {folder / 'eval.log'})", flush=True)
        return None
    result = {"params_M": float(s["num_params_M"]), "steps": int(s["num_steps"]),
              "tokens_M": float(s["total_tokens_M"]), "tok_s": float(s["tokens_per_second"]),
              "startup_s": float(s["startup_seconds"]), "charged_s": float(s["charged_seconds"]),
              "val_bpb": json.loads(report.read_text())["val_bpb"], "wall_s": time.time() - t0, "host": host,
              "dtype": {"torch.bfloat16": "bf16", "torch.float32": "fp32"}.get(reported[0] if reported else "", "?")}
    done.write_text(json.dumps(result, indent=1))
    return result


def noise(values: list[float]) -> float:
    """The seed spread of a run: max - min over its seeds (0 for one seed)."""
    return max(values) - min(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=300.0, help="charged seconds of training per run")
    parser.add_argument("--max-steps", type=int, default=0, help="train this many steps instead (schedules on steps; "
                                                                  "the budget then only has to be long enough)")
    parser.add_argument("--base-preset", default="cpu")
    parser.add_argument("--shapes", default="now", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--ingredients", default="as-is", help="comma-separated specs: as-is, or names joined by + "
                                                               f"from {', '.join(INGREDIENTS)}")
    parser.add_argument("--seeds", default="42", help="comma-separated; every run of the grid trains with each")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eval-tokens", type=int, default=2**19, help="public_val tokens every checkpoint is "
                                                                       "scored on (the same ones for all)")
    parser.add_argument("--data-dir", default=None, help="a prepared dataset (FRONTIER_DATA_DIR) to train and score "
                                                         "on; default: the active one")
    parser.add_argument("--extra", default="", help="more train.py flags for every run, as one argument: "
                                                     "--extra='--log-every 50'")
    parser.add_argument("--results", default=None, help="a TSV (e.g. benchmarks/results/presets.tsv) that gets one "
                                                         "line per finished run; a run it already has is not run again")
    parser.add_argument("--text", default=None, help="the name of the text in --results (default: the --data-dir "
                                                      "folder's parent, or stdlib)")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temp folder); rerun with the "
                                                    "same folder to continue an interrupted sweep")
    args = parser.parse_args()
    shapes = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in shapes if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    specs = [n.strip() for n in args.ingredients.split(",") if n.strip()]
    for spec in specs:
        ingredient_flags(spec)
    seeds = [int(s) for s in args.seeds.split(",")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if args.data_dir:
        env["FRONTIER_DATA_DIR"] = str(Path(args.data_dir).resolve())
    out = Path(args.out or tempfile.mkdtemp(prefix="preset-sweep-")).resolve()
    length = (["--max-steps", str(args.max_steps), "--time-budget", "1000000"] if args.max_steps else
              ["--time-budget", str(args.budget)])
    score_cmd = [sys.executable, "prepare.py", "eval-public", "--train-py", "train.py", "--device", args.device,
                 "--max-tokens", str(args.eval_tokens)]
    print(f"{len(shapes) * len(specs) * len(seeds)} runs in {out}", flush=True)
    results: dict[tuple[str, str], dict[int, dict]] = {}
    text = args.text or (Path(args.data_dir).resolve().parent.name if args.data_dir else "stdlib")
    length_label = f"{args.max_steps} steps" if args.max_steps else f"{args.budget:g}s"
    table = ResultsTable(Path(args.results)) if args.results else None
    host, dtype = host_name(args.device), dtype_name(args.device, args.extra)
    print(f"host {host}, compute dtype {dtype}", flush=True)

    def run_grid(grid):
        for shape, spec in grid:
            for seed in seeds:
                name = f"{shape}__{spec}__seed{seed}"
                cmd = [sys.executable, "train.py", "--preset", args.base_preset, *SHAPES[shape],
                       *ingredient_flags(spec), *length, "--no-eval-public", "--seed", str(seed), "--device", args.device,
                       "--out-dir", str(out / name / "out"), *args.extra.split()]
                key = {"base": args.base_preset, "shape": shape, "ingredients": spec, "seed": str(seed),
                       "length": length_label, "text": text, "extra": args.extra, "device": args.device,
                       "eval_tokens": str(args.eval_tokens), "dtype": dtype, "host": host}
                r = table.find(key) if table else None
                if r is not None:
                    print(f"{name}: in {table.path} already", flush=True)
                else:
                    print(f"{name}: {' '.join(cmd[2:])}", flush=True)
                    r = run_one(out / name, cmd, score_cmd, env, host)
                    if r is not None and r.get("dtype", dtype) != dtype:
                        raise SystemExit(f"{name}: train.py computed in {r['dtype']}, not the {dtype} expected here "
                                         f"(see {out / name / 'train.log'})")
                    if r is not None and table:
                        table.add(key, " ".join(cmd[1:]), r)
                if r is not None:
                    results.setdefault((shape, spec), {})[seed] = r
                    print(f"  {r['params_M']:.2f}M params | {r['steps']} steps | {r['tokens_M']:.2f}M tokens | "
                          f"{r['tok_s']:.0f} tok/s | start-up {r['startup_s']:.0f}s | val_bpb {r['val_bpb']:.4f} | "
                          f"{r['wall_s']:.0f}s", flush=True)

    run_grid([(shape, spec) for shape in shapes for spec in specs])
    if not results:
        raise SystemExit("no run trained")

    print("---")
    what = f"{args.max_steps} steps" if args.max_steps else f"{args.budget:.0f}s charged"
    print(f"{what} per run, seeds {args.seeds}, device {args.device}, base preset {args.base_preset}, data "
          f"{args.data_dir or 'the active dataset'}, scored on the same {args.eval_tokens} tokens of public_val at "
          f"context 1024")
    compared = f"the same shape's {specs[0]}" if len(specs) > 1 else f"{shapes[0]}"
    print(f"difference: to {compared}; spread: max - min over the seeds")
    print(f"| shape | ingredients | params | steps | tokens/s | {' | '.join(f'seed {s}' for s in seeds)} | mean | "
          f"spread | difference |")
    print("| --- " * (8 + len(seeds)) + "|")
    mean_bpb = lambda key: statistics.mean(r["val_bpb"] for r in results[key].values())  # noqa: E731
    for shape in shapes:
        reference = (shape, specs[0]) if len(specs) > 1 else (shapes[0], specs[0])
        for spec in specs:
            runs = results.get((shape, spec))
            if not runs:
                continue
            values = [r["val_bpb"] for r in runs.values()]
            difference = f"{mean_bpb((shape, spec)) - mean_bpb(reference):+.4f}" if reference in results else "-"
            per_seed = " | ".join(f"{runs[s]['val_bpb']:.4f}" if s in runs else "-" for s in seeds)
            print(f"| {shape} | {spec} | {next(iter(runs.values()))['params_M']:.2f}M | "
                  f"{round(statistics.mean(r['steps'] for r in runs.values()))} | "
                  f"{statistics.mean(r['tok_s'] for r in runs.values()):,.0f} | {per_seed} | "
                  f"{statistics.mean(values):.4f} | {noise(values):.4f} | {difference} |")

if __name__ == "__main__":
    main()
