"""What a model that reads ahead at a share f of the positions could gain, and how many twins catch
it: the measurement behind the probes' coverage (harness/metric.py, PROBE_FRACTION).

A model that reads the next token at a position can put all its mass on it, so it gains at most
that position's loss. Which positions it reads ahead at is its choice, made before it reads: it
can pick them by what it sees (the prefix), so the most it can expect to gain at a share f is the
loss of the f share of positions its own prediction says are hardest (the highest entropy). No
choice gains more than the f share of positions with the highest actual loss: that is the bound,
whatever the rule. For each f this prints the share of the scored loss (= of val_bpb: the bytes
do not change) that each rule removes: positions at random (f itself), the model's hardest by its
own entropy, the hardest in fact; and how many twins catch each f in 99 % of runs.

    python benchmarks/probe_coverage.py --checkpoint out/final.pt [--max-tokens 1048576]

Uses the active dataset's public_val at the official context."""
import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import prepare  # noqa: E402
import train as T  # noqa: E402
from harness import metric as M  # noqa: E402

SHARES = (0.0005, 0.001, 0.002, 0.003, 0.0041, 0.005, 0.01)
TARGET_GAIN = 0.005  # the read-ahead an official run must catch: one that would gain 0.5 % of val_bpb


def losses_and_entropies(checkpoint: str, max_tokens: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per scored target (bytes > 0): the model's loss and the entropy of its prediction (nats)."""
    tokenizer = prepare.ensure_tokenizer()
    model = T.load_for_eval(checkpoint, torch.device("cpu"))
    rows, _ = M.evaluation_rows(tokenizer, prepare.EVAL_SEQ_LEN, max_tokens, M.scored_shards("public_val"))
    token_bytes = prepare.get_token_bytes("cpu", tokenizer).numpy()
    losses, entropies = [], []
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = torch.from_numpy(rows[i:i + batch_size].astype(np.int64))
            lp = torch.log_softmax(model(batch[:, :-1]).float(), dim=-1)
            targets = batch[:, 1:]
            loss = -lp.gather(-1, targets[..., None])[..., 0]
            entropy = -(lp.exp() * lp).sum(-1)
            counted = torch.from_numpy(token_bytes[targets.numpy()] > 0)
            losses.append(loss[counted].double().numpy())
            entropies.append(entropy[counted].double().numpy())
    return np.concatenate(losses), np.concatenate(entropies)


def share_removed(losses: np.ndarray, rank_by: np.ndarray, f: float) -> float:
    """The share of the total loss at the f share of positions ranked highest by rank_by."""
    k = max(1, int(round(f * len(losses))))
    return float(losses[np.argsort(-rank_by)[:k]].sum() / losses.sum())


def twins_to_catch(f: float) -> int:
    """The fewest twins that catch a read-ahead at share f in 99 % of runs."""
    return math.ceil(math.log(1 - M.CAUGHT_IN) / math.log(1 - f))


def largest_share_within(losses: np.ndarray, rank_by: np.ndarray, gain: float) -> float:
    """The largest share f of positions whose removal by rank_by gains at most `gain` of the loss."""
    order = np.cumsum(losses[np.argsort(-rank_by)]) / losses.sum()
    return int(np.searchsorted(order, gain, side="right")) / len(losses)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--max-tokens", type=int, default=2**20)
    parser.add_argument("--batch-size", type=int, default=prepare.EVAL_BATCH_SIZE)
    args = parser.parse_args()
    losses, entropies = losses_and_entropies(args.checkpoint, args.max_tokens, args.batch_size)
    print(f"checkpoint: {args.checkpoint}")
    print(f"scored targets: {len(losses)}, mean loss {losses.mean():.4f} nats, largest {losses.max():.2f}")
    print("share f  | gain: random | by its own entropy | hardest in fact | twins for 99 %")
    for f in SHARES:
        print(f"{100 * f:6.3f} % | {100 * f:11.3f} % | {100 * share_removed(losses, entropies, f):17.3f} % | "
              f"{100 * share_removed(losses, losses, f):14.3f} % | {twins_to_catch(f):>6}")
    official = M.official_twins()
    caught = M.read_ahead_caught(official)
    print(f"official run: {official} twins catch >= {100 * caught:.3g} % in 99 % of runs; a read-ahead there gains "
          f"at most {100 * share_removed(losses, entropies, caught):.3g} % (by its own entropy), "
          f"{100 * share_removed(losses, losses, caught):.3g} % (the hardest in fact)")
    for name, rank_by in (("by its own entropy", entropies), ("the hardest in fact", losses)):
        f = largest_share_within(losses, rank_by, TARGET_GAIN)
        print(f"to catch every read-ahead that gains {100 * TARGET_GAIN:g} % ({name}: f = {100 * f:.3g} %): "
              f"{twins_to_catch(f)} twins")


if __name__ == "__main__":
    main()
