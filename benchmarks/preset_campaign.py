"""The measurement campaign behind the `cpu` preset (README, "Presets that hold beyond their budget and
text"): a fixed plan of preset_sweep.py runs, each finished run one line of benchmarks/results/presets.tsv
with its commit, so that the campaign continues across sessions: `run` trains only what the table does not
have yet (commit the table after each run, or let --commit do it), `status` says how far it is, `tables`
prints one markdown table per question from what is there.

    python benchmarks/preset_campaign.py status
    python benchmarks/preset_campaign.py run --commit          # alone on the machine; stop it at any time
    python benchmarks/preset_campaign.py run --commit --only larger-shape   # fixed steps: may share the machine
    python benchmarks/preset_campaign.py tables

The plan, about 5.3 hours on the 2-core machine, and why each part:
- ablation: the ingredients the presets adopted rest on one seed; a second seed for off, value
  embeddings, windows and both (the preset as it is: `as-is`), and trigram and `every` once;
- shapes-300 / shapes-900: the preset's shape against three neighbours (rows of 512 with the short
  windows, one size up, nanochat's CPU shape) at its budget and at 3x, two seeds at 1x;
- prose-300: the same shapes on a text the kit was never tuned on (benchmarks/prose_corpus.py);
- larger-shape: whether the strong recipe (value embeddings + short windows) also helps a larger model at
  a fixed step count: the only evidence here for the d10 default that participants run on Trainium;
- bars-150: the preset against nanochat's shape with the organisers' architecture (no ingredients), both
  run by the kit, at 150 s, three seeds each."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import preset_sweep as S  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "presets.tsv"
PROSE = Path.home() / "prose"  # benchmarks/prose_corpus.py --out ~/prose: the prepared text is ~/prose/data
EVAL_TOKENS = 2**19
SHAPES = ("now", "d3-w192-s512-b4k", "d4-w256-s256-b4k", "nanochat-cpu")


@dataclass
class Part:
    question: str
    shapes: tuple
    specs: tuple
    seeds: tuple
    budget: float = 300.0
    max_steps: int = 0
    text: str = "stdlib"
    minutes_per_run: float = 7.0  # the budget, start-up and the scoring of 2^19 tokens, measured

    def sweep_args(self) -> list[str]:
        length = ["--max-steps", str(self.max_steps)] if self.max_steps else ["--budget", f"{self.budget:g}"]
        data = ["--data-dir", str(PROSE / "data")] if self.text == "prose" else []
        return [*length, "--shapes", ",".join(self.shapes), "--ingredients", ",".join(self.specs), "--seeds",
                ",".join(map(str, self.seeds)), "--eval-tokens", str(EVAL_TOKENS), "--text", self.text, *data,
                "--results", str(RESULTS)]

    def keys(self) -> list[dict]:
        length = f"{self.max_steps} steps" if self.max_steps else f"{self.budget:g}s"
        return [{"base": "cpu", "shape": shape, "ingredients": spec, "seed": str(seed), "length": length,
                 "text": self.text, "extra": "", "device": "cpu", "eval_tokens": str(EVAL_TOKENS)}
                for shape in self.shapes for spec in self.specs for seed in self.seeds]


PLAN = [  # in the order run: the parts that decide the preset first, each whole before the next (larger-shape
    # counts steps, not seconds, so its val_bpb does not depend on what else the machine runs)
    Part("ablation", ("now",), ("off", "value-embeds", "windows", "as-is"), (1, 2)),
    Part("larger-shape", ("d6-w384-s512-b4k",), ("off", "value-embeds+windows"), (1,), max_steps=400,
         minutes_per_run=20.0),
    Part("bars-150", ("now",), ("as-is",), (1, 2, 3), budget=150.0, minutes_per_run=4.5),
    Part("bars-150", ("nanochat-cpu",), ("off",), (1, 2, 3), budget=150.0, minutes_per_run=4.5),
    Part("shapes-300", SHAPES, ("as-is",), (1, 2)),
    Part("shapes-900", SHAPES, ("as-is",), (1,), budget=900.0, minutes_per_run=17.0),
    Part("shapes-900", ("now",), ("as-is",), (2,), budget=900.0, minutes_per_run=17.0),
    Part("prose-300", SHAPES, ("as-is",), (1, 2), text="prose"),
    Part("ablation", ("now",), ("trigram", "every"), (1,)),
]


def table() -> S.ResultsTable:
    return S.ResultsTable(RESULTS)


def status() -> None:
    done_table, left_minutes = table(), 0.0
    for part in PLAN:
        keys = part.keys()
        done = sum(done_table.find(k) is not None for k in keys)
        left_minutes += (len(keys) - done) * part.minutes_per_run
        print(f"{part.question:<13} {done}/{len(keys)} runs: {' '.join(part.sweep_args()[:-2])}")
    print(f"about {left_minutes / 60:.1f} hours of runs left (alone on the 2-core machine)")


def run(commit: bool, only: str | None) -> None:
    subprocess.run([sys.executable, str(REPO / "prepare.py"), "setup", "--source", "stdlib"], check=True, cwd=REPO)
    if any(part.text == "prose" and only in (None, part.question) for part in PLAN) and not (PROSE / "data").exists():
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "prose_corpus.py"), "--out", str(PROSE)], check=True)
    for part in PLAN:
        if (only and part.question != only) or all(table().find(k) is not None for k in part.keys()):
            continue
        for key in part.keys():  # one run per sweep, so that each finished run is committed at once
            if table().find(key) is not None:
                continue
            single = Part(part.question, (key["shape"],), (key["ingredients"],), (int(key["seed"]),), part.budget,
                          part.max_steps, part.text)
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "preset_sweep.py"), *single.sweep_args(),
                            "--out", str(Path.home() / "preset-campaign" / f"{part.question}-{key['length']}-"
                                                                            f"{part.text}")], check=True)
            if commit:
                subprocess.run(["git", "add", str(RESULTS)], cwd=REPO, check=True)
                subprocess.run(["git", "commit", "-qm", f"benchmarks/results/presets.tsv: {part.question}, "
                                f"{key['shape']} {key['ingredients']} seed {key['seed']}", "--", str(RESULTS)],
                               cwd=REPO, check=True)  # the table only: never what else is staged


def tables() -> None:
    rows = table().rows
    for question in dict.fromkeys(part.question for part in PLAN):
        parts = [p for p in PLAN if p.question == question]
        keys = [k for p in parts for k in p.keys()]
        groups: dict = {}
        for key in keys:
            found = [r for r in rows if all(r[f] == key[f] for f in S.KEY_FIELDS)]
            groups.setdefault((key["shape"], key["ingredients"], key["length"], key["text"]), []).extend(found)
        print(f"\n{question}\n")
        print("| shape | ingredients | length | text | params | steps | tokens/s | val_bpb per seed | mean | spread |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for (shape, spec, length, text), found in groups.items():
            if not found:
                print(f"| {shape} | {spec} | {length} | {text} | not run yet | | | | | |")
                continue
            values = [float(r["val_bpb"]) for r in found]
            per_seed = ", ".join(f"{r['seed']}: {float(r['val_bpb']):.4f}" for r in found)
            print(f"| {shape} | {spec} | {length} | {text} | {float(found[0]['params_M']):.2f}M | "
                  f"{round(statistics.mean(float(r['steps']) for r in found))} | "
                  f"{statistics.mean(float(r['tok_s']) for r in found):,.0f} | {per_seed} | "
                  f"{statistics.mean(values):.4f} | {max(values) - min(values):.4f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("status", "run", "tables"))
    parser.add_argument("--commit", action="store_true", help="git commit the results table after each run")
    parser.add_argument("--only", choices=list(dict.fromkeys(part.question for part in PLAN)), default=None,
                        help="run one question's part(s) only (larger-shape counts steps, so it may share the machine)")
    args = parser.parse_args()
    {"status": status, "tables": tables}.get(args.what, lambda: run(args.commit, args.only))()
    return 0


if __name__ == "__main__":
    sys.exit(main())
