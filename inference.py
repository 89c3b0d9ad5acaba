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
the chunk). The choices of one example share a long prefix (the few-shot examples and the
question), so this scorer computes that prefix once per example instead of once per choice:

- it sorts the sequences, groups neighbours by their longest common prefix (prefix_groups) and
  packs each group into one row: the shared prefix, then every member's own continuation;
- one forward of the model itself runs the packed rows, with an attention mask (a continuation
  token sees the prefix and the earlier tokens of its own continuation, never another member's:
  packed_mask) and rotary positions that continue from the prefix into each continuation
  (train.py's GPT.forward takes both), so every member's logits are the ones the model computes
  for it alone;
- each member's losses and greedy predictions are read from the prefix positions and its own.

Packed rows are sorted by length, padded on the right to a bucketed length, and run as many per
forward as fit in MAX_BATCH_TOKENS; on a device that compiles a graph per shape (Neuron) the last
batch of a call is also padded to a power-of-two row count, so the model sees few shapes. When the
model's forward takes no `positions` and `attn_mask`, or a small probe at load time shows that
the packed rows do not score what model(x) does (a forward that ignores them), the scorer says so
once and scores every sequence in full (score_plain), padded in batches the same way.

Why packed rows and not a KV cache: one forward per batch, nothing kept between forwards, and the
plain path's static-shape batching; the price is attention over the whole packed row (the mask
hides most of it between continuations), where suffix passes over a cache would attend only from
each continuation. Where the time goes: a CPU profile of this scorer on the CPU preset model puts
about a third of it in matmuls and about a quarter each in attention and in the fp32 work on the
[tokens, vocab] logits (softcap, log-softmax, argmax), so a pass that fuses that work, and attention
that skips what the mask hides, are the levers a faster scorer would pull.
"""
from __future__ import annotations

import inspect
import os
import random
import sys

import torch
import torch.nn.functional as F

from train import load_for_eval

MAX_BATCH_TOKENS = 16384  # tokens per forward (rows x padded length)
LENGTH_BUCKET = 64  # pad lengths up to a multiple of this, so a compiled model sees few shapes
LOSS_CHUNK_ROWS = 8  # rows whose fp32 log-softmax is materialised at once
PREFIX_CACHE = True  # compute a prefix shared by several sequences once (False: every sequence in full)
MIN_SHARED_PREFIX = 16  # tokens two sequences must share to be packed together; fewer are not worth a longer row
MAX_ROW_TOKENS = 4096  # a packed row's length at most: bounds its [L, L] attention mask
STATIC_ROW_DEVICES = ("neuron",)  # devices that compile per shape: a last batch's rows padded to a power of two
# nats: a probe sequence's mean |packed - plain loss| at load time; low precision differs by rounding only,
# and stays well inside the harness's verification tolerance on a mean loss (VERIFY_LOSS_TOLERANCE)
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.02, torch.float16: 0.02}


# -----------------------------------------------------------------------------------------------
# Grouping: which sequences share a prefix, and how a group is packed into one row
# -----------------------------------------------------------------------------------------------

def packed_length(shared: int, lengths: list[int]) -> int:
    """Tokens in a packed row: the shared prefix once, then each member's input after it. A
    sequence of n tokens is n - 1 inputs (its last token is only ever a target)."""
    return shared + sum(n - 1 - shared for n in lengths)


def prefix_groups(sequences: list[list[int]], min_shared: int = MIN_SHARED_PREFIX,
                  max_row: int = MAX_ROW_TOKENS) -> list[tuple[int, list[int]]]:
    """Groups of sequences that share a prefix, as (shared, member indices): sequences sorted, then
    each joins its predecessor's group when the group's common prefix stays at least min_shared
    tokens, packing saves tokens, and the row stays within max_row. shared is the common prefix,
    capped so that every member keeps at least its last input after it (a lone sequence of n
    tokens: n - 1, the whole input)."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    groups: list[tuple[int, list[int]]] = []
    for i in order:
        seq = sequences[i]
        if groups:
            shared, members = groups[-1]
            lengths = [len(sequences[m]) for m in members]
            joined = min(shared, len(os.path.commonprefix([sequences[members[0]], seq])), len(seq) - 1)
            size = packed_length(joined, lengths + [len(seq)])
            if joined >= min_shared and size < packed_length(shared, lengths) + len(seq) - 1 and size <= max_row:
                groups[-1] = (joined, members + [i])
                continue
        groups.append((len(seq) - 1, [i]))
    return groups


def pack_group(sequences: list[list[int]], shared: int, members: list[int]):
    """One packed row: (tokens, positions, segments, per member its input indices in the row).
    Segment 0 is the shared prefix, segment k the continuation of the k-th member."""
    first = sequences[members[0]]
    tokens, positions, segments = list(first[:shared]), list(range(shared)), [0] * shared
    where = []
    for k, m in enumerate(members, 1):
        seq = sequences[m]
        own = list(range(len(tokens), len(tokens) + len(seq) - 1 - shared))
        where.append(list(range(shared)) + own)
        tokens += seq[shared:len(seq) - 1]
        positions += range(shared, len(seq) - 1)
        segments += [k] * len(own)
    return tokens, positions, segments, where


def bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_bucket(rows: int, most: int) -> int:
    """Rows of a batch rounded up to a power of two (at most `most`): few shapes for the last batch."""
    return min(most, 1 << (rows - 1).bit_length())


# -----------------------------------------------------------------------------------------------
# Packed rows through the model: the mask, and the probe that checks the model honours it
# -----------------------------------------------------------------------------------------------

PACKED_ROW_ARGUMENTS = ("positions", "attn_mask")  # what the model's forward must take to run packed rows


def packed_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool: token j sees token i <= j when i is in the shared prefix (segment 0) or in
    j's own segment. Padding (segment -1) sees the prefix and itself, so no row is empty."""
    L = segments.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    key, query = segments[:, None, :], segments[:, :, None]
    return (causal & ((key == 0) | (key == query)))[:, None]


def probe_sequences(vocab: int, seed: int = 0) -> list[list[int]]:
    """Random sequences in CORE's shape: three continuations of one prefix, and one alone."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    prefix = words(2 * MIN_SHARED_PREFIX + 5)
    return [prefix + words(3), prefix + words(9), prefix + words(17), words(29)]


# -----------------------------------------------------------------------------------------------
# The scorer
# -----------------------------------------------------------------------------------------------

class Scorer:
    def __init__(self, model: torch.nn.Module, device: torch.device, prefix_cache: bool = PREFIX_CACHE):
        self.model, self.device = model, device
        self.max_seq_len = model.cos.shape[1]  # the rotary tables' length: the longest input the GPT takes
        self.tokens_run = 0  # rows x padded length of every forward so far: the work, whatever the machine
        self.prefix_cache = prefix_cache and self.packing_works()

    def packing_works(self) -> bool:
        """Whether packed rows score this model: its forward takes positions and a mask, and on a probe the
        packed losses equal the plain ones. Says why not, once."""
        takes = inspect.signature(self.model.forward).parameters
        missing = [a for a in PACKED_ROW_ARGUMENTS if a not in takes]
        problem = f"the model's forward takes no {' or '.join(missing)}" if missing else ""
        if not problem:
            dtype = getattr(self.model, "compute_dtype", None) or torch.float32
            tolerance = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[torch.bfloat16])
            try:
                probe = probe_sequences(self.model.config.vocab_size)
                packed, plain = self.score_packed(probe), self.score_plain(probe)
            except Exception as e:
                problem = f"packed rows failed on a probe ({type(e).__name__}: {e})"
            else:
                diff = max(float((a[0] - b[0]).abs().mean()) for a, b in zip(packed, plain))
                if not diff <= tolerance:
                    problem = (f"on a probe its losses differ from model(x)'s by {diff:.3g} nats on average "
                               f"(tolerance {tolerance}): its forward does not honour positions and attn_mask")
            self.tokens_run = 0
        if problem:
            print(f"inference.py: prefix cache off, every sequence is scored in full: {problem}", file=sys.stderr,
                  flush=True)
        return not problem

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.score_packed(sequences) if self.prefix_cache else self.score_plain(sequences)

    @torch.no_grad()
    def score_plain(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every sequence in full through model(x): sorted by length, right-padded to a bucket (a
        causal model's positions never see the padding)."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        results: list = [None] * len(sequences)
        i = 0
        while i < len(order):
            length = bucket(len(sequences[order[i]]), LENGTH_BUCKET)
            rows = order[i:i + max(1, MAX_BATCH_TOKENS // length)]
            x = torch.zeros(len(rows), length, dtype=torch.long)
            for r, k in enumerate(rows):
                x[r, :len(sequences[k])] = torch.tensor(sequences[k])
            x = x.to(self.device)
            logits = self.model(x)[:, :-1]
            self.tokens_run += x.numel()
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

    @torch.no_grad()
    def score_packed(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each group of sequences that share a prefix as one packed row (see the module docstring)."""
        table = self.model.cos.shape[1]
        longest = max((len(s) for s in sequences), default=0)
        if longest - 1 > table:
            raise ValueError(f"a sequence of {longest} tokens exceeds the rotary tables ({table})")
        packed = [(pack_group(sequences, shared, members), members)
                  for shared, members in prefix_groups(sequences)]
        # rows that pack several sequences, then lone ones (causal attention), each longest first
        packed.sort(key=lambda p: (len(p[1]) == 1, -len(p[0][0])))
        results: list = [None] * len(sequences)
        i = 0
        while i < len(packed):
            lone = len(packed[i][1]) == 1
            length = bucket(max(1, len(packed[i][0][0])), LENGTH_BUCKET)
            most = max(1, MAX_BATCH_TOKENS // length)
            batch = [p for p in packed[i:i + most] if (len(p[1]) == 1) == lone]
            rows = row_bucket(len(batch), most) if self.device.type in STATIC_ROW_DEVICES else len(batch)
            idx = torch.zeros(rows, length, dtype=torch.long)
            positions = torch.zeros(rows, length, dtype=torch.long)
            segments = torch.full((rows, length), -1, dtype=torch.long)
            for r, ((tokens, pos, seg, _), _) in enumerate(batch):
                idx[r, :len(tokens)], positions[r, :len(pos)] = torch.tensor(tokens), torch.tensor(pos)
                segments[r, :len(seg)] = torch.tensor(seg)
            # lone rows run plain causal attention, as model(x) does; packed ones with their positions and mask
            logits = self.model(idx.to(self.device)) if lone else \
                self.model(idx.to(self.device), positions=positions.to(self.device),
                           attn_mask=packed_mask(segments.to(self.device)))
            self.tokens_run += idx.numel()
            for r0 in range(0, len(batch), LOSS_CHUNK_ROWS):
                chunk = logits[r0:r0 + LOSS_CHUNK_ROWS]
                log_probs, greedy = F.log_softmax(chunk, dim=-1), chunk.argmax(dim=-1)
                # every member's (row, input index, target) of the chunk: one gather, one copy back
                rows_, inputs, targets, owners, sizes = [], [], [], [], []
                for r, ((_, _, _, where), members) in enumerate(batch[r0:r0 + LOSS_CHUNK_ROWS]):
                    for m, w in zip(members, where):
                        rows_ += [r] * len(w)
                        inputs += w
                        targets += sequences[m][1:]
                        owners.append(m)
                        sizes.append(len(w))
                r, t, y = torch.tensor([rows_, inputs, targets], device=logits.device)
                losses, preds = (-log_probs[r, t, y]).cpu().split(sizes), greedy[r, t].cpu().split(sizes)
                for m, loss, pred in zip(owners, losses, preds):
                    results[m] = (loss, pred)
            i += len(batch)
        return results


def load_scorer(checkpoint_path: str, device: torch.device) -> Scorer:
    return Scorer(load_for_eval(checkpoint_path, device), torch.device(device))


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    parser.exit(2, "inference.py has no command line of its own: the CORE harness loads it, as in `python prepare.py "
                   "eval-core --inference-py inference.py --checkpoint out/final.pt` (--help: what it holds)\n")
