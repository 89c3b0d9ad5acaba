"""Where a preset's steady training step goes on this machine: the step timed on the real data loader and on
random tokens (the loader's share), then torch.profiler over steps after warm-up (compilation), each op's
time on the training thread grouped into what it is, and the gaps between ops (Python and dispatch).

    python benchmarks/step_profile.py --preset cpu                   # in the dtype a run takes here (--dtype auto)
    python benchmarks/step_profile.py --preset cpu --dtype fp32      # any train.py flag changes the run

Run it alone. It profiles the shape the flags give; the loader's share needs a prepared dataset (`python prepare.py
setup --source stdlib`). MFU = model FLOPs per token x tokens/s / the peak measured here."""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import train as T  # noqa: E402
from tools import plan as P  # noqa: E402

# What an op is, by its name (first match wins); inductor's fused kernels are named when it profiles them.
CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
                "mkldnn", "onednn", "aten::_weight_int")),
    ("attention", ("scaled_dot_product", "flash_attention", "flex_attention", "efficient_attention")),
    ("fused elementwise and reductions (inductor kernels)", ("cpp_fused", "kernel_cpp")),
    ("copies, fills and allocation", ("copy", "clone", "contiguous", "aten::to", "empty", "zero", "fill",
                                      "aten::cat", "aten::stack", "aten::unbind", "as_strided", "aten::view")),
)
REGIONS = ("data", "forward + backward", "optimizer", "zero_grad")


def category(name: str) -> str:
    return next((what for what, keys in CATEGORIES if any(k in name for k in keys)), "other ops")


def profiled_step(model, optimizer, batches, accumulation: int) -> None:
    """train.T.train_step, with each part a profiler region."""
    for _ in range(accumulation):
        with record_function("data"):
            x, y, _ = next(batches)
        with record_function("forward + backward"):
            (model(x, y) / accumulation).backward()
    with record_function("optimizer"):
        optimizer.step()
    with record_function("zero_grad"):
        model.zero_grad(set_to_none=True)


def seconds_per_step(model, optimizer, batches, accumulation: int, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        T.train_step(model, optimizer, batches, accumulation)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps timed, and steps profiled")
    parser.add_argument("--warmup", type=int, default=5, help="steps before (compilation)")
    parser.add_argument("--top", type=int, default=12, help="ops listed by time")
    args, train_flags = parser.parse_known_args()
    recipe, options, _ = T.parse_command_line(train_flags)
    torch._inductor.config.cpp.enable_kernel_profile = True  # name inductor's kernels in the profile
    device_type = options.device if options.device not in ("", "auto") else T.detect_device_type()
    prof = T.device_profile_for(recipe, device_type, options.peak_tflops)
    device = torch.device(device_type)
    torch.manual_seed(recipe.seed)
    model = T.build_model(T.model_config(recipe), device, T.dtype_name(prof.compute_dtype))
    optimizer = T.build_optimizer(model, recipe, options, prof.compute_dtype, prof.compile_backend)
    step_model = torch.compile(model, backend=prof.compile_backend, dynamic=False) if options.compile else model
    geometry = T.batch_geometry(recipe.total_batch_size, recipe.device_batch_size, recipe.seq_len, 1)
    accumulation = geometry.grad_accum_steps
    print(f"{recipe.depth} layers, rows of {recipe.seq_len}, {geometry.device_batch_size} rows x {accumulation} "
          f"micro-batches, {prof.compute_dtype or torch.float32}, compile {options.compile}, "
          f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"peak {prof.peak_flops / 1e12:.3f} TFLOP/s ({prof.peak_source})", flush=True)

    fake = P.random_batches(geometry.device_batch_size, recipe.seq_len, device)
    seconds_per_step(step_model, optimizer, fake, accumulation, args.warmup)
    rows = [("random tokens", fake)]
    try:
        tokenizer = T.ensure_tokenizer()
        rows.append(("the data loader", T.training_batches(recipe, tokenizer, geometry.device_batch_size, device, 0)))
    except Exception as e:  # no dataset here: the random-token figure alone
        print(f"(no data loader: {e})")
    flops = model.flops_per_token() * recipe.total_batch_size
    print("\n| batches from | step (ms, median) | tokens/s | MFU |\n| --- | --- | --- | --- |")
    for name, batches in rows:
        seconds_per_step(step_model, optimizer, batches, accumulation, 2)  # the loader's start
        step = seconds_per_step(step_model, optimizer, batches, accumulation, args.steps)
        print(f"| {name} | {1000 * step:.0f} | {recipe.total_batch_size / step:,.0f} | "
              f"{100 * flops / step / prof.peak_flops:.1f} % |", flush=True)

    batches = rows[-1][1]
    with profile(activities=[ProfilerActivity.CPU]) as p:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            profiled_step(step_model, optimizer, batches, accumulation)
        wall = (time.perf_counter() - t0) / args.steps
    events = p.events()
    events = [e for e in events if e.thread == events[0].thread]  # the training thread's
    region = {e.id: e.name for e in events if e.name in REGIONS}
    spans = collections.Counter()
    for e in events:
        if e.name in REGIONS:
            spans[e.name] += e.time_range.elapsed_us() / 1e6 / args.steps
    by_kind, by_op = collections.defaultdict(collections.Counter), collections.Counter()
    for e in events:
        if e.name in REGIONS or e.name.startswith(("ProfilerStep", "Torch-Compiled Region", "CompiledFunction")):
            continue
        parent = e.cpu_parent
        while parent is not None and parent.id not in region:
            parent = parent.cpu_parent
        where = region.get(parent.id, "outside the regions") if parent is not None else "outside the regions"
        self_seconds = e.self_cpu_time_total / 1e6 / args.steps
        by_kind[where][category(e.name)] += self_seconds
        by_op[e.name] += self_seconds
    print(f"\nprofiled step: {1000 * wall:.0f} ms (the profiler's own cost included)\n")
    print("| region | kind | ms per step | share of the step |\n| --- | --- | --- | --- |")
    for name in REGIONS:
        ops = sum(by_kind[name].values())
        for kind, seconds in by_kind[name].most_common():
            print(f"| {name} | {kind} | {1000 * seconds:.1f} | {100 * seconds / wall:.1f} % |")
        print(f"| {name} | between ops (Python, dispatch, waiting) | {1000 * (spans[name] - ops):.1f} | "
              f"{100 * (spans[name] - ops) / wall:.1f} % |")
    outside = wall - sum(spans.values())
    print(f"| outside the regions | (the loop) | {1000 * outside:.1f} | {100 * outside / wall:.1f} % |")
    print(f"\n| op (top {args.top} by time on the training thread) | ms per step |\n| --- | --- |")
    for name, seconds in by_op.most_common(args.top):
        print(f"| {name[:90]} | {1000 * seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
