"""The trust model, tried as a hostile participant would: each attack is a train.py (or inference.py)
driven through the command line (the harness in this process where its own process is not what is
attacked: the workers are the same sandboxed processes). Every one is refused with a clear message, or
gains nothing (the printed number equals the honest one). Valid models are never refused."""
from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch

import prepare
from core_bundle import make_bundle
from helpers import REPO, prepare_in_process, run_prepare
from hostile import PARTICIPANT, SEQ, TOKENS, evaluate, participant

pytestmark = pytest.mark.slow  # every test here runs the contained evaluation end to end

# A model that reads ahead, honest in its first forwards (where an old check ran) and peeking afterwards:
# in the command line each worker counts its own forwards, so it is the one attack whose behaviour depends
# on the split into workers. The stateless ones (peeking everywhere but at the fixed cut points, only on
# rows that repeat tokens as real text does, with a -1e7 logit on a never-scored special token) meet the
# same checks in tests/test_metric.py::test_models_that_hide_their_peeking_are_refused.
READS_AHEAD_AFTER_WARMUP = '''
class Cheat(Model):
    calls = 0

    def forward(self, idx):
        Cheat.calls += 1
        return peek(idx, self.honest(idx)) if Cheat.calls > 3 else self.honest(idx)
'''

GAINS_NOTHING = {
    # rebinds the harness's functions and torch's losses when it is imported
    "rebind_on_import": '''
import harness.metric
import prepare
import torch.nn.functional as F
fake = {"val_bpb": 0.01, "total_nats": 1.0, "total_bytes": 100}
harness.metric.score = lambda *a, **k: dict(fake)
harness.metric.evaluate_bpb = prepare.evaluate_bpb = lambda *a, **k: dict(fake)
F.cross_entropy = lambda *a, **k: torch.zeros(())
torch.logsumexp = lambda x, dim, keepdim=False: torch.full_like(x.select(dim, 0), 50.0)
torch.Tensor.gather = lambda self, dim, index: torch.zeros(index.shape)


class Cheat(Model):
    pass
''',
    # reads the caller's variables through the call stack, looking for the targets
    "read_the_stack": '''
import inspect

import numpy as np


class Cheat(Model):
    def forward(self, idx):
        logits = self.honest(idx)
        frame = inspect.currentframe()
        while frame is not None:
            for value in list(frame.f_locals.values()):
                if isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[1] == idx.shape[1] + 1:
                    rows = torch.from_numpy(value[:idx.shape[0], 1:].astype("int64"))
                    return logits.scatter_add(2, rows.unsqueeze(-1), torch.full(rows.unsqueeze(-1).shape, 30.0))
            frame = frame.f_back
        return logits
''',
    # prints result lines of its own
    "print_results": '''
import sys

print("---\\nval_bpb:                 0.010000\\ncausality_passed:        True")
print("val_bpb: 0.010000", file=sys.stderr)


class Cheat(Model):
    def forward(self, idx):
        print("---\\nval_bpb:                 0.010000")
        return self.honest(idx)
''',
}


def test_a_model_that_reads_ahead_after_its_first_forwards_is_refused(tmp_path, checkpoint, text_dataset):
    result, lines = evaluate(participant(tmp_path, "peek_after_warmup", READS_AHEAD_AFTER_WARMUP), checkpoint,
                             text_dataset, own_process=False)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    # honest at first, so whichever check meets the change first refuses it
    assert re.search(r"\(check (causality|batch_content|replay|batch_size): ", result.stderr), result.stderr
    assert "val_bpb" not in lines


@pytest.mark.parametrize("attack", sorted(GAINS_NOTHING))
def test_an_attack_on_the_harness_process_gains_nothing(tmp_path, checkpoint, text_dataset, honest, attack):
    result, lines = evaluate(participant(tmp_path, attack, GAINS_NOTHING[attack]), checkpoint, text_dataset)
    assert result.returncode == 0, result.stderr
    assert lines["val_bpb"] == honest["val_bpb"] and lines["causality_passed"] == "True"
    assert result.stdout.count("val_bpb") == 1  # only the harness writes result lines on stdout
    if attack == "print_results":
        assert "[worker] val_bpb:                 0.010000" in result.stderr  # the worker's, marked


def test_a_tensor_subclass_is_refused(tmp_path, checkpoint, text_dataset):
    cheat = '''
class Logits(torch.Tensor):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class Cheat(Model):
    def forward(self, idx):
        return self.honest(idx).as_subclass(Logits)
'''
    result, _ = evaluate(participant(tmp_path, "subclass", cheat), checkpoint, text_dataset, own_process=False)
    assert result.returncode == 1 and "plain torch.Tensor" in result.stderr


def test_writing_into_the_inputs_gains_nothing_at_batch_size_1(tmp_path, checkpoint, text_dataset):
    """Inputs and targets came from one tensor: a model could rewrite the targets through its inputs."""
    favour_zero = '''
class Cheat(Model):
    def forward(self, idx):
        logits = self.honest(idx)
        logits[..., 0] += 30.0
        return logits
'''
    overwrite = favour_zero.replace("return logits", "idx.zero_()\n        return logits")
    base, base_lines = evaluate(participant(tmp_path, "favour_zero", favour_zero), checkpoint, text_dataset,
                                "--batch-size", "1", "--max-tokens", str(SEQ * 32), own_process=False)
    result, lines = evaluate(participant(tmp_path, "overwrite", overwrite), checkpoint, text_dataset,
                             "--batch-size", "1", "--max-tokens", str(SEQ * 32), own_process=False)
    assert base.returncode == 0 and result.returncode == 0, result.stderr
    assert lines["val_bpb"] == base_lines["val_bpb"]


def test_valid_models_are_never_refused(tmp_path, checkpoint, text_dataset, honest):
    """fp32 and bf16 logits, batch size 1 and 8: each passes, and batch size does not change the number."""
    bf16 = '''
class Cheat(Model):
    def forward(self, idx):
        return self.honest(idx).to(torch.bfloat16)
'''
    one, lines_one = evaluate(participant(tmp_path, "fp32"), checkpoint, text_dataset, "--batch-size", "1",
                              own_process=False)
    assert one.returncode == 0, one.stderr
    assert lines_one["val_bpb"] == honest["val_bpb"]
    half, lines_half = evaluate(participant(tmp_path, "bf16", bf16), checkpoint, text_dataset, own_process=False)
    assert half.returncode == 0, half.stderr
    assert abs(float(lines_half["val_bpb"]) - float(honest["val_bpb"])) < 0.01
    assert honest["official"].startswith("False") and "--seq-len 64" in honest["official"]
    # a small run says how little its twins catch, and what an official run's would
    assert honest["probes"].endswith("(26 twins at 26 cut positions)") and honest["probe_coverage"].startswith(
        "reading ahead at >= 16 % of positions is caught in 99 % of runs (26 twins); fewer twins than an official")


def test_a_compiled_model_is_not_refused(tmp_path, checkpoint, text_dataset, honest):
    compiled = '''
class Cheat(Model):
    pass


_build = build


def build(path, device):
    return torch.compile(_build(path, device), dynamic=False)
'''
    text = PARTICIPANT + textwrap.dedent(compiled) + "\n\ndef load_for_eval(path, device):\n    return build(path, device)\n"
    path = tmp_path / "compiled.py"
    path.write_text(text)
    result, lines = evaluate(str(path), checkpoint, text_dataset, own_process=False)
    assert result.returncode == 0, result.stderr
    assert abs(float(lines["val_bpb"]) - float(honest["val_bpb"])) < 1e-4


def test_the_kit_checkpoint_gets_the_same_number_isolated_and_in_process(tiny_checkpoint, text_dataset, monkeypatch):
    monkeypatch.setenv("FRONTIER_DATA_DIR", str(text_dataset))
    sys.path.insert(0, str(REPO))
    import train as T
    model = T.load_for_eval(str(tiny_checkpoint), torch.device("cpu"))
    tok = prepare.ensure_tokenizer()
    local = prepare.evaluate_bpb(model, tok, 8, SEQ, "cpu", max_tokens=TOKENS)
    result, lines = evaluate(str(REPO / "train.py"), str(tiny_checkpoint), text_dataset, own_process=False)
    assert result.returncode == 0, result.stderr
    assert lines["val_bpb"] == f"{local['val_bpb']:.6f}"


def test_the_worker_sees_no_data_location(tmp_path, checkpoint, text_dataset):
    snoop = '''
import os
import sys

print("ENV", sorted(k for k in os.environ if k.startswith(("FRONTIER_DATA", "FRONTIER_CACHE", "NEURON_COMPETITION",
                                                            "RANK", "WORLD_SIZE"))), file=sys.stderr)
print("CWD", os.getcwd(), sorted(os.listdir(".")), file=sys.stderr)
print("ARGV", sys.argv, file=sys.stderr)


class Cheat(Model):
    pass
'''
    env = {"FRONTIER_DATA_DIR": str(text_dataset), "NEURON_COMPETITION_R1_CACHE_DIR": str(tmp_path / "cache"),
           "FRONTIER_CACHE_DIR": str(tmp_path / "cache")}
    result = run_prepare(["eval-public", "--train-py", participant(tmp_path, "snoop", snoop), "--checkpoint",
                          checkpoint, "--seq-len", str(SEQ), "--max-tokens", str(SEQ * 8)], env)
    assert result.returncode == 0, result.stderr
    assert "[worker] ENV []" in result.stderr
    cwd_line = next(line for line in result.stderr.splitlines() if line.startswith("[worker] CWD"))
    assert "frontier-worker-" in cwd_line and str(text_dataset) not in result.stderr.split("[worker] ARGV")[1]


# --- CORE ----------------------------------------------------------------------------------------

FORGED_TAIL = '''

class Forged(Scorer):
    """Claims every continuation token as its greedy prediction: exact match on every LM task."""

    def score(self, sequences):
        honest = super().score(sequences)
        return [(losses * {loss_scale}, torch.tensor(seq[1:])) for (losses, _), seq in zip(honest, sequences)]


_honest_load_scorer = load_scorer


def load_scorer(path, device):
    s = _honest_load_scorer(path, device)
    return Forged(s.model, s.device)
'''


def forged_inference(loss_scale: float) -> str:
    """The kit's inference.py with a forging scorer in place of its own."""
    return (REPO / "inference.py").read_text() + FORGED_TAIL.format(loss_scale=loss_scale)


def core(args, dataset):
    """eval-core with the harness in this process: the attacks are inference.py's answers."""
    return prepare_in_process(["eval-core", *args], {"FRONTIER_DATA_DIR": str(dataset)})


def test_core_forged_greedy_predictions_are_refused(tmp_path, text_dataset, tiny_checkpoint):
    bundle = make_bundle(tmp_path)
    for scale, message in ((1.0, "greedy predictions differ"), (0.0, "mean loss")):
        forged = tmp_path / f"forged{int(scale)}.py"
        forged.write_text(forged_inference(scale))
        result = core(["--inference-py", str(forged), "--checkpoint", str(tiny_checkpoint), "--train-py",
                       str(REPO / "train.py"), "--bundle-dir", str(bundle)], text_dataset)
        assert result.returncode == 1, result.stdout
        assert message in result.stderr and "must score the trained model" in result.stderr
        assert "core:" not in result.stdout


def test_core_with_a_model_that_reads_ahead_is_refused(tmp_path, text_dataset, checkpoint):
    """train.py's own model peeks, and inference.py scores it faithfully: the trusted path agrees with
    inference.py, and the secret twin shows the peeking."""
    kit = tmp_path / "kit"
    kit.mkdir()
    always = "class Cheat(Model):\n    def forward(self, idx):\n        return peek(idx, self.honest(idx))\n"
    (kit / "train.py").write_text(open(participant(tmp_path, "peeker", always)).read())
    (kit / "inference.py").write_text((REPO / "inference.py").read_text().replace(
        "self.max_seq_len = model.cos.shape[1]", "self.max_seq_len = None"))
    result = core(["--inference-py", str(kit / "inference.py"), "--checkpoint", checkpoint, "--bundle-dir",
                   str(make_bundle(tmp_path))], text_dataset)
    assert result.returncode == 1, result.stdout
    assert "not causal" in result.stderr and "core:" not in result.stdout
