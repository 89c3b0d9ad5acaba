"""Training throughput and MFU of train.py on this machine, with the peak measured in the same run.

    python benchmarks/train_throughput.py --preset cpu                 # bf16 and fp32, compiled
    python benchmarks/train_throughput.py --preset gpu --depth 10 --dtypes bf16   # default d10, one CUDA GPU, compiled
    python benchmarks/train_throughput.py --preset cpu --aspect-ratio 128   # any train.py flag changes the config

Steps run on random tokens (throughput does not depend on the text), after warm-up steps that
include compilation. MFU = model FLOPs per token x tokens/s / peak, where the peak is the bf16
(or fp32) matmul peak measured here (CPU, see train.measure_matmul_flops) or the datasheet number
(Trainium, known GPUs). Peak memory is the process's: its peak RSS on a CPU (start-up and compilation
included), the allocator's peak on a GPU (a CPU process's peak only ever grows: the second dtype's figure
includes the first's). CPU-s is the processor time the process used per step: on a shared machine it
moves less than the wall time."""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import train as T  # noqa: E402
from tools.plan import measure_training_throughput  # noqa: E402


def run(recipe: T.Recipe, options: T.RunOptions, device_type: str, dtype: str, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    return measure_training_throughput(dataclasses.replace(recipe, dtype=dtype), options, device_type, steps, warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(T.PRESETS), default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    args, train_flags = parser.parse_known_args()  # other flags go to train.py: --depth 6, --aspect-ratio 128, ...
    recipe, options, _ = T.parse_command_line((["--preset", args.preset] if args.preset else []) + train_flags)
    if args.compile is not None:
        options.compile = args.compile
    device_type = args.device or T.detect_device_type()
    print(f"config: preset={args.preset} depth={recipe.depth} width={T.model_config(recipe).n_embd} "
          f"seq_len={recipe.seq_len} batch={recipe.total_batch_size} compile={options.compile} device={device_type} "
          f"threads={torch.get_num_threads()}")
    for dtype in args.dtypes.split(","):
        r = run(recipe, options, device_type, dtype, args.steps, args.warmup)
        print(f"{r['dtype']:>8}: {r['tokens_per_second']:>10,.0f} tokens/s | {r['step_s'] * 1000:7.0f} "
              f"ms/step ({r['cpu_step_s']:.1f} CPU-s) | {r['achieved_tflops']:.3f} TFLOP/s of {r['peak_tflops']:.3f} "
              f"peak ({r['peak_source']}) | MFU {r['mfu_percent']:.1f}% | peak memory {r['peak_memory_mb']:,.0f} MB | "
              f"warm-up {r['warmup_s']:.0f}s | {r['params_M']:.1f}M params", flush=True)


if __name__ == "__main__":
    main()
