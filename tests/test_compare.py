"""tools/compare.py: two run folders side by side, the flags that differ, one picture, and a verdict against
the seed spread measured for the preset and budget."""
from __future__ import annotations

import csv
import json
import sys

import pytest

from conftest import TINY_TRAIN_ARGS as TINY
from helpers import REPO

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402
from tools import compare as C  # noqa: E402


def test_two_runs_side_by_side_with_their_differing_flags_and_one_picture(tmp_path, train_main, capsys):
    out = tmp_path / "out"
    argv = [*TINY, "--max-steps", "6", "--log-every", "2", "--eval-tokens", "2048", "--out-dir", str(out)]
    train_main(argv)
    train_main([*argv, "--seed", "7", "--matrix-lr", "0.05"])
    (before,) = [p for p in out.iterdir() if p.name.startswith("run-")]
    capsys.readouterr()
    assert C.main([str(before), str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {line[:18].strip(): line[18:] for line in printed.splitlines()}
    assert rows["val_bpb"].split()[0] == f"{json.loads((before / 'summary.json').read_text())['val_bpb']:.4f}"
    assert "train.py's estimate, 2,0" in rows["val_bpb"] and "tokens of public_val" in rows["val_bpb"]
    assert "--matrix-lr 0.04 -> 0.05" in rows["flags that differ"] and "--seed 42 -> 7" in rows["flags that differ"]
    assert "the same" in rows["shape"] and "the same" in rows["train.py"]
    assert "no seed spread is measured for these runs" in rows["verdict:"]  # a tiny recipe is not the preset
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_that_is_not_a_run_is_one_clear_error(tmp_path, capsys):
    assert C.main([str(tmp_path), str(tmp_path)]) == 1
    assert "not a finished run folder" in capsys.readouterr().err


def preset_run(budget: float, bpb: float, seed: int = 1) -> dict:
    recipe = T.recipe_settings(T.parse_command_line(["--preset", "cpu", "--seed", str(seed)])[0])
    return {"recipe": {**recipe, "time_budget": budget, "dtype": "bf16"}, "summary": {"val_bpb": bpb},
            "report": None, "options": {}, "train_py": "x", "metrics": []}


def write_seeds(path, budget: str, values: list[float], text: str = "stdlib", dtype: str = "bf16") -> None:
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, ["base", "shape", "ingredients", "extra", "length", "dtype", "text", "seed", "val_bpb"],
                           delimiter="\t")
        if f.tell() == 0:
            w.writeheader()
        for seed, v in enumerate(values, 1):
            w.writerow({"base": "cpu", "shape": "now", "ingredients": "as-is", "extra": "", "length": budget,
                        "dtype": dtype, "text": text, "seed": seed, "val_bpb": v})


def test_the_verdict_rests_on_the_seed_spread_of_the_preset_at_that_budget(tmp_path, monkeypatch):
    table = tmp_path / "presets.tsv"
    write_seeds(table, "300s", [1.06, 1.08, 1.07])
    write_seeds(table, "300s", [1.47, 1.48, 1.475], text="prose")  # narrower: the widest spread is taken
    write_seeds(table, "300s", [1.0, 2.0, 3.0], dtype="fp32")  # another dtype: not these runs'
    write_seeds(table, "900s", [0.9, 0.91])  # too few seeds
    monkeypatch.setattr(C, "SEEDS_TSV", table)
    spread = C.seed_spread(preset_run(300.0, 1.07))
    assert spread["spread"] == pytest.approx(0.02) and spread["text"] == "stdlib" and len(spread["values"]) == 3
    assert C.seed_spread(preset_run(900.0, 1.0)) is None
    edited = preset_run(300.0, 1.07)
    edited["recipe"]["depth"] = 4  # another shape: the preset's spread does not apply
    assert C.seed_spread(edited) is None
    within = C.compare(preset_run(300.0, 1.07), preset_run(300.0, 1.055, seed=2))[1]
    beyond = C.compare(preset_run(300.0, 1.07), preset_run(300.0, 1.04, seed=2))[1]
    assert "better by 0.0150, within the seed spread" in within and "not shown to be the edit's effect" in within
    assert "better by 0.0300, beyond the seed spread" in beyond
