"""What isolation costs: the official evaluation (train.py's model in a worker process, logits
through shared memory) against evaluate_bpb on the same model in this process, same rows, same
checks, measured in the same run, alternating, so a shared machine's noise hits both.

    python benchmarks/eval_isolation.py [--checkpoint out/final.pt] [--max-tokens 262144] [--rounds 2]

Without a checkpoint, a freshly initialised CPU-preset model is saved and used (speed does not
depend on the weights). Both paths use the active dataset's public_val and the official context."""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import prepare  # noqa: E402
import train as T  # noqa: E402
from harness.metric import evaluate_checkpoint  # noqa: E402
from random_model import save_random_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--max-tokens", type=int, default=2**18)
    parser.add_argument("--batch-size", type=int, default=prepare.EVAL_BATCH_SIZE)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    checkpoint = args.checkpoint or save_random_checkpoint("cpu")
    tokenizer = prepare.ensure_tokenizer()
    seq = prepare.EVAL_SEQ_LEN
    times = {"in_process": [], "isolated": [], "isolated_total": []}
    numbers = {}
    for r in range(args.rounds):
        for mode in (("in_process", "isolated") if r % 2 == 0 else ("isolated", "in_process")):
            t0 = time.time()
            if mode == "in_process":
                model = T.load_for_eval(checkpoint, torch.device(args.device))
                result = prepare.evaluate_bpb(model, tokenizer, args.batch_size, seq, args.device,
                                              max_tokens=args.max_tokens)
            else:
                result = evaluate_checkpoint(REPO / "train.py", checkpoint, tokenizer, args.batch_size, seq,
                                             args.device, max_tokens=args.max_tokens)
                times["isolated_total"].append(time.time() - t0)
            times[mode].append(result["eval_seconds"])
            numbers[mode] = result["val_bpb"]
            print(f"round {r} {mode:<10}: eval {result['eval_seconds']:6.1f}s, wall {time.time() - t0:6.1f}s, "
                  f"val_bpb {result['val_bpb']:.6f}, {result['tokens']} tokens, {result['probes']} probes", flush=True)
    best = {k: min(v) for k, v in times.items()}
    print("---")
    print(f"checkpoint:              {checkpoint}")
    print(f"tokens:                  {args.max_tokens}")
    print(f"same_number:             {numbers['in_process'] == numbers['isolated']}")
    print(f"in_process_seconds:      {best['in_process']:.1f}  (best of {args.rounds})")
    print(f"isolated_seconds:        {best['isolated']:.1f}  (best of {args.rounds}; model load excluded)")
    print(f"isolated_total_seconds:  {best['isolated_total']:.1f}  (worker start and model load included)")
    print(f"isolation_overhead:      {100 * (best['isolated'] / best['in_process'] - 1):+.1f} %")


if __name__ == "__main__":
    main()
