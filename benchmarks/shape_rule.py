"""The fit behind tools/plan.py's SHAPE_FIT (its --shapes advice): val_bpb ~ E + A / N^alpha + B / D^beta
over the CPU campaign's finished runs, N the blocks' matrix parameters (plan.matrix_parameters) and D the tokens
trained, one E per text and machine (a run's number depends on both; the shapes' differences do not, in this form).

    python benchmarks/shape_rule.py            # the fit, its residuals, and whether tools/plan.py holds it

The runs: every line of benchmarks/results/presets.tsv with the adopted ingredients (`as-is`) on a host that was
recorded, and the first shape sweep at 300 s (docs/presets-and-benchmarks.md, "The CPU preset, chosen by
measurement": no ingredients then, batch 4K), which alone spans N from 0.4M to 10.6M. alpha and beta are searched on
a grid; A, B and the E's are least squares at each point of it. Pure arithmetic: a second, nothing trained."""
from __future__ import annotations

import csv
import itertools
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import preset_sweep as S  # noqa: E402
import train as T  # noqa: E402
from tools import plan as P  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "presets.tsv"
# The first sweep (300 s, stdlib, one seed, before the ingredients): (shape, tokens trained, val_bpb), as its table.
FIRST_SWEEP = (("d3-w192-s256-b4k", 3.0e6, 1.2648), ("d3-w192-s512-b4k", 2.6e6, 1.3121),
               ("d4-w192-s512-b4k", 2.2e6, 1.3312), ("d2-w128-s512-b4k", 4.2e6, 1.3817),
               ("nanochat-cpu", 1.5e6, 1.4213), ("d4-w256-s1024-b4k", 1.4e6, 1.5019),
               ("d6-w384-s512-b4k", 0.6e6, 1.6609))
GRID = np.arange(0.05, 1.5, 0.025)


def recipe_of(shape: str, ingredients: str) -> T.Recipe:
    return T.parse_command_line(["--preset", "cpu", *S.SHAPES[shape], *S.ingredient_flags(ingredients)])[0]


def campaign_runs(path: Path = RESULTS) -> list[tuple[str, int, float, float]]:
    """(group, N, tokens, val_bpb) of every run the fit reads."""
    runs = [("first sweep (stdlib, no ingredients)", P.matrix_parameters(recipe_of(shape, "off")), tokens, bpb)
            for shape, tokens, bpb in FIRST_SWEEP]
    with open(path) as f:
        for r in csv.DictReader(f, delimiter="\t"):
            if r["ingredients"] != "as-is" or r["host"].startswith("unrecorded") or r["shape"] not in S.SHAPES:
                continue
            recipe = recipe_of(r["shape"], "as-is")
            with torch.device("meta"):
                params = T.GPT(T.model_config(recipe)).num_params() / 1e6
            if abs(params - float(r["params_M"])) > 0.05:  # a preset run whose shape was picked otherwise
                print(f"skipped: {r['shape']} seed {r['seed']} ({r['params_M']}M parameters, not {params:.1f}M)")
                continue
            runs.append((f"{r['text']}, {r['dtype']}, {r['host']}", P.matrix_parameters(recipe),
                         float(r["tokens_M"]) * 1e6, float(r["val_bpb"])))
    return runs


def fit(runs) -> dict:
    """The least-squares fit: {alpha, beta, A, B, E: {group: E}, rmse}."""
    groups = sorted({g for g, *_ in runs})
    y, best = np.array([bpb for *_, bpb in runs]), None
    for alpha, beta in itertools.product(GRID, GRID):
        X = np.array([[float(g == h) for h in groups] + [n ** -alpha, d ** -beta] for g, n, d, _ in runs])
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        if coef[-1] <= 0 or coef[-2] <= 0:  # more parameters or tokens never cost
            continue
        rmse = float(np.sqrt(np.mean((X @ coef - y) ** 2)))
        if best is None or rmse < best["rmse"]:
            best = dict(alpha=round(float(alpha), 3), beta=round(float(beta), 3), A=float(coef[-2]),
                        B=float(coef[-1]), E=dict(zip(groups, map(float, coef))), rmse=rmse)
    return best


def main() -> int:
    runs = campaign_runs()
    f = fit(runs)
    print(f"{len(runs)} runs; rms error {f['rmse']:.4f} bpb\n"
          f"SHAPE_FIT = dict(A={f['A']:.2f}, alpha={f['alpha']}, B={f['B']:.1f}, beta={f['beta']})\n")
    print("| group | N (M) | tokens (M) | val_bpb | fit |\n| --- | --- | --- | --- | --- |")
    for g, n, d, bpb in runs:
        fitted = f["E"][g] + f["A"] * n ** -f["alpha"] + f["B"] * d ** -f["beta"]
        print(f"| {g} | {n / 1e6:.2f} | {d / 1e6:.1f} | {bpb:.4f} | {fitted:.4f} |")
    held = P.SHAPE_FIT
    same = abs(held["alpha"] - f["alpha"]) < 1e-9 and abs(held["beta"] - f["beta"]) < 1e-9 and \
        abs(held["A"] / f["A"] - 1) < 0.01 and abs(held["B"] / f["B"] - 1) < 0.01
    print(f"\ntools/plan.py's SHAPE_FIT {held}: {'the same fit' if same else 'NOT this fit: paste the line above'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
