"""What makes a Trainium run fast or slow, checked on a CPU: the native Neuron backend goes through
torch.compile (backend="neuron", static shapes), so a graph break, a recompile, a host read inside the step
or an op the backend runs on the host shows up here as it would there. tests/test_graphs.py runs these
checks on the kit (and on deliberately broken copies); `python tests/graph_checks.py` prints the census (the
aten ops and dtypes of the training step and the scorer's forward, per preset).

The checks:
- graphs: the training step's forward and backward (and the scorers' forwards) compile with fullgraph=True;
  a graph break is an error that names the line (GraphBreak);
- recompiles: CompileCount counts every graph a backend is asked to compile, so a run can be held to
  "nothing after the first step";
- host reads: HostReads records every read of a tensor's value on the host (.item(), .tolist(), bool(t),
  float(t), printing, .cpu(), .numpy(), data-dependent shapes) and where it happened;
- host fallbacks: OpCensus lists the aten ops and dtypes of the compiled graphs; HOST_OPS are those
  docs/trainium-readiness.md says the Neuron backend does not run on the device."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import train as T  # noqa: E402
from helpers import every_ingredient, flags_for  # noqa: E402

# aten ops (by name prefix) and dtypes the Neuron backend runs on the host or not at all, with how sure the
# kit's reference notes are: "unsupported ops fall back to the host silently"; "no fft/complex/sort";
# "int64/float64 auto-cast to int32/fp32" (third-party notes, unverified on a device).
HOST_OPS = {
    "aten.sort": "sort: not supported (third-party notes)",
    "aten.argsort": "argsort is a sort (third-party notes)",
    "aten.msort": "a sort (third-party notes)",
    "aten.fft_": "fft: not supported (third-party notes)",
    "aten._fft": "fft: not supported (third-party notes)",
    "aten.unique": "unique: a sort, and a data-dependent shape (unsure: inferred)",
    "aten.nonzero": "a data-dependent shape: a host sync (unsure: inferred)",
    "aten.masked_select": "a data-dependent shape: a host sync (unsure: inferred)",
    "aten._local_scalar_dense": "reads a value on the host (.item())",
    "aten.topk": "topk: a partial sort (unsure: not in the notes either way)",
}
HOST_DTYPES = {
    torch.float64: "float64: cast to fp32 on the device (third-party notes), so its numbers change",
    torch.complex64: "complex: not supported (third-party notes)",
    torch.complex128: "complex: not supported (third-party notes)",
}
INT64_MATMULS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.matmul", "aten.baddbmm")  # int64 matmul: unsupported


class GraphBreak(RuntimeError):
    """The compiled function does not trace as one graph; the message names the line."""


# -----------------------------------------------------------------------------------------------
# Graphs and the ops in them
# -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class OpCensus:
    """A torch.compile backend that records what it is asked to compile: how many graphs dynamo hands it
    (a frame each: with fullgraph=True one per compiled function and input shape), and every aten op of
    the forward and backward graphs AOT autograd makes of them, with the dtypes they produce. It runs the
    graphs eagerly (no code generation), so it is quick."""
    graphs: int = 0
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dtypes: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(set))  # op -> dtypes out
    int64_matmuls: set = dataclasses.field(default_factory=set)

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        self.graphs += 1

        def record(graph_module, _):
            for node in graph_module.graph.nodes:
                if node.op != "call_function":
                    continue
                name = str(node.target)
                self.ops[name] += 1
                for value in torch.utils._pytree.tree_leaves(node.meta.get("val")):
                    if isinstance(value, torch.Tensor):
                        self.dtypes[name].add(value.dtype)
                if name.startswith(INT64_MATMULS) and any(
                        isinstance(a, torch.fx.Node) and getattr(a.meta.get("val"), "dtype", None) == torch.int64
                        for a in node.args):
                    self.int64_matmuls.add(name)
            return make_boxed_func(graph_module.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    def host_ops(self) -> dict[str, str]:
        """{op: why} for every op or dtype of the graphs the Neuron backend would run on the host."""
        found = {op: why for op in self.ops for prefix, why in HOST_OPS.items() if op.startswith(prefix)}
        for op, dtypes in self.dtypes.items():
            for dtype in dtypes & set(HOST_DTYPES):
                found[f"{op} -> {dtype}"] = HOST_DTYPES[dtype]
        for op in self.int64_matmuls:
            found[f"{op} on int64"] = "int64 matmul: not supported (third-party notes)"
        return found


def one_graph(fn, *args, backend=None, **kwargs):
    """fn(*args, **kwargs) compiled with fullgraph=True (static shapes) through `backend` (default: a fresh
    OpCensus), or GraphBreak naming the line that breaks it. Returns (the result, the backend)."""
    backend = backend or OpCensus()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    try:
        return compiled(*args, **kwargs), backend
    except torch._dynamo.exc.TorchDynamoException as e:
        where = [line for line in str(e).splitlines() if 'File "' in line]
        raise GraphBreak(f"{getattr(fn, '__name__', type(fn).__name__)} does not compile as one graph: "
                         f"{str(e).splitlines()[0]} at {where[-1].strip() if where else '(no user line)'}") from None


def tiny_recipe(argv: list[str]) -> tuple[T.Recipe, T.RunOptions]:
    """A recipe from train.py flags (a preset's, say) at a tiny width and a short context: the graph's
    structure (depth, ingredients, windows) is the preset's, its tensors small enough for a CPU."""
    recipe, options, _ = T.parse_command_line([*argv, "--aspect-ratio", "8", "--head-dim", "16", "--seq-len", "64",
                                               "--dtype", "fp32"])
    return recipe, options


def training_step_census(recipe: T.Recipe, options: T.RunOptions, rows: int = 2) -> OpCensus:
    """The model's forward, loss and backward compiled as one graph (GraphBreak otherwise), as --compile
    compiles them; the census of its forward and backward graphs."""
    model = T.build_model(T.model_config(recipe), "cpu", recipe.dtype)
    tokens = torch.randint(0, model.config.vocab_size, (rows, recipe.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    loss, census = one_graph(model, tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return census


def eval_forward_census(recipe: T.Recipe, rows: int = 2) -> OpCensus:
    """load_for_eval's model forward at the scorer's context (T.EVAL_SEQ_LEN), compiled as one graph."""
    model = T.build_model(T.model_config(recipe), "cpu", recipe.dtype).eval().requires_grad_(False)
    tokens = torch.randint(0, model.config.vocab_size, (rows, T.EVAL_SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return one_graph(model, tokens)[1]


def packed_scoring_census(recipe: T.Recipe, sequences: list[list[int]]) -> OpCensus:
    """inference.py's packed scoring forward (a shared prefix and its continuations in one row, with
    positions and an attention mask), compiled as one graph: the calls its Scorer makes, recorded on the
    real scoring path and then compiled."""
    import functools
    import inference
    model = T.build_model(T.model_config(recipe), "cpu", recipe.dtype).eval().requires_grad_(False)
    calls, forward = [], model.forward

    @functools.wraps(forward)
    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return forward(*args, **kwargs)

    model.forward = recording
    scorer = inference.Scorer(model, torch.device("cpu"))
    calls.clear()  # (the scorer's own probe at load time)
    scorer.score(sequences)
    del model.forward
    packed = [(args, kwargs) for args, kwargs in calls if kwargs.get("attn_mask") is not None]
    if not scorer.prefix_cache or not packed:
        raise RuntimeError("the scorer ran no packed forward for these sequences")
    census = OpCensus()
    for args, kwargs in packed[:1]:
        one_graph(model, *args, backend=census, **kwargs)
    return census


# -----------------------------------------------------------------------------------------------
# Recompiles and host reads
# -----------------------------------------------------------------------------------------------

class CompileCount:
    """A torch.compile backend that counts the graphs it compiles (every new graph, every recompile) and
    runs them through AOT autograd eagerly, as a real backend's forward and backward would run."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        self.graphs += 1
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     bw_compiler=lambda g, _: make_boxed_func(g.forward))


# Tensor methods and functions that read a value back to the host (on an asynchronous device: wait for all
# queued work, then copy). Creating tensors from host data and host-to-device copies are not reads.
HOST_READ_CALLS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__repr__",
                   "__str__", "__format__", "equal", "allclose", "nonzero", "argwhere", "unique", "unique_consecutive",
                   "masked_select", "bincount"}


class HostReads(TorchFunctionMode):
    """Records every host read of a tensor value (HOST_READ_CALLS): (the call, the innermost line of the kit's
    code it came from, the region it happened in). Regions are labels set with within()."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str, str | None]] = []
        self.region: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READ_CALLS:
            frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(str(REPO))
                      and not f.filename.endswith("graph_checks.py")]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
            self.reads.append((name, where, self.region))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def within(self, region: str):
        """Label the reads of the with block as `region`."""
        outer, self.region = self.region, region
        try:
            yield
        finally:
            self.region = outer

    def in_region(self, region: str) -> list[tuple[str, str]]:
        return [(call, where) for call, where, r in self.reads if r == region]


SHAPES = {  # what the checks cover: d10 (the organisers' baseline) and the presets
    "d10": [],
    "cpu": ["--preset", "cpu"],
    "gpu": ["--preset", "gpu"],
    "phase2": ["--preset", "phase2"],
    "every-ingredient": flags_for(every_ingredient()),
}


def print_census() -> None:
    for name, argv in SHAPES.items():
        recipe, options = tiny_recipe(argv)
        for what, census in (("training step", training_step_census(recipe, options)),
                             ("eval forward", eval_forward_census(recipe))):
            host = census.host_ops()
            print(f"{name} {what}: {census.graphs} graph(s), {sum(census.ops.values())} aten calls of "
                  f"{len(census.ops)} kinds; on the host: {host or 'none'}")
            dtypes = sorted({str(d).replace('torch.', '') for ds in census.dtypes.values() for d in ds})
            print(f"    dtypes produced: {', '.join(dtypes)}")
            print(f"    ops: {', '.join(sorted(op.replace('aten.', '') for op in census.ops))}")


if __name__ == "__main__":
    print_census()
