"""train.py speaks the organisers' dialect too: their flag names and environment variables (the
command line wins), their defaults, their checkpoint keys, and their summary key names."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY_TRAIN_ARGS as TINY
from helpers import REPO, every_ingredient, flags_for

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402
from test_train import summary  # noqa: E402

OFFICIAL_ENV = ("NEURON_COMPETITION_R1_NUM_STEPS", "NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS",
                "NEURON_COMPETITION_R1_COMPILE", "NEURON_COMPETITION_R1_NKI_RELU2", "NEURON_COMPETITION_R1_OUT_DIR",
                "NEURON_COMPETITION_R1_EVAL_PUBLIC", "NEURON_COMPETITION_R1_EVAL_TOKENS", "FRONTIER_OUT_DIR",
                "FRONTIER_EVAL_PUBLIC", "FRONTIER_EVAL_TOKENS")


@pytest.fixture(autouse=True)
def no_official_environment(monkeypatch):
    for var in OFFICIAL_ENV:
        monkeypatch.delenv(var, raising=False)


def test_official_flag_names_set_the_same_hyperparameters():
    theirs = T.parse_command_line(["--num-steps", "7", "--max-train-seconds", "99", "--device-type", "cpu",
                                   "--no-eval-public", "--eval-tokens", "4096", "--compile", "--nki-relu2",
                                   "--out-dir", "elsewhere"])
    recipe, options, _ = theirs
    assert (recipe.max_steps, recipe.time_budget, options.device) == (7, 99.0, "cpu")
    assert (options.eval_public, options.eval_tokens) == (False, 4096)
    assert options.compile and options.nki_relu2 and options.out_dir == "elsewhere"
    ours = T.parse_command_line(["--max-steps", "7", "--time-budget", "99", "--device", "cpu", "--no-eval-public",
                                 "--eval-tokens", "4096", "--compile", "--nki-relu2", "--out-dir", "elsewhere"])
    assert theirs == ours


def test_defaults_participants_rely_on():
    options = T.RunOptions()
    assert options.eval_tokens == 2_097_152 == 4 * 524_288 and options.eval_public and options.out_dir == "out"


def test_the_harness_environment_sets_the_output_and_the_evaluation(monkeypatch):
    """NEURON_COMPETITION_R1_{OUT_DIR,EVAL_PUBLIC,EVAL_TOKENS} (or the kit's FRONTIER_ names), which the
    organisers' prepare.py reads: train.py writes where `prepare.py eval-public` looks."""
    monkeypatch.setenv("NEURON_COMPETITION_R1_OUT_DIR", "runs/7")
    monkeypatch.setenv("NEURON_COMPETITION_R1_EVAL_PUBLIC", "0")
    monkeypatch.setenv("FRONTIER_EVAL_TOKENS", "8192")
    _, options, notes = T.parse_command_line([])
    assert (options.out_dir, options.eval_public, options.eval_tokens) == ("runs/7", False, 8192)
    assert "environment: NEURON_COMPETITION_R1_OUT_DIR=runs/7 sets --out-dir" in notes
    assert "environment: FRONTIER_EVAL_TOKENS=8192 sets --eval-tokens" in notes
    options = T.parse_command_line(["--out-dir", "mine", "--eval-public", "--eval-tokens", "0"])[1]
    assert (options.out_dir, options.eval_public, options.eval_tokens) == ("mine", True, 0)


def test_the_kits_and_the_organisers_names_of_a_setting_must_agree(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_COMPETITION_R1_OUT_DIR", "runs/7")
    monkeypatch.setenv("FRONTIER_OUT_DIR", "runs/7")
    assert T.parse_command_line([])[1].out_dir == "runs/7"  # both set, the same: fine
    monkeypatch.setenv("FRONTIER_OUT_DIR", "runs/8")
    with pytest.raises(SystemExit) as e:
        T.parse_command_line([])
    assert e.value.code == 2 and "disagree" in capsys.readouterr().err


def test_official_environment_variables_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("NEURON_COMPETITION_R1_NUM_STEPS", "12")
    monkeypatch.setenv("NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS", "600.5")
    monkeypatch.setenv("NEURON_COMPETITION_R1_COMPILE", "1")
    monkeypatch.setenv("NEURON_COMPETITION_R1_NKI_RELU2", "true")
    recipe, options, notes = T.parse_command_line([])
    assert (recipe.max_steps, recipe.time_budget, options.compile, options.nki_relu2) == (12, 600.5, True, True)
    assert "environment: NEURON_COMPETITION_R1_NUM_STEPS=12 sets --max-steps" in notes
    recipe, options, notes = T.parse_command_line(["--num-steps", "3", "--time-budget", "60", "--no-compile",
                                                   "--no-nki-relu2"])
    assert (recipe.max_steps, recipe.time_budget, options.compile, options.nki_relu2) == (3, 60.0, False, False)
    assert all(n.endswith("(overridden by the command line)") for n in notes) and len(notes) == 4
    monkeypatch.setenv("NEURON_COMPETITION_R1_COMPILE", "off")
    assert T.parse_command_line(["--preset", "cpu"])[1].compile is False  # the environment beats the preset


@pytest.mark.parametrize("var, value", [("NEURON_COMPETITION_R1_NUM_STEPS", "ten"),
                                        ("NEURON_COMPETITION_R1_COMPILE", "maybe"),
                                        ("NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS", "30m")])
def test_bad_environment_value_is_a_clear_error(monkeypatch, capsys, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        T.parse_command_line([])
    assert e.value.code == 2 and f"{var}={value!r} is not" in capsys.readouterr().err


def test_help_shows_both_spellings_once(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    text = T.build_parser().format_help()
    for ours, theirs, metavar in (("--max-steps", "--num-steps", "N"), ("--time-budget", "--max-train-seconds", "X"),
                                  ("--device", "--device-type", "TEXT")):
        assert text.count(f"{ours} {metavar}, {theirs} {metavar}") == 1, ours
        assert text.count(theirs + " ") == 1, theirs
    for var in OFFICIAL_ENV:
        assert text.count(var) == 1, var
    for flag in ("--eval-public, --no-eval-public", "--eval-tokens", "--compile, --no-compile", "--nki-relu2",
                 "--out-dir"):
        assert flag in text


def run_instrumented(tmp_path, args, env_extra, name):
    records = tmp_path / f"records-{name}"
    records.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in OFFICIAL_ENV}
    env.update(env_extra, PYTHONPATH=str(REPO), RECORD_DIR=str(records))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "fixtures" / "instrumented_train.py"), *args],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    record = json.loads((records / "rank0.json").read_text())
    return result, record


@pytest.mark.slow
def test_official_environment_changes_the_run(tmp_path, text_dataset):
    """The four variables of the organisers' train.py, then the same flags on the command line, which win."""
    data = {"FRONTIER_DATA_DIR": str(text_dataset)}
    base = [a for a in TINY if a not in ("--eval-tokens", "4096", "--device", "cpu")]
    result, record = run_instrumented(tmp_path, [*base, "--device-type", "cpu", "--eval-tokens", "2048",
                                                 "--out-dir", str(tmp_path / "a")],
                                      {**data, "NEURON_COMPETITION_R1_NUM_STEPS": "3",
                                       "NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS": "600",
                                       "NEURON_COMPETITION_R1_COMPILE": "1"}, "env")
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(result.stdout)
    assert s["num_steps"] == "3" and s["budget_seconds"] == "600" and s["device"] == "cpu x 1"
    model_compiles = [c for c in record["compile"] if not c.get("fullgraph")]  # the rest: the optimizer's update
    assert model_compiles == [{"backend": "inductor", "dynamic": False}]
    assert math.isfinite(float(s["val_bpb"])) and int(s["eval_tokens"]) <= 2048
    assert [c["max_tokens"] for c in record["evaluate_bpb"]] == [2048]
    assert record["ledger_last_step"] == 2  # the harness's ledger took steps 0, 1, 2 (it refuses any other order)
    assert "environment: NEURON_COMPETITION_R1_NUM_STEPS=3 sets --max-steps" in result.stdout
    assert (tmp_path / "a" / "final.pt").exists()

    result, record = run_instrumented(tmp_path, [*base, "--num-steps", "2", "--no-compile", "--no-eval-public",
                                                 "--max-train-seconds", "300", "--out-dir", str(tmp_path / "b")],
                                      {**data, "NEURON_COMPETITION_R1_NUM_STEPS": "50",
                                       "NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS": "600",
                                       "NEURON_COMPETITION_R1_COMPILE": "yes"}, "flags")
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(result.stdout)
    assert s["num_steps"] == "2" and s["budget_seconds"] == "300" and "val_bpb" not in s
    assert record["compile"] == [] and record["evaluate_bpb"] == []
    assert "(overridden by the command line)" in result.stdout and (tmp_path / "b" / "final.pt").exists()

    env = dict(os.environ, **data, PYTHONPATH=str(REPO), NEURON_COMPETITION_R1_NKI_RELU2="1")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 1 and "--nki-relu2 run NKI kernels" in result.stderr  # the variable took effect


def test_summary_prints_the_official_names_and_the_median_step(tiny_training):
    s = summary(tiny_training[1])
    assert s["charged_seconds_est"] == s["charged_seconds"] and s["startup_allowance_est"] == s["startup_seconds"]
    for key in ("training_seconds", "over_budget", "num_steps"):
        assert key in s
    assert 0 < float(s["median_step_seconds"]) < float(s["startup_seconds"])


def test_checkpoint_has_the_official_keys(tiny_checkpoint):
    payload = torch.load(tiny_checkpoint, weights_only=True)
    assert set(payload) == {"format", "model_state", "model_config", "meta"}
    assert payload["format"] == T.CHECKPOINT_FORMAT
    assert payload["meta"]["step"] == 60 and payload["meta"]["total_train_tokens"] == 60 * 1024


def test_load_for_eval_reads_the_organisers_layout_too(tiny_checkpoint, tmp_path):
    payload = torch.load(tiny_checkpoint, weights_only=True)
    official = {k: payload[k] for k in ("model_state", "model_config", "meta")}  # the organisers' file: no tag
    x = torch.randint(0, 8000, (2, 32))
    reference = T.load_for_eval(str(tiny_checkpoint), torch.device("cpu"))(x)
    torch.save(official, tmp_path / "official.pt")
    assert torch.equal(T.load_for_eval(str(tmp_path / "official.pt"), torch.device("cpu"))(x), reference)

    partial = dict(official, model_state={k: v for k, v in payload["model_state"].items() if "lm_head" not in k})
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="does not fit this train.py's GPT"):  # a strict load
        T.load_for_eval(str(tmp_path / "partial.pt"), torch.device("cpu"))
    torch.save(dict(official, model_config=T.GPTConfig(**payload["model_config"])), tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match="is not a checkpoint that loads safely"):  # weights_only=True
        T.load_for_eval(str(tmp_path / "pickled.pt"), torch.device("cpu"))
    torch.save({"weights": payload["model_state"]}, tmp_path / "unknown.pt")
    with pytest.raises(ValueError, match=r"has format None and keys \['weights'\]"):
        T.load_for_eval(str(tmp_path / "unknown.pt"), torch.device("cpu"))


# The prepare.py names a train.py written for the organisers' kit may import (KIT.md section 3).
ORGANISERS_NAMES = ("TOKENIZER_VOCAB_SIZE", "TRAIN_TIME_BUDGET_SECONDS", "TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS",
                    "TRAIN_STARTUP_STEPS_EXCLUDED", "EVAL_TIMEOUT_SECONDS", "get_dist_info", "print0", "Tokenizer",
                    "ensure_tokenizer", "get_token_bytes", "make_dataloader", "_row_groups_for_split",
                    "_document_batches", "record_step_boundary", "evaluate_bpb", "causality_check")

STAND_IN_PREPARE = '''"""A stand-in for the organisers' prepare.py: exactly the names their train.py files import, served by
the kit's harness (whose folder comes after this one on sys.path, so `prepare` is this file)."""
import sys
sys.path.append({kit!r})
from harness.common import get_dist_info, print0
from harness.config import (EVAL_TIMEOUT_SECONDS, TOKENIZER_VOCAB_SIZE, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS,
                            TRAIN_STARTUP_STEPS_EXCLUDED, TRAIN_TIME_BUDGET_SECONDS)
from harness.ledger import record_step_boundary
from harness.loader import _document_batches, _row_groups_for_split, make_dataloader
from harness.metric import causality_check, evaluate_bpb
from harness.tokenizer import Tokenizer, ensure_tokenizer, get_token_bytes
del sys
'''


def test_train_py_imports_only_the_organisers_names_from_prepare():
    import ast
    tree = ast.parse((REPO / "train.py").read_text())
    imported = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "prepare"
                for a in node.names]
    assert imported and set(imported) <= set(ORGANISERS_NAMES), sorted(set(imported) - set(ORGANISERS_NAMES))
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import)
                and any(a.name in ("prepare", "harness") or a.name.startswith("harness.") for a in node.names)]


sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

EVERY_INGREDIENT = flags_for(every_ingredient())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [[], EVERY_INGREDIENT], ids=["baseline", "every-ingredient"])
def test_train_py_runs_under_a_prepare_py_with_only_the_organisers_names(tmp_path, text_dataset, recipe):
    """train.py alone in a folder (no kernels/, no harness/ beside it) with a prepare.py that has only the
    organisers' names: it trains a few steps, prints its own budget figures, writes out/final.pt where the
    organisers' environment says, and its load_for_eval reads the checkpoint back; with every ingredient as
    well."""
    kit = tmp_path / "organisers_kit"
    kit.mkdir()
    (kit / "train.py").write_text((REPO / "train.py").read_text())
    (kit / "prepare.py").write_text(STAND_IN_PREPARE.format(kit=str(REPO)))
    out = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k not in OFFICIAL_ENV and k != "PYTHONPATH"}
    env.update(FRONTIER_DATA_DIR=str(text_dataset), NEURON_COMPETITION_R1_OUT_DIR=str(out),
               NEURON_COMPETITION_R1_NUM_STEPS="7")
    args = [a for a in TINY if a not in ("--eval-tokens", "4096")] + ["--eval-tokens", "2048", "--dtype", "fp32",
                                                                      *recipe]
    run = subprocess.run([sys.executable, "train.py", *args], cwd=kit, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    s = summary(run.stdout)
    assert s["num_steps"] == "7" and s["over_budget"] == "False" and math.isfinite(float(s["val_bpb"]))
    assert float(s["charged_seconds_est"]) >= 0 and float(s["startup_allowance_est"]) > 0
    assert float(s["median_step_seconds"]) > 0  # steps 5 and 6 came after the start-up's five
    load = ("import sys, torch; sys.path.insert(0, '.'); import train; "
            f"m = train.load_for_eval({str(out / 'final.pt')!r}, torch.device('cpu')); "
            "print(tuple(m(torch.randint(0, 8000, (2, 16))).shape), not m.training)")
    loaded = subprocess.run([sys.executable, "-c", load], cwd=kit, env=env, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["(2,", "16,", "8192)", "True"]
    assert sorted(p.name for p in kit.iterdir() if p.name != "__pycache__") == ["prepare.py", "train.py"]
