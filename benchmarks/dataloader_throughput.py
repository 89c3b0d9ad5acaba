"""Tokens per second of one make_dataloader process (read + tokenize + pack), on the active dataset.

    python benchmarks/dataloader_throughput.py [--seq-len 2048] [--batch-size 8] [--seconds 30]

A Trainium rank at the top of the Phase 1 leaderboard consumes ~70K tokens/s, so one loader
process must deliver well above that (target: 150K tokens/s)."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import prepare  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=4, help="tokenizer threads")
    args = parser.parse_args()
    tokenizer = prepare.ensure_tokenizer()
    loader = prepare.make_dataloader(tokenizer, args.batch_size, args.seq_len, "train", "cpu",
                                     tokenizer_threads=args.threads, prefetch=1)
    next(loader)  # start-up: first shard open, buffer fill
    t0, tokens, state = time.time(), 0, None
    while time.time() - t0 < args.seconds:
        x, _, state = next(loader)
        tokens += x.numel()
    dt = time.time() - t0
    print(f"dataset:        {prepare.active_dataset_dir()}")
    print(f"seq_len:        {args.seq_len}")
    print(f"batch_size:     {args.batch_size}")
    print(f"cpu_cores:      {os.cpu_count()}")
    print(f"tokens:         {tokens}")
    print(f"seconds:        {dt:.1f}")
    print(f"epoch:          {state['epoch']}")
    print(f"tokens_per_sec: {tokens / dt:,.0f}")


if __name__ == "__main__":
    main()
