"""The budget planner: size the model and batch of train.py for a budget, and print the flags. It trains
nothing (--probe times a few steps first); it is a tool beside the submission, which never runs it.

    python tools/plan.py --ranks 64 --budget 14400     # 16 chips (LNC=2), 4 h, at the assumed throughput
    python tools/plan.py --ranks 4 --budget 1800       # one chip, 30 min
    python tools/plan.py --preset phase2 --ranks 64 --budget 14400 --tokens-per-second $MEASURED --measured-ranks 4
    python tools/plan.py --device cpu --probe --ranks 1 --budget 300 --preset cpu   # measure here first
    python tools/plan.py --device cpu --preset cpu --shapes --budget 900   # which shape and rows the campaign's fit
                                                                           # expects best here (measured once)

Every train.py flag describes the model to plan from (--preset, --depth, --aspect-ratio, ...).

The model of throughput: a rank achieves a fixed number of model FLOP/s, whatever the depth, so a
figure measured with one model carries over to others. The rule: the depth (at the flags' aspect ratio)
whose training tokens per parameter come nearest PLAN_TOKENS_PER_PARAM; a batch from the batch law;
the steps that fill the training time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train as T  # noqa: E402
from prepare import _row_groups_for_split  # noqa: E402

# The planner's rule. A preset sweep may revise these constants; each says where its value comes from.
PLAN_TOKENS_PER_PARAM = 10.5  # nanochat's compute-optimal fit for this model family (anchors: at a fixed
                              # compute budget, the loss is lowest near 10.5 training tokens per parameter)
                              # Not at CPU scale: at 5 minutes (~1e14 FLOPs) the preset sweep found ~0.7 best
                              # (docs/presets-and-benchmarks.md, "The CPU preset, chosen by measurement"):
                              # size such runs by a sweep
PLAN_REFERENCE_BATCH = 2**18  # autoresearch's tuned batch (tokens per step) for a run of ...
PLAN_REFERENCE_TOKENS = 5e8  # ... ~0.5B training tokens (5 minutes on an H100)
PLAN_BATCH_EXPONENT = 0.383  # nanochat's fit: the best batch grows as (training tokens)^0.383 (2^18 at depth 8 to
                             # 2^20 at depth 26); so the steps in a budget grow as (tokens)^0.617
PLAN_ASSUMED_MFU = 0.22  # without a measurement: a dense 6-layer x 1024 model reached ~22% on one Trainium2
                         # chip in Phase 1; measure your own and re-plan (--tokens-per-second or --probe)
PLAN_MAX_DEPTH = 64
PLAN_PROBE_WARMUP, PLAN_PROBE_STEPS = 3, 5  # --probe: steps that compile and warm up, then steps timed


@dataclass
class Plan:
    recipe: T.Recipe  # the planned flags
    ranks: int
    flops_per_second: float  # achieved model FLOP/s, all ranks together
    throughput_source: str
    params: int
    flops_per_token: int
    training_seconds: float  # the budget less the time kept for the checkpoint
    geometry: T.BatchGeometry
    steps: int

    @property
    def tokens(self) -> int:
        return self.steps * self.geometry.total_batch_size

    @property
    def tokens_per_second(self) -> float:
        return self.flops_per_second / self.flops_per_token


def planned_batch_size(tokens: float, seq_len: int, ranks: int) -> int:
    """The batch law's tokens per step for a run of `tokens`, as a power-of-two number of rows on every
    rank (so at least one row per rank)."""
    ideal = PLAN_REFERENCE_BATCH * (tokens / PLAN_REFERENCE_TOKENS) ** PLAN_BATCH_EXPONENT
    row_tokens = seq_len * ranks
    return row_tokens * 2 ** max(0, round(math.log2(ideal / row_tokens)))


def plan_run(recipe: T.Recipe, ranks: int, budget_seconds: float, flops_per_second: float,
             throughput_source: str = "given", fixed: bool = False) -> Plan:
    """Size a run for a budget at a throughput (achieved model FLOP/s, all ranks): the depth, at the
    flags' aspect ratio and head size, whose training tokens per parameter come nearest (in ratio)
    PLAN_TOKENS_PER_PARAM; the batch from the batch law; the steps that fill the budget. `fixed`: the
    recipe's depth and batch as they are, only the steps. Pure."""
    best = None
    for depth in [recipe.depth] if fixed else range(1, PLAN_MAX_DEPTH + 1):
        candidate = dataclasses.replace(recipe, depth=depth, time_budget=float(budget_seconds))
        with torch.device("meta"):
            model = T.GPT(T.model_config(candidate))
        training_seconds = budget_seconds - T.checkpoint_save_reserve(model)
        if training_seconds <= 0:
            break
        tokens = flops_per_second / model.flops_per_token() * training_seconds
        distance = abs(math.log(tokens / model.num_params() / PLAN_TOKENS_PER_PARAM))
        if best is not None and distance > best[0]:
            break  # tokens per parameter only fall with depth: past the target, every deeper model is further
        best = (distance, candidate, model, training_seconds, tokens)
    if best is None:
        raise ValueError(f"a budget of {budget_seconds:.0f}s leaves no time to train after saving the checkpoint")
    _, candidate, model, training_seconds, tokens = best
    batch = recipe.total_batch_size if fixed else planned_batch_size(tokens, recipe.seq_len, ranks)
    geometry = T.batch_geometry(batch, recipe.device_batch_size, recipe.seq_len, ranks)
    candidate = dataclasses.replace(candidate, total_batch_size=batch, device_batch_size=geometry.device_batch_size)
    return Plan(candidate, ranks, flops_per_second, throughput_source, model.num_params(), model.flops_per_token(),
                training_seconds, geometry, int(tokens // batch))


def format_plan(plan: Plan, preset: str | None = None) -> str:
    recipe, g = plan.recipe, plan.geometry
    config = T.model_config(recipe)
    flags = f"--preset {preset} " if preset else ""
    flags += f"--depth {recipe.depth} --aspect-ratio {recipe.aspect_ratio} --head-dim {recipe.head_dim} " \
             f"--seq-len {recipe.seq_len} --total-batch-size {recipe.total_batch_size} " \
             f"--device-batch-size {recipe.device_batch_size} --time-budget {recipe.time_budget:.0f}"
    launch = f"torchrun --standalone --nproc_per_node={plan.ranks} train.py" if plan.ranks > 1 else "python train.py"
    per_rank = plan.flops_per_second / plan.ranks
    rows = [("throughput", f"{per_rank / 1e12:.1f} TFLOP/s per rank ({plan.throughput_source})"),
            ("ranks", plan.ranks), ("budget_seconds", f"{recipe.time_budget:.0f}"),
            ("training_seconds", f"{plan.training_seconds:.0f}"),
            ("depth", recipe.depth), ("width", config.n_embd), ("heads", config.n_head),
            ("parameters_M", f"{plan.params / 1e6:.1f}"), ("flops_per_token", f"{plan.flops_per_token:.4e}"),
            ("tokens_per_second", f"{plan.tokens_per_second:,.0f}"),
            ("batch", f"{g.total_batch_size:,} tokens = {g.device_batch_size} x {g.seq_len} x {g.world_size} ranks x "
                      f"{g.grad_accum_steps} accumulation"),
            ("steps", f"{plan.steps:,}"), ("tokens_B", f"{plan.tokens / 1e9:.2f}"),
            ("tokens_per_parameter", f"{plan.tokens / plan.params:.1f}"),
            ("command", f"{launch} {flags}")]
    return "\n".join(f"{k + ':':<22}{v}" for k, v in rows)


def random_batches(rows: int, seq_len: int, device: torch.device, vocab_size: int = T.TOKENIZER_VOCAB_SIZE):
    """Endless (inputs, targets, state) of random tokens: a step's time does not depend on the text."""
    while True:
        x = torch.randint(0, vocab_size, (rows, seq_len + 1), device=device)
        yield x[:, :-1], x[:, 1:], {}


def time_training_steps(recipe: T.Recipe, options: T.RunOptions, profile: T.DeviceProfile, device: torch.device,
                        warmup: int, steps: int) -> tuple[float, float]:
    """(seconds of the first `warmup` steps, median seconds of the `steps` after them): the recipe's model trained on
    random tokens in one process, in the profile's dtype, compiled where options say, as a run trains it."""
    model = T.build_model(T.model_config(recipe), device, T.dtype_name(profile.compute_dtype))
    optimizer = T.build_optimizer(model, recipe, options, profile.compute_dtype, profile.compile_backend)
    step_model = torch.compile(model, backend=profile.compile_backend, dynamic=False) if options.compile else model
    geometry = T.batch_geometry(recipe.total_batch_size, recipe.device_batch_size, recipe.seq_len, 1)
    data, seconds = random_batches(geometry.device_batch_size, recipe.seq_len, device), []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        T.train_step(step_model, optimizer, data, geometry.grad_accum_steps)
        T.synchronize(device)
        seconds.append(time.perf_counter() - t0)
    if options.compile:
        torch._dynamo.reset()  # the next model's graphs start afresh (dynamo keeps 8 per function)
    return sum(seconds[:warmup]), statistics.median(seconds[warmup:])


def measure_training_throughput(recipe: T.Recipe, options: T.RunOptions, device_type: str, steps: int,
                                warmup: int) -> dict:
    """One process training the model of `recipe` on random tokens (time_training_steps): tokens/s and MFU over
    `steps` optimizer steps, after `warmup` steps that include compilation."""
    profile = T.device_profile_for(recipe, device_type)
    device = torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warm, dt = time_training_steps(recipe, options, profile, device, warmup, steps)
    with torch.device("meta"):
        model = T.GPT(T.model_config(recipe))
    tok_s = recipe.total_batch_size / dt
    return {"dtype": T.dtype_name(profile.compute_dtype), "warmup_s": warm,
            "step_s": dt, "tokens_per_second": tok_s, "peak_tflops": profile.peak_flops / 1e12,
            "peak_source": profile.peak_source, "achieved_tflops": model.flops_per_token() * tok_s / 1e12,
            "mfu_percent": 100 * model.flops_per_token() * tok_s / profile.peak_flops,
            "params_M": model.num_params() / 1e6, "peak_memory_mb": T.peak_memory_mb(device)}


# ---- --shapes: the shape the CPU campaign's fit expects best in a budget, from tokens/s measured here -----------------
# Advice, not a rule a run applies: the cpu preset trains its own shape, so that two runs compare an edit. Measured
# on the AMD EPYC with AVX-512 BF16 (300 s and 900 s) and an Intel Xeon without AMX (411 s), it never picked another
# shape; only the rows changed (rows of 512 at 900 s: docs/presets-and-benchmarks.md).
# Besides the recipe's own shape: width 384 keeps a fast bf16 matmul unit (AMX) busy where 192 leaves it idle; depth 4
# at width 256 is the campaign's "one size up".
SHAPE_CANDIDATES = (dict(depth=4, aspect_ratio=64), dict(depth=3, aspect_ratio=128))
# val_bpb ~ E + A / N^alpha + B / D^beta, N the blocks' matrix parameters and D the tokens trained: the fit of
# benchmarks/shape_rule.py to the CPU campaign (rms error 0.034 bpb). E is the text's, the same for every shape.
SHAPE_FIT = dict(A=89.87, alpha=0.425, B=431.2, beta=0.45)
SHAPE_MARGIN_BPB = 0.02  # the fit must expect a candidate this much better than the recipe's shape (300-s seed spread)
SHAPE_PROBE_STEPS = (2, 3)  # per shape: steps that compile and warm up, then steps timed
# A row starts at a document's start, so rows of 256 train only each document's first 257 tokens. Once a run has read
# those about twice, rows twice as long win (the crossing: 1.3-2.1 passes, 256 to 512).
MAX_PASSES = 2.0


def shape_name(recipe: T.Recipe) -> str:
    c = T.model_config(recipe)
    return f"depth {c.n_layer}, width {c.n_embd}, rows of {recipe.seq_len}"


def shape_key(recipe: T.Recipe) -> str:
    """A shape's entry in the table: its name, and a hash of all in the recipe that a step's speed depends on."""
    what = json.dumps([dataclasses.asdict(T.model_config(recipe)), recipe.total_batch_size, recipe.device_batch_size,
                       recipe.dtype])
    return f"{shape_name(recipe)} [{T.hashlib.sha256(what.encode()).hexdigest()[:8]}]"


def shape_candidates(recipe: T.Recipe) -> list[T.Recipe]:
    """The recipe's own shape first, then SHAPE_CANDIDATES' (at the recipe's head size, rows and batch), each once."""
    shapes = {}
    for shape in [recipe] + [dataclasses.replace(recipe, **c) for c in SHAPE_CANDIDATES]:
        shapes.setdefault(shape_name(shape), shape)
    return list(shapes.values())


def matrix_parameters(recipe: T.Recipe) -> int:
    """The fit's N: the parameters of the blocks' matrices (no embedding table, no head)."""
    with torch.device("meta"):
        return sum(p.numel() for p in T.GPT(T.model_config(recipe)).blocks.parameters() if p.ndim == 2)


def expected_bpb(matrix_params: int, tokens: float) -> float:
    """SHAPE_FIT's val_bpb less the text's constant: it compares shapes on one text, nothing more."""
    return SHAPE_FIT["A"] * matrix_params ** -SHAPE_FIT["alpha"] + SHAPE_FIT["B"] * tokens ** -SHAPE_FIT["beta"]


def training_documents() -> int:
    """Documents in the training split, from the shards' parquet metadata (nothing is read)."""
    return sum(pq.ParquetFile(path).metadata.row_group(group).num_rows
               for path, group in _row_groups_for_split("train", 0, 1))


def choose_shape(recipe: T.Recipe, tokens_per_second: dict[str, float], documents: int) -> tuple[T.Recipe, list[str]]:
    """(the shape, why): the candidate the fit expects best from its tokens/s over the budget (by shape_key), if by
    SHAPE_MARGIN_BPB over the recipe's own; its rows doubled where they would pass MAX_PASSES times or more over
    what they reach (at most seq_len + 1 tokens of each document). Pure."""
    why, scored = [], []
    for shape in shape_candidates(recipe):
        speed = tokens_per_second[shape_key(shape)]
        tokens = speed * recipe.time_budget
        scored.append((expected_bpb(matrix_parameters(shape), tokens), shape))
        why.append(f"  {shape_name(shape)}: {speed:,.0f} tokens/s, {tokens / 1e6:.1f}M tokens, "
                   f"expected val_bpb {scored[-1][0] - scored[0][0]:+.3f} to the recipe's")
    best_bpb, pick = min(scored, key=lambda s: s[0])
    pick = pick if scored[0][0] - best_bpb >= SHAPE_MARGIN_BPB else recipe
    tokens, rows = tokens_per_second[shape_key(pick)] * recipe.time_budget, pick.seq_len
    passes = tokens / (documents * (rows + 1))
    pick = dataclasses.replace(pick, seq_len=2 * rows) if passes >= MAX_PASSES else pick
    why.append(f"advice: {shape_name(pick)}, the best expected val_bpb in {recipe.time_budget:.0f}s (by "
               f"{SHAPE_MARGIN_BPB} to leave the recipe's shape); {tokens / 1e6:.1f}M tokens pass {passes:.1f} times "
               f"over the first {rows + 1} tokens of {documents:,} documents (rows doubled from {MAX_PASSES:g})")
    return pick, why


def shapes_file() -> Path:
    """Tokens/s by machine and shape, measured once and kept beside train.py's matmul timings (delete to measure
    again)."""
    return T.machine_file().with_name("shapes.json")


def machine_key(profile: T.DeviceProfile, options: T.RunOptions) -> str:
    """What a step's speed depends on besides its shape: the processor, its threads, dtype, compile and torch (not
    train.py: an edit is compared at the shape the advice gave before it)."""
    here = f"{T.cpu_name()} x {T.cpu_threads()}" if profile.type == "cpu" else \
        torch.cuda.get_device_name() if profile.type == "cuda" else f"{profile.type}, {profile.peak_source}"
    return f"{here} | {T.dtype_name(profile.compute_dtype)} | compile {options.compile} | torch {torch.__version__}"


def measured_shapes(recipe: T.Recipe, options: T.RunOptions, device_type: str) -> tuple[dict, str]:
    """({shape_key: tokens/s} of shape_candidates(recipe) on this machine, the table's key): read from shapes_file(),
    or measured here (SHAPE_PROBE_STEPS each, compile included) and added to it."""
    path = shapes_file()
    key = machine_key(T.device_profile_for(recipe, device_type), options)
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
        measured = table.setdefault(key, {})
        if not all(math.isfinite(float(v)) and float(v) > 0 for v in measured.values()):
            raise ValueError("a value that is not a positive number of tokens/s")
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a table of tokens/s ({e}): delete it to measure again") from None
    for shape in [s for s in shape_candidates(recipe) if shape_key(s) not in measured]:
        profile = T.device_profile_for(shape, device_type)
        warm, step = time_training_steps(shape, options, profile, torch.device(device_type), *SHAPE_PROBE_STEPS)
        measured[shape_key(shape)] = shape.total_batch_size / step
        print(f"measured {shape_name(shape)}: {measured[shape_key(shape)]:,.0f} tokens/s "
              f"({warm + step * SHAPE_PROBE_STEPS[1]:.0f}s, compile included)", flush=True)
        T.write_atomically(path, lambda tmp: tmp.write_text(json.dumps(table, indent=1)))
    return measured, key


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags (they describe the model to plan from) and the planner's own."""
    parser = T.build_parser()
    parser.description = __doc__.strip().split("\n\n")[0]
    plan = parser.add_argument_group("budget planner")
    plan.add_argument("--ranks", type=int, default=1, help="ranks of the run to plan (Trainium2: 4 per chip at "
                      "NEURON_LOGICAL_NC_CONFIG=2, 8 at 1)")
    plan.add_argument("--budget", type=float, default=None, help="seconds of charged time (default: --time-budget)")
    plan.add_argument("--tokens-per-second", type=float, default=None, help="throughput measured for the model "
                      "the other flags describe (a run's tokens_per_second), all ranks together")
    plan.add_argument("--measured-ranks", type=int, default=None, help="ranks of that measurement (default: --ranks)")
    plan.add_argument("--mfu", type=float, default=None, help=f"assumed model FLOPs utilisation, 0-1 (default "
                      f"{PLAN_ASSUMED_MFU} without a measurement)")
    plan.add_argument("--probe", action="store_true", help="measure the throughput of the model the other flags "
                      "describe with a few steps on this machine's device first")
    plan.add_argument("--shapes", action="store_true", help="which of the flags' shape and SHAPE_CANDIDATES, and which "
                      "rows, the CPU campaign's fit expects best in the budget, from their tokens/s measured here (once "
                      "per machine)")
    return parser


def advise_shape(recipe: T.Recipe, options: T.RunOptions, args, target: str) -> int:
    """--shapes: the shape choose_shape advises for the budget here, and why, from its candidates' tokens/s on this
    machine (shapes_file(), measured where missing), then the plan of a run at that shape."""
    here = T.detect_device_type()
    if target != here or args.ranks != 1:
        raise SystemExit(f"error: --shapes compares one {target} process's shapes by tokens/s measured on that machine "
                         f"(this one is {here}): pass --device {here} --ranks 1 to plan for it here")
    if (args.tokens_per_second, args.mfu, args.measured_ranks) != (None, None, None):
        raise SystemExit("error: --tokens-per-second, --mfu and --measured-ranks feed the planner's own rule; "
                         "--shapes reads the tokens/s measured here: drop them, or drop --shapes")
    try:
        measured, key = measured_shapes(recipe, options, target)
        chosen, why = choose_shape(recipe, measured, training_documents())
        probed = dataclasses.replace(chosen, seq_len=recipe.seq_len)  # its tokens/s were measured at the recipe's rows
        with torch.device("meta"):
            flops = measured[shape_key(probed)] * T.GPT(T.model_config(probed)).flops_per_token()
        plan = plan_run(chosen, 1, chosen.time_budget, flops, f"measured, {shapes_file()}: {key}", fixed=True)
    except Exception as e:
        if not T.is_input_error(e):
            raise
        raise SystemExit(f"error: {e}") from None
    print("\n".join(why))
    print(format_plan(plan, args.preset))
    return 0


def main(argv=None) -> int:
    """The throughput from a measurement, a probe or an assumed MFU, then the plan."""
    parser = build_parser()
    args = parser.parse_args(argv)
    recipe, options, _ = T.settings_from(args, parser)
    budget = args.budget if args.budget is not None else recipe.time_budget
    if args.ranks < 1 or budget <= 0:
        raise SystemExit(f"error: the planner needs --ranks >= 1 and --budget > 0, got {args.ranks}, {budget}")
    target = options.device if options.device not in ("", "auto") else "neuron"  # the competition's device, unless told
    if args.shapes:
        return advise_shape(dataclasses.replace(recipe, time_budget=float(budget)), options, args, target)
    with torch.device("meta"):
        flops_per_token = T.GPT(T.model_config(recipe)).flops_per_token()  # the model the other flags describe
    if args.tokens_per_second is not None:
        measured_ranks = args.measured_ranks or args.ranks
        if args.tokens_per_second <= 0 or measured_ranks < 1:
            raise SystemExit("error: --tokens-per-second and --measured-ranks must be positive")
        per_rank = args.tokens_per_second / measured_ranks * flops_per_token
        source = f"measured {args.tokens_per_second:,.0f} tokens/s of the depth-{recipe.depth} model on " \
                 f"{measured_ranks} ranks"
    elif args.probe:
        here = T.detect_device_type()
        if target != here:
            raise SystemExit(f"error: --probe measures on the device it plans for ({target}), and this machine's is "
                             f"{here}: pass --device {here} to plan for it, or give --tokens-per-second or --mfu")
        print(f"probe: {PLAN_PROBE_WARMUP} + {PLAN_PROBE_STEPS} steps of the depth-{recipe.depth} model on "
              f"{target}", flush=True)
        r = measure_training_throughput(recipe, options, target, PLAN_PROBE_STEPS, PLAN_PROBE_WARMUP)
        per_rank = r["achieved_tflops"] * 1e12
        source = f"probe: {r['tokens_per_second']:,.0f} tokens/s of the depth-{recipe.depth} model on one " \
                 f"{target} rank, {r['mfu_percent']:.1f}% MFU"
    else:
        mfu = args.mfu if args.mfu is not None else PLAN_ASSUMED_MFU
        if not 0 < mfu <= 1:
            raise SystemExit(f"error: --mfu is a fraction in (0, 1], got {mfu}")
        if target == "cuda" and not torch.cuda.is_available():
            raise SystemExit("error: an MFU-based plan for cuda reads the GPU's peak, and this machine has no GPU; "
                             "plan on the GPU machine, or give --tokens-per-second")
        profile = T.device_profile_for(recipe, target)
        per_rank = mfu * profile.peak_flops
        source = f"{'assumed' if args.mfu is None else 'given'} {100 * mfu:.0f}% MFU of " \
                 f"{profile.peak_flops / 1e12:.0f} TFLOP/s ({profile.peak_source})"
    print(format_plan(plan_run(recipe, args.ranks, budget, per_rank * args.ranks, source), args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
