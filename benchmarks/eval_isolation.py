"""What containment costs: the official evaluation (train.py's model in a sandboxed worker process,
logits through sealed shared memory) against the same worker without its sandbox and against
evaluate_bpb on the same model in this process: same rows, same checks, measured in the same run,
in rotating order, so a shared machine's noise hits all three.

    python benchmarks/eval_isolation.py [--checkpoint out/final.pt] [--max-tokens 262144] [--rounds 2]

Without a checkpoint, a freshly initialised CPU-preset model is saved and used (speed does not
depend on the weights). All paths use the active dataset's public_val and the official context.
Printed: the time of each, rows to result (best of the rounds; in process: the model's load excluded,
contained: both workers' start and load included), the worker's start (interpreter and imports),
the sandbox's set-up on its own, the copy of the submission, and what the second worker costs."""
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
from harness.submission import copy_submission  # noqa: E402
from random_model import save_random_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("in_process", "worker", "contained")


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
    times = {k: [] for k in (*MODES, "total", "start", "sandbox", "copy", "second_load", "second_pass")}
    numbers = {}
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            t0 = time.time()
            if mode == "in_process":
                model = T.load_for_eval(checkpoint, torch.device(args.device))
                result = prepare.evaluate_bpb(model, tokenizer, args.batch_size, seq, args.device,
                                              max_tokens=args.max_tokens)
            else:
                with copy_submission(REPO / "train.py", checkpoint) as submission:
                    copied = time.time() - t0
                    result = evaluate_checkpoint(submission, tokenizer, args.batch_size, seq, args.device,
                                                 max_tokens=args.max_tokens, use_sandbox=mode == "contained")
                if mode == "contained":
                    times["total"].append(time.time() - t0)
                    times["start"].append(result["worker_start_seconds"])
                    times["sandbox"].append(result["sandbox_seconds"])
                    times["copy"].append(copied)
                    times["second_load"].append(result["workers"][1]["load_seconds"])
                    times["second_pass"].append(result["pass_seconds"][1])
            times[mode].append(result["eval_seconds"])
            numbers[mode] = result["val_bpb"]
            print(f"round {r} {mode:<10}: eval {result['eval_seconds']:6.1f}s, wall {time.time() - t0:6.1f}s, "
                  f"val_bpb {result['val_bpb']:.6f}, {result['tokens']} tokens, {result['probes']} probes", flush=True)
    best = {k: min(v) for k, v in times.items()}
    print("---")
    print(f"checkpoint:              {checkpoint}")
    print(f"tokens:                  {args.max_tokens}")
    print(f"same_number:             {len(set(numbers.values())) == 1}")
    print(f"in_process_seconds:      {best['in_process']:.1f}  (best of {args.rounds})")
    print(f"worker_seconds:          {best['worker']:.1f}  (two workers without their sandbox; their start and load included)")
    print(f"contained_seconds:       {best['contained']:.1f}  (the official path: two sandboxed workers, start and load included)")
    print(f"contained_total_seconds: {best['total']:.1f}  (copy, worker start, sandbox and model load included)")
    print(f"worker_start_seconds:    {best['start']:.2f}  (interpreter, numpy and torch imports)")
    print(f"sandbox_setup_seconds:   {best['sandbox']:.4f}  (the rules and applying them)")
    print(f"copy_seconds:            {best['copy']:.2f}  (train.py, kernels/ and the checkpoint, hashed)")
    print(f"second_worker_seconds:   {best['second_load']:.2f} to start and load, {best['second_pass']:.1f} for its pass "
          "(the probes of the first pass's rows never run where those rows did)")
    print(f"worker_overhead:         {100 * (best['worker'] / best['in_process'] - 1):+.1f} %")
    print(f"contained_overhead:      {100 * (best['contained'] / best['in_process'] - 1):+.1f} %")


if __name__ == "__main__":
    main()
