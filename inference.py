"""
Phase 2: how the CORE scorer reaches your model. Yours to edit (batching, caching, kernels), as
long as it scores the model train.py trained: the harness re-scores a few prompts through
train.py's load_for_eval and refuses a mismatch.

The interface (all the harness calls):

    load_scorer(checkpoint_path: str, device: torch.device) -> scorer
    scorer.max_seq_len: int | None       longest sequence it takes; longer ones are cut from the left
    scorer.score(sequences: list[list[int]]) -> list[(losses, greedy)], one per sequence of n tokens:
        losses  float [n - 1]   losses[t] = -log p(seq[t + 1] | seq[:t + 1])
        greedy  int   [n - 1]   greedy[t] = argmax of the model's distribution for seq[t + 1]

The harness hands over all sequences of many examples at once (every choice of every example in
the chunk); this scorer sorts them by length, pads each batch on the right to a bucketed length
(a causal model's positions never see the padding) and runs as many rows per forward as fit in
MAX_BATCH_TOKENS. The largest lever left: the choices of one example share a long few-shot
prefix, which this scorer computes once per choice; a KV cache in the model would compute it once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from train import load_for_eval

MAX_BATCH_TOKENS = 16384  # tokens per forward (rows x padded length)
LENGTH_BUCKET = 64  # pad lengths up to a multiple of this, so a compiled model sees few shapes
LOSS_CHUNK_ROWS = 8  # rows whose fp32 log-softmax is materialised at once


class Scorer:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.max_seq_len = model.cos.shape[1]  # the rotary tables' length: the longest input the GPT takes

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        results: list = [None] * len(sequences)
        i = 0
        while i < len(order):
            length = -(-len(sequences[order[i]]) // LENGTH_BUCKET) * LENGTH_BUCKET
            rows = order[i:i + max(1, MAX_BATCH_TOKENS // length)]
            x = torch.zeros(len(rows), length, dtype=torch.long)
            for r, k in enumerate(rows):
                x[r, :len(sequences[k])] = torch.tensor(sequences[k])
            x = x.to(self.device)
            logits = self.model(x)[:, :-1]
            for r0 in range(0, len(rows), LOSS_CHUNK_ROWS):
                chunk = logits[r0:r0 + LOSS_CHUNK_ROWS].float()
                targets = x[r0:r0 + LOSS_CHUNK_ROWS, 1:]
                losses = -torch.gather(F.log_softmax(chunk, dim=-1), -1, targets[..., None])[..., 0]
                greedy = chunk.argmax(dim=-1)
                for r, k in enumerate(rows[r0:r0 + LOSS_CHUNK_ROWS]):
                    n = len(sequences[k]) - 1
                    results[k] = (losses[r, :n].cpu(), greedy[r, :n].cpu())
            i += len(rows)
        return results


def load_scorer(checkpoint_path: str, device: torch.device) -> Scorer:
    return Scorer(load_for_eval(checkpoint_path, device), torch.device(device))
