"""Training throughput and MFU of train.py on this machine, with the peak measured in the same run.

    python benchmarks/train_throughput.py --preset cpu                 # bf16 and fp32, compiled
    python benchmarks/train_throughput.py --device cuda --steps 20     # the default depth-10 config on a GPU
    python benchmarks/train_throughput.py --preset cpu --aspect-ratio 128   # any train.py flag changes the config

Steps run on random tokens (throughput does not depend on the text), after warm-up steps that
include compilation. MFU = model FLOPs per token x tokens/s / peak, where the peak is a large bf16
(or fp32) matmul timed here (CPU) or the datasheet number (Trainium, known GPUs)."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import train as T  # noqa: E402


def run(hp: T.Hyperparameters, device_type: str, dtype: str, steps: int, warmup: int) -> dict:
    profile = T.device_profile(device_type, dtype)
    device = torch.device(device_type)
    torch.manual_seed(0)
    model = T.GPT(T.model_config(hp)).to(device)
    model.init_weights()
    model.compute_dtype = profile.compute_dtype
    optimizer = T.build_optimizer(model, hp, ns_dtype=profile.compute_dtype, compile_backend=profile.compile_backend)
    step_model = torch.compile(model, backend=profile.compile_backend, dynamic=False) if hp.compile else model
    accum = hp.total_batch_size // (hp.device_batch_size * hp.seq_len)

    def batches():
        while True:
            x = torch.randint(0, 8183, (hp.device_batch_size, hp.seq_len + 1), device=device)
            yield x[:, :-1], x[:, 1:], {}

    data = batches()
    t0 = time.time()
    for _ in range(warmup):
        T.train_step(step_model, optimizer, data, accum, 1)
    T.synchronize(device)
    warm = time.time() - t0
    t0 = time.time()
    for _ in range(steps):
        T.train_step(step_model, optimizer, data, accum, 1)
    T.synchronize(device)
    dt = (time.time() - t0) / steps
    tok_s = hp.total_batch_size / dt
    return {"dtype": str(profile.compute_dtype or torch.float32).replace("torch.", ""), "warmup_s": warm,
            "step_s": dt, "tokens_per_second": tok_s, "peak_tflops": profile.peak_flops / 1e12,
            "peak_source": profile.peak_source, "achieved_tflops": model.flops_per_token() * tok_s / 1e12,
            "mfu_percent": 100 * model.flops_per_token() * tok_s / profile.peak_flops,
            "params_M": model.num_params() / 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(T.PRESETS), default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    args, train_flags = parser.parse_known_args()  # other flags go to train.py: --depth 6, --aspect-ratio 128, ...
    hp = T.parse_hyperparameters((["--preset", args.preset] if args.preset else []) + train_flags)
    if args.compile is not None:
        hp.compile = args.compile
    device_type = args.device or T.detect_device_type()
    print(f"config: preset={args.preset} depth={hp.depth} width={T.model_config(hp).n_embd} seq_len={hp.seq_len} "
          f"batch={hp.total_batch_size} compile={hp.compile} device={device_type} threads={torch.get_num_threads()}")
    for dtype in args.dtypes.split(","):
        r = run(hp, device_type, dtype, args.steps, args.warmup)
        print(f"{r['dtype']:>8}: {r['tokens_per_second']:>10,.0f} tokens/s | {r['step_s'] * 1000:7.0f} ms/step | "
              f"{r['achieved_tflops']:.3f} TFLOP/s of {r['peak_tflops']:.3f} peak ({r['peak_source']}) | "
              f"MFU {r['mfu_percent']:.1f}% | warm-up {r['warmup_s']:.0f}s | {r['params_M']:.1f}M params")


if __name__ == "__main__":
    main()
