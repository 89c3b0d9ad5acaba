"""The optimizer's cost: eager vs compiled update, and sharded (ZeRO-1) vs replicated state across ranks.

    python benchmarks/optimizer_step.py compile --preset cpu         # tokens/s and optimizer share of the step
    python benchmarks/optimizer_step.py shard --preset cpu --ranks 2,4   # step time and state per rank (gloo)
    python benchmarks/optimizer_step.py compile --depth 2 --steps 2  # any train.py flag changes the config

`compile` trains on random tokens (throughput does not depend on the text) with the update eager,
then compiled, after warm-up steps that include compilation, and times optimizer.step() inside each
step: the eager run is the baseline of the ratios. `shard` starts torchrun with N CPU processes
(gloo) for each N and times optimizer.step() on random gradients, which there includes averaging the
gradients (nothing overlaps it: there is no backward), the update and, sharded, the all-gather of
the weights; the replicated optimizer at the same N is the baseline. State is the optimizer's
tensors (momentum, second moments, step counts) on each rank; buffers are its communication buffers."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import train as T  # noqa: E402
from tools.plan import random_batches  # noqa: E402


def new_model(recipe: T.Recipe, device: torch.device) -> T.GPT:
    torch.manual_seed(0)
    return T.build_model(T.model_config(recipe), device, recipe.dtype)


def time_training(recipe: T.Recipe, options: T.RunOptions, device_type: str, steps: int, warmup: int,
                  compiled: bool | None = None) -> dict:
    """Tokens/s of train_step, and the share of it spent in optimizer.step()."""
    profile = T.device_profile(device_type, recipe.dtype)
    device = torch.device(device_type)
    model = new_model(recipe, device)
    optimizer = T.build_optimizer(model, recipe, options, profile.compute_dtype, profile.compile_backend,
                                  compiled=compiled)
    step_model = torch.compile(model, backend=profile.compile_backend, dynamic=False) if options.compile else model
    accum = recipe.total_batch_size // (recipe.device_batch_size * recipe.seq_len)
    in_optimizer = []

    def start(*_):
        T.synchronize(device)
        in_optimizer.append(-time.perf_counter())

    def stop(*_):
        T.synchronize(device)
        in_optimizer[-1] += time.perf_counter()

    optimizer.optimizer.register_step_pre_hook(start)  # the update rule's step (one process: no communication)
    optimizer.optimizer.register_step_post_hook(stop)

    data = random_batches(recipe.device_batch_size, recipe.seq_len, device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        T.apply_schedules(optimizer, 0.1, recipe)
        T.train_step(step_model, optimizer, data, accum)
    T.synchronize(device)
    warm = time.perf_counter() - t0
    in_optimizer.clear()
    t0 = time.perf_counter()
    for k in range(steps):
        T.apply_schedules(optimizer, 0.1 + 0.8 * k / steps, recipe)  # a new value every step, as in training
        T.train_step(step_model, optimizer, data, accum)
    T.synchronize(device)
    step_s = (time.perf_counter() - t0) / steps
    return {"warmup_s": warm, "step_s": step_s, "tokens_per_second": recipe.total_batch_size / step_s,
            "optimizer_s": sum(in_optimizer) / steps, "optimizer_share": sum(in_optimizer) / steps / step_s}


def compare_compile(recipe: T.Recipe, options: T.RunOptions, device_type: str, steps: int, warmup: int) -> None:
    rows = {}
    for mode in ("off", "on"):
        rows[mode] = time_training(recipe, options, device_type, steps, warmup, compiled=mode == "on")
    base = rows["off"]
    for mode, label in (("off", "eager"), ("on", "compiled")):
        r = rows[mode]
        print(f"{label:>9}: {r['tokens_per_second']:>9,.0f} tokens/s ({r['tokens_per_second'] / base['tokens_per_second']:.2f}x) | "
              f"step {1000 * r['step_s']:7.0f} ms | optimizer {1000 * r['optimizer_s']:6.0f} ms "
              f"({r['optimizer_s'] / base['optimizer_s']:.2f}x), {100 * r['optimizer_share']:4.1f}% of the step | "
              f"warm-up {r['warmup_s']:.0f}s")


def shard_worker(recipe: T.Recipe, options: T.RunOptions, steps: int, warmup: int, out: str) -> None:
    """Under torchrun: optimizer.step() on random gradients, replicated then sharded; each rank writes JSON."""
    profile = T.device_profile("cpu", recipe.dtype)
    device, rank, world_size = T.init_distributed(profile)
    model = new_model(recipe, device)
    rows = {}
    for mode in ("off", "on"):
        optimizer = T.build_optimizer(model, recipe, options, profile.compute_dtype, profile.compile_backend,
                                      shard=mode == "on")
        torch.manual_seed(rank)
        grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
        times = []
        for k in range(warmup + steps):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            T.apply_schedules(optimizer, 0.5, recipe)
            dist.barrier()  # every rank starts the step together: the time is the step's, not a straggler's wait
            t0 = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - t0)
            if k == warmup - 1:
                optimizer.comm_seconds = 0.0
        measured = {"step_s": sum(times[warmup:]) / steps, "comm_s": optimizer.comm_seconds / steps,
                    "state_bytes": optimizer.state_bytes(),
                    "buffer_bytes": sum(t.numel() * t.element_size() for b in optimizer.buckets
                                        for t in (b.flat, b.own) if t is not None)}
        rows[mode] = measured
        for hook in optimizer._hooks:  # the next mode's optimizer hooks the same model
            hook.remove()
        model.zero_grad(set_to_none=True)
    # One file per rank, no collective after the optimizer's last: a gloo work whose tensors die in
    # its own thread aborts a process at exit (see DataParallelOptimizer._wait).
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def compare_shard(argv: list[str], ranks: list[int], params_m: float) -> None:
    for n in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                   os.path.abspath(__file__), "shard-worker", "--out", out, *argv]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"error: the {n}-rank run failed:\n{result.stderr[-3000:]}")
            ranks = [json.load(open(f"{out}.{r}")) for r in range(n)]
        rows = {mode: {k: max(r[mode][k] for r in ranks) for k in ranks[0][mode]}  # the slowest / largest rank
                for mode in ("off", "on")}
        base = rows["off"]
        for mode, label in (("off", "replicated"), ("on", "sharded")):
            r = rows[mode]
            print(f"{n} ranks {label:>10}: step {1000 * r['step_s']:7.1f} ms ({r['step_s'] / base['step_s']:.2f}x), "
                  f"waiting on communication {1000 * r['comm_s']:6.1f} ms | state {r['state_bytes'] / 2**20:6.1f} MiB "
                  f"per rank ({r['state_bytes'] / base['state_bytes']:.2f}x) | buffers {r['buffer_bytes'] / 2**20:6.1f} MiB "
                  f"| {params_m:.1f}M params")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["compile", "shard", "shard-worker"])
    parser.add_argument("--preset", choices=sorted(T.PRESETS), default=None)
    parser.add_argument("--device", default=None, help="compile: the device (default: the fastest present)")
    parser.add_argument("--ranks", default="2,4", help="shard: world sizes to run, each against its replicated baseline")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args, train_flags = parser.parse_known_args()  # other flags go to train.py: --depth 6, --dtype fp32, ...
    recipe, options, _ = T.parse_command_line((["--preset", args.preset] if args.preset else []) + train_flags)
    if args.what == "shard-worker":
        return shard_worker(recipe, options, args.steps, args.warmup, args.out)
    with torch.device("meta"):
        params_m = T.GPT(T.model_config(recipe)).num_params() / 1e6
    device_type = args.device or T.detect_device_type()
    print(f"config: preset={args.preset} depth={recipe.depth} width={T.model_config(recipe).n_embd} "
          f"params={params_m:.1f}M batch={recipe.total_batch_size} compile={options.compile} dtype={recipe.dtype} "
          f"threads={torch.get_num_threads()}")
    if args.what == "compile":
        compare_compile(recipe, options, device_type, args.steps, args.warmup)
    else:
        worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup),
                       *(["--preset", args.preset] if args.preset else []), *train_flags]
        compare_shard(worker_args, [int(n) for n in args.ranks.split(",")], params_m)


if __name__ == "__main__":
    main()
