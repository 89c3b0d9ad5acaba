"""A CPU emulator of the NKI subset the kit's kernels use. It lives with the tests: it is how the CPU
tests execute the kernels, never a runtime path of the kit.

The real CPU simulator (`nki.simulate`, NKI >= 0.3) ships only in AWS's package index. This module
stands in for it: `modules()` builds `nki`, `nki.language` and `nki.isa` modules that the tests put in
`sys.modules` before importing the kernel modules, so the kernels run unchanged, from the same
source that runs on Trainium. Calling an `@nki.jit` kernel (with or without a `[grid]`) runs it here
on CPU tensors, as `NKI_SIMULATOR=1` does with the real package; `simulate(kernel)` mirrors
`nki.simulate`.

What it models, each rule next to the documentation page it comes from (`PAGES`):
- buffers: `nl.ndarray` on `sbuf` / `psum` / `hbm` / `shared_hbm` / `private_hbm`; new buffers are
  filled with NaN (integers: 4), so a read of memory never written shows; on-chip tiles have at most
  128 partitions and the live SBUF (and PSUM) bytes per partition of a kernel instance are bounded;
- views: integer, slice and `nl.ds` indexing with the on-chip "at least 2-D" rule; out-of-range
  indices are errors, never clamped;
- loops and the launch grid: `range` / `nl.affine_range` / `nl.sequential_range` run in order;
  `nl.program_id(0)` / `nl.num_programs()` over a grid of 1 or 2 instances; a launch's grid must
  match `NEURON_LOGICAL_NC_CONFIG`; the instances share `shared_hbm`, and two instances writing the
  same HBM element is reported as a race (on hardware the two cores run at once);
- instructions: `dma_copy`, `tensor_copy`, `memset`, `activation` (+ `activation_reduce`),
  `tensor_tensor`, `tensor_scalar`, `scalar_tensor_tensor`, `tensor_reduce`, `reciprocal`. Engines
  read their inputs as fp32, compute in fp32 and cast on write; ScalarE's 128 reduce registers
  persist across `activation` instructions and follow `reduce_cmd`; they hold NaN when a kernel
  instance starts (their content is whatever earlier instructions left).

Not modelled: timing, engine parallelism, PSUM accumulation (`nc_matmul`), `.ap()` access patterns,
collectives, and every instruction the kit does not call (calling one fails with AttributeError).
Where the documentation says nothing about a behaviour the emulator needs, it says so in a comment.
"""
from __future__ import annotations

import enum
import math
import os
import types
import weakref

import torch

DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/"
PAGES = {
    "ndarray": DOCS + "nki/api/generated/nki.language.ndarray.html",
    "ds": DOCS + "nki/api/generated/nki.language.ds.html",
    "affine_range": DOCS + "nki/api/generated/nki.language.affine_range.html",
    "sequential_range": DOCS + "nki/api/generated/nki.language.sequential_range.html",
    "program_id": DOCS + "nki/api/generated/nki.language.program_id.html",
    "num_programs": DOCS + "nki/api/generated/nki.language.num_programs.html",
    "buffers": DOCS + "nki/api/generated/nki.language.shared_hbm.html",
    "tile_size": DOCS + "nki/api/nki.language.tile_size.html",
    "language_guide": DOCS + "nki/get-started/nki-language-guide.html",  # tensors, views, indexing
    "tiling": DOCS + "nki/get-started/about/tiling-overview.html",
    "lnc": DOCS + "nki/get-started/about/lnc.html",
    "jit": "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.31.0/nki/api/generated/nki.jit.html",
    "evrf066": DOCS + "compiler/error-codes/EVRF066.html",
    "simulator": DOCS + "nki/guides/nki_simulator.html",
    "simulate": DOCS + "nki/api/generated/nki.simulate.html",
    "trn3_arch": DOCS + "nki/about/trainium3_arch.html",  # "28 MiB in NeuronCore-v3" SBUF
    "dma_copy": DOCS + "nki/api/generated/nki.isa.dma_copy.html",
    "migration_0_3": DOCS + "nki/migration/nki-0-3-0-update-guide.html",  # dma_copy cannot read PSUM
    "tensor_copy": DOCS + "nki/api/generated/nki.isa.tensor_copy.html",
    "memset": DOCS + "nki/api/generated/nki.isa.memset.html",
    "activation": DOCS + "nki/api/generated/nki.isa.activation.html",
    "activation_reduce": DOCS + "nki/api/generated/nki.isa.activation_reduce.html",
    "reduce_cmd": DOCS + "nki/api/generated/nki.isa.reduce_cmd.html",
    "tensor_tensor": DOCS + "nki/api/generated/nki.isa.tensor_tensor.html",
    "tensor_scalar": DOCS + "nki/api/generated/nki.isa.tensor_scalar.html",
    "scalar_tensor_tensor": DOCS + "nki/api/generated/nki.isa.scalar_tensor_tensor.html",
    "tensor_reduce": DOCS + "nki/api/generated/nki.isa.tensor_reduce.html",
    "reciprocal": DOCS + "nki/api/generated/nki.isa.reciprocal.html",
}

EMULATED_VERSION = "0.4.0"  # reported as nki.__version__: the competition environment's, which the kit targets
PMAX = 128  # partitions per on-chip tile (nl.tile_size.pmax) [tiling, tile_size]
SBUF_PARTITION_BYTES = 28 * 2**20 // PMAX  # 224 KiB: NeuronCore-v3 has 28 MiB of SBUF [trn3_arch]
PSUM_PARTITION_BYTES = 2 * 2**20 // PMAX  # 16 KiB: 2 MiB of PSUM, 8 banks of 2 KiB per partition [tile_size]
ON_CHIP = ("sbuf", "psum")
HBM = ("hbm", "shared_hbm", "private_hbm")


class EmulatorError(Exception):
    """A kernel broke a rule of the NKI documentation; the message names the page."""


def fail(page: str, message: str):
    raise EmulatorError(f"{message} [{PAGES[page]}]")


# --- the state of one launch: which instance runs, its registers, its on-chip memory -------------

class Program:
    """One kernel instance of a launch (one physical core): its id, ScalarE's reduce registers and
    the SBUF/PSUM bytes per partition its live tiles take."""

    def __init__(self, pid: int, grid: int, shared: list):
        self.pid, self.grid, self.shared, self.shared_next = pid, grid, shared, 0
        # "one 32-bit register per compute lane, 128 registers in total" [activation]; what they
        # hold when a kernel starts is not documented: NaN makes a read before a write show.
        self.reduce_regs = torch.full((PMAX,), math.nan, dtype=torch.float32)
        self.live = {"sbuf": 0, "psum": 0}
        self.peak = {"sbuf": 0, "psum": 0}
        self.instructions = 0


_PROGRAM: Program | None = None
LAUNCHES: list[dict] = []  # one record per launch: kernel name, grid, peak bytes per partition, instructions


def program() -> Program:
    if _PROGRAM is None:
        raise EmulatorError("an NKI call outside a kernel launch: call the @nki.jit kernel, or simulate(kernel)(...)")
    return _PROGRAM


# --- dtypes and buffers ---------------------------------------------------------------------------

bool_ = torch.bool
int8, int16, int32 = torch.int8, torch.int16, torch.int32
uint8 = torch.uint8
float16, bfloat16, float32 = torch.float16, torch.bfloat16, torch.float32
sbuf, psum, hbm, shared_hbm, private_hbm = "sbuf", "psum", "hbm", "shared_hbm", "private_hbm"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Storage:
    """A buffer: its elements, its memory, and (shared HBM) which instance wrote each element."""

    def __init__(self, base: torch.Tensor, buffer: str):
        self.base, self.buffer = base, buffer
        self.writer = torch.full(base.shape, -1, dtype=torch.int8) if buffer in HBM else None


class DynSlice:
    """nl.ds(start, size): rows start .. start + size - 1 of a dimension [ds]."""

    def __init__(self, start: int, size: int):
        self.start, self.size = int(start), int(size)


def ds(start, size):
    return DynSlice(start, size)


class Tensor:
    """A view of a Storage: shape, dtype and buffer as NkiTensor has them [language_guide]. On-chip
    views also know their first partition (lane), which ScalarE's registers are indexed by."""

    def __init__(self, storage: Storage, data: torch.Tensor, writer: torch.Tensor | None, lane0: int = 0):
        self.storage, self.data, self.writer, self.lane0 = storage, data, writer, lane0

    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: self.data.dtype)
    buffer = property(lambda self: self.storage.buffer)
    ndim = property(lambda self: self.data.dim())
    size = property(lambda self: self.data.numel())

    def __repr__(self):
        return f"Tensor({self.shape}, {self.dtype}, {self.buffer})"

    def __getitem__(self, key):
        """Integers, slices (step > 0), nl.ds and Ellipsis [language_guide, "Tensor Indexing"]:
        on-chip tensors stay at least 2-D (an integer on the partition dim keeps it at size 1; an
        integer on a free dim drops it unless the result would fall below 2-D). Indices outside the
        tensor are errors: the hardware has no clamping, and a DMA out of bounds fails [dma_copy]."""
        key = key if isinstance(key, tuple) else (key,)
        if sum(k is Ellipsis for k in key) > 1:
            fail("language_guide", "more than one Ellipsis in an index")
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1:]
        if len(key) > self.ndim:
            fail("language_guide", f"{len(key)} indices for a {self.ndim}-D tensor {self}")
        key = key + (slice(None),) * (self.ndim - len(key))
        on_chip = self.buffer in ON_CHIP
        index, dropped, lane0 = [], [], self.lane0
        for dim, (k, n) in enumerate(zip(key, self.shape)):
            if isinstance(k, DynSlice):
                k = slice(k.start, k.start + k.size)
            if isinstance(k, bool) or not isinstance(k, (int, slice)):
                fail("language_guide", f"index {k!r} of dim {dim}: integers, slices and nl.ds are the static indices")
            if isinstance(k, int):
                if not 0 <= k < n:
                    fail("language_guide", f"index {k} out of range for dim {dim} of size {n} ({self})")
                if on_chip and dim == 0:
                    index.append(slice(k, k + 1))
                    lane0 += k
                else:
                    index.append(k)
                    dropped.append(dim)
                continue
            start, stop, step = k.start or 0, n if k.stop is None else k.stop, k.step or 1
            if not (0 <= start < stop <= n) or step < 1:
                fail("language_guide", f"slice {start}:{stop}:{step} of dim {dim} is empty or outside size {n} "
                                       f"({self})")
            index.append(slice(start, stop, step))
            if on_chip and dim == 0:
                lane0 += start
        if on_chip and self.ndim - len(dropped) < 2:  # keep the last dropped free dim at size 1
            last = dropped.pop()
            index[last] = slice(index[last], index[last] + 1)
        idx = tuple(index)
        return Tensor(self.storage, self.data[idx], None if self.writer is None else self.writer[idx], lane0)


def ndarray(shape, dtype, buffer=None, name=""):
    """A new, uninitialised tensor [ndarray; language_guide "ndarray does not initialize memory"],
    filled with NaN (integers: 4) as the simulator does to show reads of unwritten memory
    [simulator, "Uninitialized Memory Detection"]."""
    p = program()
    buffer = sbuf if buffer is None else buffer  # "defaults to sbuf" [ndarray]
    if buffer not in ON_CHIP + HBM:
        fail("ndarray", f"unknown buffer {buffer!r}")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        fail("ndarray", f"shape {shape}: every dimension must be positive")
    if buffer in ON_CHIP:
        if len(shape) < 2:
            fail("language_guide", f"an {buffer} tensor is at least 2-D (partition dim + free dims); got {shape}")
        if shape[0] > PMAX:
            fail("tiling", f"partition dimension {shape[0]} of {shape} exceeds nl.tile_size.pmax = {PMAX}")
        per_partition = math.prod(shape[1:]) * _itemsize(dtype)
        limit = SBUF_PARTITION_BYTES if buffer == sbuf else PSUM_PARTITION_BYTES
        if p.live[buffer] + per_partition > limit:
            fail("trn3_arch" if buffer == sbuf else "tile_size",
                 f"{buffer} overflow: {p.live[buffer]} live + {per_partition} new bytes per partition exceed "
                 f"{limit} ({name or shape})")
    if buffer == shared_hbm:
        # Every instance executes the same allocations; a shared_hbm tensor is one tensor that all of
        # them see ["Shared HBM - Visible to all kernel instances in the SPMD grid", buffers]: the
        # k-th shared allocation of each instance is the same storage.
        if p.shared_next < len(p.shared):
            storage = p.shared[p.shared_next]
            if tuple(storage.base.shape) != shape or storage.base.dtype != dtype:
                fail("lnc", f"instance {p.pid} allocates shared_hbm {shape} {dtype} where instance 0 allocated "
                            f"{tuple(storage.base.shape)} {storage.base.dtype}: the instances run the same program")
        else:
            storage = Storage(_sentinel(shape, dtype), buffer)
            p.shared.append(storage)
        p.shared_next += 1
        return Tensor(storage, storage.base, storage.writer)
    storage = Storage(_sentinel(shape, dtype), buffer)
    if buffer in ON_CHIP:
        p.live[buffer] += per_partition
        p.peak[buffer] = max(p.peak[buffer], p.live[buffer])
        # A tile is live from its nl.ndarray until the kernel drops its last reference to it. In a
        # loop the next iteration's tile is allocated before the last one is dropped: a stand-in
        # for the compiler's allocator, which may also keep two iterations in flight.
        weakref.finalize(storage, _release, p.live, buffer, per_partition)
    return Tensor(storage, storage.base, storage.writer)


def _release(live: dict, buffer: str, nbytes: int) -> None:
    live[buffer] -= nbytes


def _sentinel(shape, dtype) -> torch.Tensor:
    return torch.full(shape, math.nan if dtype.is_floating_point else 4, dtype=dtype)


# --- loops and the launch grid ----------------------------------------------------------------------

def _range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


def affine_range(start, stop=None, step=1):
    """Iterations without loop-carried dependency; run in order here [affine_range]."""
    return _range(start, stop, step)


def sequential_range(start, stop=None, step=1):
    """Iterations in order [sequential_range]."""
    return _range(start, stop, step)


static_range = affine_range


def program_id(axis):
    """This instance's index along `axis` of the launch grid [program_id]; the kit's grids are 1-D."""
    if axis != 0:
        fail("program_id", f"program_id({axis}) on a 1-D launch grid")
    return program().pid


def num_programs(axes=None):
    """The number of instances in the launch grid [num_programs]."""
    if axes not in (None, 0, (0,)):
        fail("num_programs", f"num_programs({axes}) on a 1-D launch grid")
    return program().grid


class tile_size:  # noqa: N801  (NKI's name)
    pmax = PMAX
    psum_fmax = 512
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512


class Kernel:
    """What @nki.jit returns: `kernel(...)` launches one instance, `kernel[g](...)` a grid of g
    [jit, lnc]. Calling it runs the kernel here, as NKI_SIMULATOR=1 does [simulator]."""

    def __init__(self, fn, grid=None):
        self.fn, self.grid = fn, grid
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        grid = grid[0] if isinstance(grid, tuple) and len(grid) == 1 else grid
        if isinstance(grid, bool) or not isinstance(grid, int):
            fail("lnc", f"launch grid {grid!r}: the bracket holds one number, the number of cores")
        return Kernel(self.fn, grid)

    def __call__(self, *args, **kwargs):
        check_launch_grid(self.grid)
        return launch(self.fn, self.grid or 1, args, kwargs)


def check_launch_grid(grid: int | None) -> None:
    """A device launch: the kernel's logical core count (the bracket; 1 without one) must equal the
    runtime's, NEURON_LOGICAL_NC_CONFIG [jit: "The LNC value must match the NEURON_LOGICAL_NC_CONFIG
    environment variable ... Mismatching the two will cause a runtime error"]; unset, the compiler
    uses trn2's default of 2 [evrf066: "kernel(...) # Kernel implicitly defaults to LNC=1; neuronx-cc
    defaults to LNC=2 on Trn2"]."""
    kernel_lnc = 1 if grid is None else grid
    device_lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    if kernel_lnc != device_lnc:
        fail("evrf066", f"kernel launched with LNC={kernel_lnc} but NEURON_LOGICAL_NC_CONFIG gives LNC={device_lnc}")


def jit(fn=None, **kwargs):
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def simulate(kernel):
    """nki.simulate(kernel) or nki.simulate(kernel[2]) [simulate]: run on CPU without the device's
    LNC check."""
    kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return lambda *args, **kwargs: launch(kernel.fn, kernel.grid or 1, args, kwargs)


def launch(fn, grid: int, args, kwargs):
    """Run `grid` instances of fn, one after the other (the real simulator runs them as threads
    [simulator, "For LNC2 kernels"]; the kit's kernels never wait on each other). Tensor arguments
    become shared_hbm tensors on the caller's storage, so kernel writes show in them [simulator,
    "Execution"]; the returned tensors come back as torch tensors."""
    global _PROGRAM
    if grid not in (1, 2):
        fail("lnc", f"launch grid {grid}: a logical core has 1 or 2 physical cores")
    if _PROGRAM is not None:
        fail("jit", "a kernel launched from inside a kernel: only top-level functions are @nki.jit kernels")
    wrap = {}

    def hbm_view(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in wrap:
                storage = Storage(x, shared_hbm)
                wrap[id(x)] = Tensor(storage, x, storage.writer)
            return wrap[id(x)]
        return x

    args = [hbm_view(a) for a in args]
    kwargs = {k: hbm_view(v) for k, v in kwargs.items()}
    shared: list = []
    results, record = [], {"kernel": getattr(fn, "__name__", "kernel"), "grid": grid, "sbuf_peak": 0,
                           "psum_peak": 0, "instructions": 0}
    try:
        for pid in range(grid):
            _PROGRAM = Program(pid, grid, shared)
            results.append(fn(*args, **kwargs))
            record["sbuf_peak"] = max(record["sbuf_peak"], _PROGRAM.peak["sbuf"])
            record["psum_peak"] = max(record["psum_peak"], _PROGRAM.peak["psum"])
            record["instructions"] += _PROGRAM.instructions
    finally:
        _PROGRAM = None
    LAUNCHES.append(record)
    return _outputs(results)


def _outputs(results):
    """Every instance returns the same shared outputs [lnc: outputs live in shared HBM]."""
    first = results[0]
    items = first if isinstance(first, tuple) else (first,)
    for other in results[1:]:
        others = other if isinstance(other, tuple) else (other,)
        if len(others) != len(items) or any(a is not b and (not isinstance(a, Tensor) or a.storage is not b.storage)
                                            for a, b in zip(items, others)):
            fail("lnc", "the instances of a launch returned different tensors: return shared_hbm outputs")
    out = []
    for t in items:
        if isinstance(t, Tensor):
            if t.buffer not in HBM:
                fail("jit", f"a kernel returns HBM tensors; this one is in {t.buffer}")
            out.append(t.data)
        else:
            out.append(t)
    return tuple(out) if isinstance(first, tuple) else out[0]


# --- operators --------------------------------------------------------------------------------------

class AluOp:
    """An arithmetic operator of VectorE/ScalarE/GpSimdE (nl.add, nl.multiply, ...), passed as `op`."""

    def __init__(self, name, fn, reduce=None):
        self.name, self.fn, self.reduce = name, fn, reduce

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        raise EmulatorError(f"nl.{self.name}(...) as a function (the nki.language tile API) is not emulated; "
                            "the kit's kernels pass it as an instruction's op")


class ActivationFn:
    """A ScalarE activation function (nl.exp, nl.tanh, ...), passed as activation's `op`."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        raise EmulatorError(f"nl.{self.name}(...) as a function is not emulated; pass it to nisa.activation")


add = AluOp("add", torch.add, lambda t, d: t.sum(d))
subtract = AluOp("subtract", torch.sub)
multiply = AluOp("multiply", torch.mul, lambda t, d: t.prod(d))
divide = AluOp("divide", torch.div)
maximum = AluOp("maximum", torch.maximum, lambda t, d: t.amax(d))
minimum = AluOp("minimum", torch.minimum, lambda t, d: t.amin(d))

copy = ActivationFn("copy", lambda x: x)
relu = ActivationFn("relu", torch.relu)
square = ActivationFn("square", torch.square)
exp = ActivationFn("exp", torch.exp)
log = ActivationFn("log", torch.log)
tanh = ActivationFn("tanh", torch.tanh)
sqrt = ActivationFn("sqrt", torch.sqrt)
rsqrt = ActivationFn("rsqrt", torch.rsqrt)
sigmoid = ActivationFn("sigmoid", torch.sigmoid)


class ReduceCmd(enum.Enum):
    """ScalarE's reduce-register commands, nisa.reduce_cmd [reduce_cmd]."""
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


reduce_cmd = ReduceCmd


# --- what the instructions share -----------------------------------------------------------------------

def _instruction() -> Program:
    p = program()
    p.instructions += 1
    return p


def _tile(t, page: str, role: str) -> Tensor:
    if not isinstance(t, Tensor):
        fail(page, f"{role} must be a tile, got {t!r}")
    if t.buffer not in ON_CHIP:
        fail(page, f"{role} must be an SBUF or PSUM tile, not {t.buffer}: engines read and write on-chip memory")
    return t


def _rows(t: Tensor) -> torch.Tensor:
    """The tile as [partitions, elements per partition], read as fp32: every engine casts its inputs
    to fp32 first (each instruction page, "Data types")."""
    return t.data.reshape(t.shape[0], -1).float()


def _per_partition(t: Tensor) -> int:
    return math.prod(t.shape[1:])


def _same_layout(page: str, a: Tensor, b: Tensor, what: str) -> None:
    """"The partition dimension size of ... tiles must be the same and must not exceed 128. The
    number of elements per partition ... must be the same" (each instruction page, "Tile size")."""
    if a.shape[0] != b.shape[0] or _per_partition(a) != _per_partition(b):
        fail(page, f"{what}: {a.shape} and {b.shape} differ in partitions or elements per partition")


def _write(dst: Tensor, value: torch.Tensor) -> None:
    """Cast the fp32 result to dst's dtype on write ("cast to dst.dtype at no additional cost")."""
    dst.data.copy_(value.reshape(dst.shape).to(dst.dtype))


def _operand(x, partitions: int, page: str, role: str, fp32_tile: bool) -> torch.Tensor:
    """A compile-time scalar, or a [partitions, 1] tile broadcast along the free dimension."""
    if isinstance(x, bool) or x is None:
        fail(page, f"{role} is {x!r}: a number or a [P, 1] tile")
    if isinstance(x, (int, float)):
        return torch.tensor(float(x), dtype=torch.float32)
    t = _tile(x, page, role)
    if t.shape[0] != partitions or _per_partition(t) != 1:
        fail(page, f"{role} tile {t.shape}: a vector operand is [{partitions}, 1]")
    if fp32_tile and t.dtype != float32:
        fail(page, f"{role} tile is {t.dtype}: vector operands must be float32")
    return _rows(t)


def _alu(op, page: str, role: str) -> AluOp:
    if not isinstance(op, AluOp):
        fail(page, f"{role} {op!r} is not an arithmetic operator (nl.add, nl.multiply, ...)")
    return op


def _apply(op: AluOp, a, b, reverse: bool):
    return op.fn(b, a) if reverse else op.fn(a, b)


def _not_both_psum(page: str, a: Tensor, b: Tensor, what: str) -> None:
    if a.buffer == psum and b.buffer == psum:
        fail(page, f"{what} cannot both reside in PSUM")


# --- nki.isa ----------------------------------------------------------------------------------------

def dma_copy(dst, src, priority=None, oob_mode=None, dge_mode=None, engine=None, name=None):
    """dst = src between HBM and SBUF [dma_copy: "Both src and dst tiles can be in HBM or SBUF"; PSUM
    cannot be read by DMA since NKI 0.3, migration_0_3]. Element counts must match; different dtypes
    go through fp32 ("first casting from src.dtype to float32, then from float32 to dst.dtype")."""
    p = _instruction()
    for role, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tensor):
            fail("dma_copy", f"{role} must be a tensor, got {t!r}")
        if t.buffer == psum:
            fail("migration_0_3", f"dma_copy {role} in PSUM: copy PSUM to SBUF with nisa.tensor_copy first")
    if dst.size != src.size:
        fail("dma_copy", f"dst {dst.shape} and src {src.shape} hold different numbers of elements")
    value = src.data if src.dtype == dst.dtype else src.data.float().to(dst.dtype)
    if dst.writer is not None:
        # Instances of an LNC=2 launch run at once on two cores [lnc, simulator "two Python threads"]:
        # two instances writing one HBM element is a race whose winner the hardware does not define.
        others = (dst.writer != -1) & (dst.writer != p.pid)
        if bool(others.any()):
            fail("lnc", f"instances {p.pid} and {int(dst.writer[others].flatten()[0])} both write "
                        f"{int(others.sum())} elements of one HBM tensor {dst.storage.base.shape}: split the "
                        "rows over nl.program_id(0)")
        dst.writer.fill_(p.pid)
    dst.data.copy_(value.reshape(dst.shape))


def tensor_copy(dst, src, engine=None, name=None):
    """A copy between on-chip tiles, cast through fp32 when the dtypes differ [tensor_copy]."""
    _instruction()
    _tile(dst, "tensor_copy", "dst"), _tile(src, "tensor_copy", "src")
    _same_layout("tensor_copy", dst, src, "tensor_copy")
    if dst.dtype == src.dtype:  # bit-accurate when the dtypes match [tensor_copy]
        dst.data.copy_(src.data.reshape(dst.shape))
    else:
        _write(dst, _rows(src))


def memset(dst, value, engine=None, name=None):
    """Fill an on-chip tile with a compile-time constant [memset]."""
    _instruction()
    _tile(dst, "memset", "dst")
    dst.data.fill_(value)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=ReduceCmd.idle, name=None):
    """dst = op(data * scale + bias) on ScalarE, in fp32 [activation]. The optional fused sum over the
    free dimension goes through the 128 reduce registers as `reduce_cmd` says:
    reset: registers = 0 (the data is not summed); idle: registers untouched; reduce: registers +=
    sum; reset_reduce: registers = sum. `reduce_res`, if given, then receives the registers. The page's
    pseudo-code adds the old registers twice for `reduce`; its prose ("reduce activated data over
    existing values") is what is modelled. load_reduce is not documented for activation: an error."""
    p = _instruction()
    _tile(dst, "activation", "dst"), _tile(data, "activation", "data")
    _same_layout("activation", dst, data, "activation dst and data")
    if not isinstance(op, ActivationFn):
        fail("activation", f"op {op!r} is not an activation function (nl.exp, nl.tanh, ...)")
    if not isinstance(reduce_cmd, ReduceCmd):
        fail("reduce_cmd", f"reduce_cmd {reduce_cmd!r} is not a nisa.reduce_cmd member")
    if reduce_cmd is ReduceCmd.load_reduce:
        fail("activation", "reduce_cmd.load_reduce: activation documents reset, idle, reduce and reset_reduce")
    if reduce_op is not None and reduce_op is not add:
        fail("activation", f"reduce_op {reduce_op!r}: reduce_op must be nl.add")
    if reduce_cmd in (ReduceCmd.reduce, ReduceCmd.reset_reduce) and reduce_op is None:
        fail("activation", f"reduce_cmd.{reduce_cmd.name} sums with reduce_op, which is None")
    parts = data.shape[0]
    x = _rows(data)
    scale_v = _operand(scale, parts, "activation", "scale", fp32_tile=True)  # "scale ... float32"
    bias_v = 0.0 if bias is None else _operand(bias, parts, "activation", "bias", fp32_tile=False)
    out = op.fn(x * scale_v + bias_v)
    lanes = slice(data.lane0, data.lane0 + parts)
    if reduce_cmd in (ReduceCmd.reset, ReduceCmd.reset_reduce):
        p.reduce_regs[lanes] = 0.0
    if reduce_cmd in (ReduceCmd.reduce, ReduceCmd.reset_reduce):
        p.reduce_regs[lanes] += out.sum(dim=1)
    _write(dst, out)
    if reduce_res is not None:
        _tile(reduce_res, "activation", "reduce_res")
        if reduce_res.shape[0] != parts or _per_partition(reduce_res) != 1:
            fail("activation", f"reduce_res {reduce_res.shape}: a tile of shape ({parts}, 1)")
        _write(reduce_res, p.reduce_regs[lanes].clone())



def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """activation with reduce_cmd=reset_reduce and a reduce_res [activation_reduce: "equivalent to
    calling nisa.activation with reduce_cmd=nisa.reduce_cmd.reset_reduce and passing in reduce_res"]."""
    if reduce_res is None:
        fail("activation_reduce", "reduce_res is required")
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=ReduceCmd.reset_reduce, name=name)


def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    """dst = data1 op data2, elementwise, same partitions and elements per partition (no broadcast);
    data1 and data2 not both in PSUM [tensor_tensor]."""
    _instruction()
    for role, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        _tile(t, "tensor_tensor", role)
    _same_layout("tensor_tensor", data1, data2, "data1 and data2")
    _same_layout("tensor_tensor", dst, data1, "dst and data1")
    _not_both_psum("tensor_tensor", data1, data2, "data1 and data2")
    _write(dst, _alu(op, "tensor_tensor", "op").fn(_rows(data1), _rows(data2)))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=None, name=None):
    """dst = (data op0 operand0) op1 operand1; each operand a scalar or a float32 [P, 1] tile; op1
    and operand1 both None when unused [tensor_scalar]."""
    _instruction()
    _tile(dst, "tensor_scalar", "dst"), _tile(data, "tensor_scalar", "data")
    _same_layout("tensor_scalar", dst, data, "dst and data")
    if (op1 is None) != (operand1 is None):
        fail("tensor_scalar", "op1 and operand1 are used together (both None when unused)")
    parts = data.shape[0]
    value = _apply(_alu(op0, "tensor_scalar", "op0"), _rows(data),
                   _operand(operand0, parts, "tensor_scalar", "operand0", fp32_tile=True), reverse0)
    if op1 is not None:
        value = _apply(_alu(op1, "tensor_scalar", "op1"), value,
                       _operand(operand1, parts, "tensor_scalar", "operand1", fp32_tile=True), reverse1)
    _write(dst, value)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """dst = (data op0 operand0) op1 operand1: operand0 a scalar or [P, 1] tile, operand1 a tile
    shaped like data; data and operand1 not both in PSUM [scalar_tensor_tensor]."""
    _instruction()
    for role, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        _tile(t, "scalar_tensor_tensor", role)
    _same_layout("scalar_tensor_tensor", dst, data, "dst and data")
    _same_layout("scalar_tensor_tensor", operand1, data, "operand1 and data")
    _not_both_psum("scalar_tensor_tensor", data, operand1, "data and operand1")
    parts = data.shape[0]
    tmp = _apply(_alu(op0, "scalar_tensor_tensor", "op0"), _rows(data),
                 _operand(operand0, parts, "scalar_tensor_tensor", "operand0", fp32_tile=False), reverse0)
    _write(dst, _apply(_alu(op1, "scalar_tensor_tensor", "op1"), tmp, _rows(operand1), reverse1))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the trailing free axes of data ("must be the last contiguous free dimension(s) of the
    tile, ending at the final dimension. Axis 0 (partition axis) cannot be reduced"), optionally
    negated; dst holds the remaining elements per partition [tensor_reduce]."""
    _instruction()
    _tile(dst, "tensor_reduce", "dst"), _tile(data, "tensor_reduce", "data")
    axes = tuple(sorted((axis,) if isinstance(axis, int) else tuple(axis)))
    if not axes or axes[0] < 1 or axes != tuple(range(axes[0], data.ndim)):
        fail("tensor_reduce", f"axis {axis} of a {data.ndim}-D tile: the last free dims, ending at the final one")
    op = _alu(op, "tensor_reduce", "op")
    if op.reduce is None:
        fail("tensor_reduce", f"{op!r} is not a reduction operator here (add, multiply, maximum, minimum)")
    kept = math.prod(data.shape[1:axes[0]])
    if dst.shape[0] != data.shape[0] or _per_partition(dst) != kept:
        fail("tensor_reduce", f"dst {dst.shape} for reducing {data.shape} over {axes}: {kept} elements per partition")
    value = op.reduce(data.data.float().reshape(data.shape[0], kept, -1), 2)
    _write(dst, -value if negate else value)


def reciprocal(dst, data, name=None):
    """dst = 1 / data, in fp32 [reciprocal]."""
    _instruction()
    _tile(dst, "reciprocal", "dst"), _tile(data, "reciprocal", "data")
    _same_layout("reciprocal", dst, data, "dst and data")
    _write(dst, 1.0 / _rows(data))


# --- the modules ------------------------------------------------------------------------------------

LANGUAGE = ("ndarray", "ds", "affine_range", "sequential_range", "static_range", "program_id", "num_programs",
            "tile_size", "sbuf", "psum", "hbm", "shared_hbm", "private_hbm", "bool_", "int8", "int16", "int32",
            "uint8", "float16", "bfloat16", "float32", "add", "subtract", "multiply", "divide", "maximum",
            "minimum", "copy", "relu", "square", "exp", "log", "tanh", "sqrt", "rsqrt", "sigmoid")
ISA = ("dma_copy", "tensor_copy", "memset", "activation", "activation_reduce", "tensor_tensor", "tensor_scalar",
       "scalar_tensor_tensor", "tensor_reduce", "reciprocal", "reduce_cmd")


def modules() -> dict[str, types.ModuleType]:
    """Fresh `nki`, `nki.language` and `nki.isa` modules backed by this emulator, keyed by the names
    to put in sys.modules."""
    here = globals()
    nl = types.ModuleType("nki.language", "NKI language, emulated on CPU for the kit's tests")
    nl.__dict__.update({name: here[name] for name in LANGUAGE})
    isa = types.ModuleType("nki.isa", "NKI ISA, emulated on CPU for the kit's tests")
    isa.__dict__.update({name: here[name] for name in ISA})
    nki = types.ModuleType("nki", "NKI, emulated on CPU for the kit's tests")
    nki.__path__ = []  # a package, so `import nki.isa` resolves through sys.modules
    nki.__version__ = EMULATED_VERSION
    nki.jit, nki.simulate, nki.language, nki.isa = jit, simulate, nl, isa
    nki.EMULATED = True
    return {"nki": nki, "nki.language": nl, "nki.isa": isa}

