"""`prepare.py eval-public` / `eval`: the scorer's command line."""
from __future__ import annotations

import pytest
import torch

from helpers import REPO, prepare_in_process, random_documents, run_prepare, write_shard

FIXTURE = REPO / "tests" / "fixtures" / "bigram_train.py"


def bigram_checkpoint(path):
    """Weights for tests/fixtures/bigram_train.py."""
    torch.manual_seed(0)
    torch.save({"state_dict": {"emb.weight": torch.randn(8192, 16), "head.weight": torch.randn(8192, 16) * 0.1}}, path)
    return path


@pytest.fixture
def checkpoint(tmp_path):
    return bigram_checkpoint(tmp_path / "final.pt")


def _lines(stdout: str) -> dict:
    return dict(line.split(":", 1) for line in stdout.splitlines() if ":" in line and not line.startswith("["))


@pytest.mark.slow
def test_eval_public_scores_a_checkpoint_without_running_main(tmp_path, text_dataset, checkpoint):
    env = {"FRONTIER_DATA_DIR": str(text_dataset), "SUBMISSION_MAIN_RAN_MARKER": str(tmp_path / "ran")}
    result = run_prepare(["eval-public", "--train-py", str(FIXTURE), "--checkpoint", str(checkpoint),
                          "--max-tokens", "8192", "--device", "cpu"], env)
    assert result.returncode == 0, result.stderr
    lines = {k: v.strip() for k, v in _lines(result.stdout).items()}
    assert 1 < float(lines["val_bpb"]) < 20  # near-uniform logits: ~13 bits per ~2-byte token
    assert lines["causality_passed"] == "True" and lines["eval_over_timeout"] == "False"
    assert int(lines["eval_tokens"]) > 0 and lines["eval_seq_len"] == "1024"
    assert lines["shard"].endswith("shard_00001.parquet")
    assert len(lines["checkpoint_sha256"]) == 64 and len(lines["train_py_sha256"]) == 64
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_eval_on_any_shard(tmp_path, text_dataset, checkpoint):
    shard = write_shard(tmp_path / "private.parquet", random_documents(100, seed=9))
    env = {"FRONTIER_DATA_DIR": str(text_dataset)}
    result = prepare_in_process(["eval", "--val-shard", str(shard), "--train-py", str(FIXTURE), "--checkpoint",
                                 str(checkpoint), "--max-tokens", "4096"], env)
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout)["shard"].strip() == str(shard)


@pytest.mark.slow
def test_clear_errors(tmp_path, text_dataset, checkpoint):
    env = {"FRONTIER_DATA_DIR": str(text_dataset)}
    no_hook = tmp_path / "no_hook.py"
    no_hook.write_text("import torch\nMODEL = None\n")
    broken = tmp_path / "broken.py"
    broken.write_text("def load_for_eval(path, device):\n    return (\n")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    cases = [
        (["eval-public", "--train-py", str(tmp_path / "nope.py"), "--checkpoint", str(checkpoint)], "nope.py: no such file"),
        (["eval-public", "--train-py", str(no_hook), "--checkpoint", str(checkpoint)], "defines no load_for_eval"),
        (["eval-public", "--train-py", str(broken), "--checkpoint", str(checkpoint)], "importing"),
        (["eval-public", "--train-py", str(FIXTURE), "--checkpoint", str(garbage)], "load_for_eval could not load"),
        (["eval-public", "--train-py", str(FIXTURE), "--checkpoint", str(tmp_path / "x.pt")], "x.pt: no such file"),
        (["eval", "--val-shard", str(tmp_path / "v.parquet"), "--train-py", str(FIXTURE), "--checkpoint",
          str(checkpoint)], "--val-shard"),
    ]
    for args, message in cases:
        result = prepare_in_process(args, env)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_no_dataset_set_up_is_a_clear_error(checkpoint, isolated_cache):
    result = prepare_in_process(["eval-public", "--train-py", str(FIXTURE), "--checkpoint", str(checkpoint)],
                                {"FRONTIER_CACHE_DIR": str(isolated_cache)})
    assert result.returncode == 1 and "python prepare.py setup --source stdlib" in result.stderr


@pytest.mark.parametrize("command", ["setup", "eval-public", "eval", "eval-core"])
def test_help(command, capsys):
    from harness import cli
    with pytest.raises(SystemExit) as e:  # argparse's --help
        cli.main([command, "--help"])
    assert e.value.code == 0 and "--" in capsys.readouterr().out


def two_rank_jobs(folder, request) -> list[dict]:
    """eval-public in the suite's one torchrun launch (conftest's two_ranks): the bigram scored on 2 ranks,
    and a token count that leaves a rank without a row (with a TMPDIR of its own, to see what is left)."""
    base = ["eval-public", "--train-py", str(FIXTURE), "--checkpoint", str(bigram_checkpoint(folder / "eval_cli.pt")),
            "--device", "cpu"]
    env = {"FRONTIER_DATA_DIR": str(request.getfixturevalue("text_dataset"))}
    (folder / "eval_cli_tmp").mkdir()
    return [{"name": "eval_public_2_ranks", "prepare": [*base, "--max-tokens", "16384"], "env": env},
            {"name": "eval_public_more_ranks_than_rows", "prepare": [*base, "--max-tokens", "1024"],
             "env": {**env, "TMPDIR": str(folder / "eval_cli_tmp")}}]


@pytest.mark.slow
def test_eval_public_under_torchrun_gives_the_single_process_number(text_dataset, two_ranks):
    folder, runs = two_ranks
    multi = runs["eval_public_2_ranks"]
    single = prepare_in_process(["eval-public", "--train-py", str(FIXTURE), "--checkpoint", str(folder / "eval_cli.pt"),
                                 "--max-tokens", "16384", "--device", "cpu"], {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert single.returncode == 0, single.stderr
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = _lines(single.stdout), _lines(multi.stdout)
    assert a["val_bpb"] == b["val_bpb"] and b["world_size"].strip() == "2" and multi.stdout.count("val_bpb") == 1


@pytest.mark.slow
def test_more_ranks_than_rows_is_one_clear_error_and_leaves_nothing(two_ranks):
    folder, runs = two_ranks
    result = runs["eval_public_more_ranks_than_rows"]
    assert result.returncode != 0 and "1 rows for 2 ranks" in result.stderr
    assert "Traceback" not in result.stderr.split("error:")[0] and "val_bpb" not in result.stdout
    assert [p.name for p in (folder / "eval_cli_tmp").iterdir() if p.name.startswith("frontier-")] == []


def test_an_unofficial_result_says_in_plain_words_what_that_means():
    from harness.cli import unofficial_in_plain_words
    readable = unofficial_in_plain_words(["the worker can read /usr/lib/python3.11 (scored data, or what it was "
                                          "built from, under a folder the interpreter or the system needs)"])
    assert "Python's own library" in readable and "ClimbMix" in readable and "not with the leaderboard" in readable
    other = unofficial_in_plain_words(["--max-tokens 8192 is not the official count 20971520"])
    assert "ClimbMix" not in other and other.startswith("the same computation as the official one")
