"""Every bad input is one clear line naming its cause and a non-zero exit, never a traceback: each size,
count, ratio and budget flag of train.py with a value no run can use (walked from the rules themselves),
and the bad files and commands a newcomer meets (not a checkpoint, a truncated shard, a missing source
folder, an unknown flag, a module run as a command)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import REPO, run_prepare

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402


def bad_value(name: str, rule) -> str:
    """A value the rule refuses: below 1, below 0, above 1, or not positive."""
    ok, _ = rule
    for value in ("0", "-1", "1.5", "-5"):
        try:
            if not ok(float(value)):
                return value
        except ValueError:
            continue
    raise AssertionError(f"no bad value found for {name}")


RULES = {**T.RECIPE_RULES, **{name: rule for name, rule in (("eval_tokens", T.NON_NEGATIVE),
                                                             ("save_every", T.NON_NEGATIVE),
                                                             ("peak_tflops", T.NON_NEGATIVE),
                                                             ("log_every", T.AT_LEAST_1))}}


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_size_count_ratio_and_budget_flag_refuses_a_value_no_run_can_use(name):
    flag, value = "--" + name.replace("_", "-"), bad_value(name, RULES[name])
    field_type = {f.name: str(f.type) for f in T.setting_fields()}[name]
    value = str(int(float(value))) if field_type == "int" else value
    with pytest.raises(ValueError, match=f"^{flag} {float(value) if field_type == 'float' else int(value)}: must be"):
        T.parse_command_line([flag, value])


@pytest.mark.parametrize("name", ["logit_softcap", "rope_base"])
def test_the_architectures_numbers_are_checked_with_the_model(name):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{flag} 0.0: must be positive"):
        T.model_config(T.parse_command_line([flag, "0"])[0])


def test_the_rules_cover_every_numeric_setting_but_the_seed():
    numeric = {f.name for f in T.setting_fields() if str(f.type) in ("int", "float")}
    checked_by_the_model = {"logit_softcap", "rope_base", "short_window", "n_kv_head"}
    assert numeric - set(RULES) - checked_by_the_model == {"seed"}


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--depth", "0"], "error: --depth 0: must be at least 1"),
    (["--head-dim", "3"], "heads of even size (an even --head-dim)"),
    (["--time-budget", "-5"], "error: --time-budget -5.0: must be a positive number of seconds"),
])
def test_a_bad_flag_is_one_line_and_exit_1_before_any_work(tmp_path, argv, message):
    run = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=tmp_path, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [line for line in run.stderr.strip().splitlines() if message in line]


def test_a_file_that_is_not_a_checkpoint_is_named_without_torchs_advice(tmp_path):
    path = tmp_path / "final.pt"
    torch.save({"model_state": {}, "model_config": T.GPTConfig()}, path)  # pickled code, not plain data
    with pytest.raises(ValueError) as e:
        T.load_for_eval(str(path), torch.device("cpu"))
    message = str(e.value)
    assert message.startswith(f"{path} is not a checkpoint that loads safely") and "\n" not in message
    assert "weights_only=False" not in message and "file an issue" not in message.lower()


def test_a_truncated_training_shard_is_named_with_the_fix_when_the_loader_is_made(stdlib_dataset, tmp_path, monkeypatch):
    import prepare
    dataset = tmp_path / "dataset"
    shutil.copytree(stdlib_dataset, dataset)
    shard = prepare.split_shards("train", dataset)[1]
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(dataset))
    with pytest.raises(prepare.DataError, match=rf"{shard} is not a readable parquet shard .*prepare.py setup"):
        prepare.make_dataloader(prepare.ensure_tokenizer(), 2, 32, "train", "cpu")


def test_setup_of_a_missing_folder_leaves_nothing_behind(tmp_path):
    cache = tmp_path / "cache"
    result = run_prepare(["setup", "--source", f"dir:{tmp_path / 'nonexistent'}"], {"FRONTIER_CACHE_DIR": str(cache)})
    assert result.returncode == 1 and "no such folder" in result.stderr and "Traceback" not in result.stderr
    assert not cache.exists() or not any(cache.rglob("*"))


def test_prepare_names_an_unknown_flag_and_inference_explains_itself():
    result = run_prepare(["--bogus"])
    assert result.returncode == 2 and "unrecognized argument --bogus" in result.stderr
    helped = subprocess.run([sys.executable, "inference.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert helped.returncode == 0 and "CORE scorer" in helped.stdout
    bare = subprocess.run([sys.executable, "inference.py"], cwd=REPO, capture_output=True, text=True)
    assert bare.returncode == 2 and "prepare.py eval-core" in bare.stderr and "Traceback" not in bare.stderr


def test_help_explains_every_flag_in_a_screen_or_two_and_shows_what_a_preset_sets(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        T.parse_command_line(["--help"])
    plain = capsys.readouterr().out
    with pytest.raises(SystemExit):
        T.parse_command_line(["--preset", "cpu", "--help"])
    cpu = capsys.readouterr().out
    assert len(plain.splitlines()) <= 100
    for kind in T.SETTING_KINDS:  # every field has its one-line meaning, from the comment beside it
        comments = T.field_comments(kind)
        assert all(comments.get(f.name, "").strip() for f in T.kind_fields(kind)), kind.__name__
    assert "--depth N" in plain and "(default 10)" in plain and "(cpu: 3)" in cpu and "(cpu: 300.0" in cpu
