"""The training loss alone (lm_head, softcap, cross-entropy, forward and backward): the plain path
against train.py's chunked_softcap_cross_entropy, eager and compiled, each in a process of its own.

    python benchmarks/head_loss.py                          # the former CPU preset's head: 8 x 1024 rows, width 384
    python benchmarks/head_loss.py --rows 65536 --width 640 --device cuda   # the gpu preset at depth 10

Per variant: the best wall and CPU seconds of --repeats calls after a first one (which compiles), and
the process's peak memory (peak RSS on a CPU, start-up included, so compare the growth over the
`before` figure; the allocator's peak on a GPU). Isolating the loss keeps the rest of the step, and
its noise on a shared machine, out of the comparison."""
import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import train as T  # noqa: E402


def plain_loss(h, weight, targets, cap, dtype):
    """The plain path of GPT.forward: full logits in the compute dtype, fp32 softcap, F.cross_entropy."""
    return F.cross_entropy(cap * torch.tanh((h.to(dtype) @ weight.to(dtype).T).float() / cap), targets)


def measure(args) -> str:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.rows, args.width, generator=g).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.width, generator=g) * 0.05).to(device).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.rows,), generator=g).to(device)

    def loss(h, weight, targets):
        if args.variant == "chunked":
            return T.chunked_softcap_cross_entropy(h, weight, targets, 15.0, dtype)
        return plain_loss(h, weight, targets, 15.0, dtype)

    fn = torch.compile(loss, dynamic=False) if args.compile else loss
    before = T.peak_memory_mb(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.time()
    fn(h, weight, targets).backward()
    T.synchronize(device)
    first, wall, cpu = time.time() - t0, float("inf"), float("inf")
    for _ in range(args.repeats):
        h.grad = weight.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        fn(h, weight, targets).backward()
        T.synchronize(device)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return (f"{args.variant:>7} {'compiled' if args.compile else 'eager':>8}: best {wall * 1000:7.0f} ms wall, "
            f"{cpu * 1000:7.0f} ms CPU | first call {first:.0f}s | peak memory {T.peak_memory_mb(device):,.0f} MB "
            f"(before {before:,.0f} MB)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8 * 1024)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="only compiled (--compile) or only eager (--no-compile); both by default")
    parser.add_argument("--variant", choices=["plain", "chunked"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        print(measure(args), flush=True)
        return
    print(f"rows={args.rows} width={args.width} vocab={args.vocab} dtype={args.dtype} device={args.device} "
          f"slices={T.LOSS_CHUNKS} threads={torch.get_num_threads()}", flush=True)
    for compiled in ([args.compile] if args.compile is not None else [False, True]):
        for variant in ("plain", "chunked"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant,
                            "--compile" if compiled else "--no-compile"], check=True)


if __name__ == "__main__":
    main()
