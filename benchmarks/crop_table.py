"""How much of the training text a row length trains on: one pass over the training split, tokenized as the
loader tokenizes it (each document BOS + its tokens), packed into rows of seq_len + 1 tokens by the kit's
loader (best-fit; a document cropped to fill a row loses its rest). No training; deterministic. (The keep-rest
sampler, which kept the rest for a later row, is a recipe now: docs/recipes.md.)

    python benchmarks/crop_table.py --seq-lens 128,256,512,1024,2048                  # the active dataset
    python benchmarks/crop_table.py --seq-lens 256,512,1024 --data-dir ~/.cache/trainium-frontier/dir-prose-...

`trained` is the share of the split's tokens that land in a row (what one epoch trains on); `past row` the
share that sit at a position >= seq_len of their document (never trained at their own position)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="128,256,512,1024,2048")
    parser.add_argument("--data-dir", default=None,
                        help="a prepared dataset (FRONTIER_DATA_DIR); default: the active one")
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    if args.data_dir:
        os.environ["FRONTIER_DATA_DIR"] = str(Path(args.data_dir).expanduser().resolve())
    import numpy as np

    import prepare
    from harness.loader import pack_rows, shard_document_batches, tokenized_documents

    t0 = time.time()
    tokenizer = prepare.ensure_tokenizer()
    shards = prepare.split_shards(args.split)
    docs = [d for batch, _ in tokenized_documents(shard_document_batches(shards), tokenizer, 4) for d in batch]
    lengths = np.array([len(d) for d in docs])
    total = int(lengths.sum())
    text_bytes = sum(len(t.encode()) for texts, _ in shard_document_batches(shards) for t in texts)
    print(f"{args.split}: {len(shards)} shards of {prepare.active_dataset_dir()}, {len(docs):,} documents, "
          f"{total:,} tokens (BOS included), {text_bytes / (total - len(docs)):.2f} bytes per token, median "
          f"document {int(np.median(lengths)):,} tokens, longest {int(lengths.max()):,} ({time.time() - t0:.0f}s)")
    print("| seq_len | documents longer than a row | rows | trained | past row |")
    print("| --- | --- | --- | --- | --- |")
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        row = seq_len + 1
        kit_rows = sum(1 for _ in pack_rows([(docs, 1)], row, buffer_size=1000))
        longer = float((lengths > row).mean())
        past = float(np.clip(lengths - seq_len, 0, None).sum() / total)
        print(f"| {seq_len} | {100 * longer:.1f}% | {kit_rows:,} | {100 * kit_rows * row / total:.1f}% | "
              f"{100 * past:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
