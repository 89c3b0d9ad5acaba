"""Hostile participants for the trust and containment tests: an honest low-rank bigram train.py,
cheats written as subclasses of it (or as code that runs when it is imported), and the command
lines that score them."""
from __future__ import annotations

import textwrap

from helpers import prepare_in_process, run_prepare

SEQ = 64  # a short context keeps every run fast; it is reported as unofficial, the checks are the same
TOKENS = SEQ * 160

PARTICIPANT = '''
import torch
import torch.nn as nn

from prepare import TOKENIZER_VOCAB_SIZE as V


class Model(nn.Module):
    """A low-rank bigram: logits[t] depend on token t only (honest)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V, bias=False)

    def honest(self, idx):
        return self.head(self.emb(idx))

    def forward(self, idx):
        return self.honest(idx)


def peek(idx, logits, strength=10.0):
    """Mass on the *next* input token, which position t must not see."""
    nxt = torch.roll(idx, -1, dims=1)
    return logits.scatter_add(2, nxt.unsqueeze(-1), torch.full(nxt.unsqueeze(-1).shape, strength))


def build(path, device):
    model = Model()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
    return model.to(device).eval().requires_grad_(False)


def load_for_eval(path, device):
    return build(path, device)
'''

def participant(tmp_path, name: str, cheat: str | None = None) -> str:
    """A train.py: the honest bigram, or one whose load_for_eval returns `Cheat`."""
    text = PARTICIPANT + textwrap.dedent(cheat or "")
    if cheat:
        text += "\n\ndef load_for_eval(path, device):\n    model = Cheat()\n" \
                "    model.load_state_dict(torch.load(path, map_location='cpu', weights_only=True)['state_dict'])\n" \
                "    return model.to(device).eval().requires_grad_(False)\n"
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


def evaluate(train_py, checkpoint, dataset, *extra, command=("eval-public",), env=None, own_process=True):
    """(the completed `prepare.py eval-public` run, its result lines) at the short test context. With
    own_process=False the harness runs in this process (prepare_in_process): for an attack on the
    checks or through the worker's answers, where the harness's own process is not what is attacked
    (its workers are the same sandboxed processes)."""
    run = run_prepare if own_process else prepare_in_process
    result = run([*command, "--train-py", train_py, "--checkpoint", checkpoint, "--device", "cpu",
                  "--seq-len", str(SEQ), "--max-tokens", str(TOKENS), *extra],
                 {"FRONTIER_DATA_DIR": str(dataset), **(env or {})})
    lines = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in result.stdout.splitlines()
                                               if ":" in line and not line.startswith("["))}
    return result, lines
