"""The measurement campaign behind the `cpu` preset (docs/presets-and-benchmarks.md, "Presets that hold
beyond their budget and text"): a fixed plan of preset_sweep.py runs, each finished run one line of
benchmarks/results/presets.tsv with its commit, so that the campaign continues across sessions: `run` trains only what the table does not
have yet (commit the table after each run, or let --commit do it), `status` says how far it is, `tables`
prints one markdown table per question from what is there.

    python benchmarks/preset_campaign.py status
    python benchmarks/preset_campaign.py run --commit          # alone on the machine; stop it at any time
    python benchmarks/preset_campaign.py run --commit --only larger-shape   # fixed steps: may share the machine
    python benchmarks/preset_campaign.py tables

A run of fixed wall-clock time is repeated on each kind of machine that answers its question: two 2-core
machines have differed by 2x in tokens per second on the same run (the one that recorded it computes in
bf16), so a question's runs compare only within one machine (the host and compute dtype on each line), and a
question is done when one machine has all of its runs. `run` trains what this machine lacks of the questions
that no machine has finished. Runs of fixed steps compare across hosts with the same dtype.

The plan, about 7.5 hours on the 2-core machine, and why each part:
- shapes-300 / shapes-900: the preset's shape against three neighbours (rows of 512 with the short
  windows, one size up, nanochat's CPU shape) at its budget and at 3x, two seeds at 1x
  (at 3x: the preset and rows of 512);
- bars-150: the preset against nanochat's shape with the organisers' architecture (no ingredients), both
  run by the kit, at 150 s, three seeds each;
- prose-300: the same shapes on a text the kit was never tuned on (benchmarks/prose_corpus.py);
- ablation: the ingredients the presets adopted rest on one seed; a second seed for off, value
  embeddings, windows and both (the preset as it is: `as-is`);
- more-ingredients: trigram (the bigram and trigram tables on top of `off`) and `every` (every
  ingredient but keep-rest) once, against `off` and the preset as it is;
- larger-shape: whether the strong recipe (value embeddings + short windows) also helps a larger model at
  a fixed step count: the only evidence here for the d10 default that participants run on Trainium;
- shapes-900-fp32: the preset and rows of 512 at 900 s on a machine that computes in fp32 (no AVX-512 BF16)
  at about half the tokens/s. On the bf16 machine rows of 512 won at 900 s, where the preset's rows of 256
  passed 3.8 times over the part of the text they reach (docs/presets-and-benchmarks.md, "How much of the
  text a row length trains on"); here they were to pass about 1.6 times (they passed 2.1: this machine outran the estimate), to
  place the crossing in passes over the text rather than in seconds;
- budget-rows-300 / budget-rows-900-prose: the preset once it picks its rows from the budget
  (`--rows-for-budget`, as `now` does from then on): at 300 s on stdlib, where it should
  keep 256, and at 900 s on prose, a question no run had asked, against the same shape held at 256."""
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
    dtype: str = ""  # the compute dtype the question is asked on ("": any machine)

    def asked_on(self, dtype: str) -> bool:
        return self.dtype in ("", dtype)

    def sweep_args(self) -> list[str]:
        length = ["--max-steps", str(self.max_steps)] if self.max_steps else ["--budget", f"{self.budget:g}"]
        data = ["--data-dir", str(PROSE / "data")] if self.text == "prose" else []
        return [*length, "--shapes", ",".join(self.shapes), "--ingredients", ",".join(self.specs), "--seeds",
                ",".join(map(str, self.seeds)), "--eval-tokens", str(EVAL_TOKENS), "--text", self.text, *data,
                "--results", str(RESULTS)]

    def keys(self, host: str, dtype: str) -> list[dict]:
        length = f"{self.max_steps} steps" if self.max_steps else f"{self.budget:g}s"
        return [{"base": "cpu", "shape": shape, "ingredients": spec, "seed": str(seed), "length": length,
                 "text": self.text, "extra": "", "device": "cpu", "eval_tokens": str(EVAL_TOKENS), "host": host,
                 "dtype": dtype} for shape in self.shapes for spec in self.specs for seed in self.seeds]


PLAN = [  # in the order run, each question whole before the next: the ones that decide the preset first
    Part("shapes-300", SHAPES, ("as-is",), (1, 2)),
    Part("bars-150", ("now",), ("as-is",), (1, 2, 3), budget=150.0, minutes_per_run=4.5),
    Part("bars-150", ("nanochat-cpu",), ("off",), (1, 2, 3), budget=150.0, minutes_per_run=4.5),
    Part("shapes-900", SHAPES, ("as-is",), (1,), budget=900.0, minutes_per_run=17.0),
    Part("shapes-900", ("now",), ("as-is",), (2,), budget=900.0, minutes_per_run=17.0),
    # rows of 512 beat the preset's 256 by 0.09 at 900 s on seed 1: their second seed too
    Part("shapes-900", ("d3-w192-s512-b4k",), ("as-is",), (2,), budget=900.0, minutes_per_run=17.0),
    Part("prose-300", SHAPES, ("as-is",), (1, 2), text="prose"),
    Part("ablation", ("now",), ("off", "value-embeds", "windows", "as-is"), (1, 2)),
    Part("more-ingredients", ("now",), ("off", "as-is", "trigram", "every"), (1,)),  # trigram is on top of off
    # counts steps, not seconds: its val_bpb does not depend on the host or on what else the machine runs
    Part("larger-shape", ("d6-w384-s512-b4k",), ("off", "value-embeds+windows"), (1,), max_steps=400,
         minutes_per_run=45.0),
    # two seeds: seed 1 alone put rows of 512 ahead by only 0.009
    Part("shapes-900-fp32", ("now", "d3-w192-s512-b4k"), ("as-is",), (1, 2), budget=900.0, minutes_per_run=18.0,
         dtype="fp32"),
    # the preset with its rows picked from the budget against rows held at 256
    Part("budget-rows-300", ("rows-for-budget",), ("as-is",), (1,)),
    Part("budget-rows-900-prose", ("rows-for-budget", "rows-256"), ("as-is",), (1,), budget=900.0, text="prose",
         minutes_per_run=17.0),
    # the shape probe's wide candidate (width 384: it keeps a fast matmul unit busy), on the kind where the rule
    # does not pick it, against `now` of shapes-300 and prose-300: does the fit's ranking hold out of its sample?
    Part("wide-shape-300", ("d3-w384-s256-b4k",), ("as-is",), (1,)),
    Part("wide-shape-300", ("d3-w384-s256-b4k",), ("as-is",), (1,), text="prose"),
]
QUESTIONS = list(dict.fromkeys(part.question for part in PLAN))


def table() -> S.ResultsTable:
    return S.ResultsTable(RESULTS)


def here() -> tuple[str, str]:
    """This machine's host and compute dtype, as preset_sweep.py records them."""
    return S.host_name("cpu"), S.dtype_name("cpu", "")


def machine(row: dict) -> str:
    """The machine a line's value belongs to: its host and dtype, or its dtype alone for a fixed step count
    (lines of one question compare only within one machine)."""
    return row["dtype"] if row["length"].endswith("steps") else f"{row['host']}, {row['dtype']}"


def by_machine(question: str, rows: list[dict]) -> dict[str, list[tuple[dict, dict | None]]]:
    """Per machine that ran any of the question's runs: each planned run and its line there (or None)."""
    keys = [k for p in PLAN if p.question == question for k in p.keys("", p.dtype)]

    def answers(row: dict, key: dict) -> bool:
        return key["dtype"] in ("", row["dtype"]) and all(row[f] == key[f] for f in S.KEY_FIELDS
                                                          if f not in ("host", "dtype"))
    found: dict[str, list[tuple[dict, dict | None]]] = {}
    for row in rows:
        if any(answers(row, k) for k in keys):
            found.setdefault(machine(row), [])
    for name in found:
        for key in keys:
            match = [r for r in rows if machine(r) == name and answers(r, key)]
            found[name].append((key, match[0] if match else None))
    return found


def complete_on(question: str, rows: list[dict]) -> str | None:
    """The machine that has every run of the question, if one has."""
    return next((name for name, runs in by_machine(question, rows).items() if all(r for _, r in runs)), None)


def missing_here(question: str, rows: list[dict]) -> list[tuple[Part, dict]]:
    host, dtype = here()
    return [(part, key) for part in PLAN if part.question == question and part.asked_on(dtype)
            for key in part.keys(host, dtype) if not any(S.same_run(row, key) for row in rows)]


def asked_here(question: str) -> bool:
    return any(part.question == question and part.asked_on(here()[1]) for part in PLAN)


def status() -> None:
    rows, left_minutes = table().rows, 0.0
    print(f"this machine: {', '.join(here())}")
    for question in QUESTIONS:
        done_on = complete_on(question, rows)
        if done_on:
            print(f"{question:<17} done on {done_on}")
            continue
        if not asked_here(question):
            needs = sorted({part.dtype for part in PLAN if part.question == question})
            print(f"{question:<17} asked on a machine that computes in {', '.join(needs)}, not this one")
            continue
        left = missing_here(question, rows)
        left_minutes += sum(part.minutes_per_run for part, _ in left)
        total = sum(len(part.keys("", "")) for part in PLAN if part.question == question)
        print(f"{question:<17} {total - len(left)}/{total} runs on this machine; left: "
              f"{', '.join(k['shape'] + ' ' + k['ingredients'] + ' seed ' + k['seed'] for _, k in left)}")
    print(f"about {left_minutes / 60:.1f} hours of runs left (alone on the 2-core machine)")


def run(commit: bool, only: str | None) -> None:
    subprocess.run([sys.executable, str(REPO / "prepare.py"), "setup", "--source", "stdlib"], check=True, cwd=REPO)
    if any(part.text == "prose" and only in (None, part.question) for part in PLAN) and not (PROSE / "data").exists():
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "prose_corpus.py"), "--out", str(PROSE)], check=True)
    for question in QUESTIONS:
        if (only and question != only) or complete_on(question, table().rows):
            continue
        for part, key in missing_here(question, table().rows):  # one run per sweep: each committed at once
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
    for question in QUESTIONS:
        print(f"\n{question}")
        for name, runs in by_machine(question, rows).items():
            print(f"\non {name}{' (complete)' if all(r for _, r in runs) else ''}\n")
            print("| shape | ingredients | length | text | params | steps | tokens/s | val_bpb per seed | mean | spread |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            groups: dict = {}
            for key, row in runs:
                groups.setdefault((key["shape"], key["ingredients"], key["length"], key["text"]), []).append(row)
            for (shape, spec, length, text), found in groups.items():
                found = [r for r in found if r]
                if not found:
                    print(f"| {shape} | {spec} | {length} | {text} | not run here | | | | | |")
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
    parser.add_argument("--only", choices=QUESTIONS, default=None,
                        help="run one question's part(s) only (larger-shape counts steps, so it may share the machine)")
    args = parser.parse_args()
    {"status": status, "tables": tables}.get(args.what, lambda: run(args.commit, args.only))()
    return 0


if __name__ == "__main__":
    sys.exit(main())
