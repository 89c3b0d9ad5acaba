"""What the kernels share (kernels/ and train.py's inline relu^2 alike): the NKI import and the nki
versions the kernels follow, the tile limits, the one launcher, and the rule that picks the kernel or
the PyTorch reference."""
from __future__ import annotations

import functools
import importlib.metadata
import os
import re

import torch

try:
    import nki
    import nki.isa as nisa
    import nki.language as nl
    HAS_NKI = True
except ImportError:
    nki = nisa = nl = None
    HAS_NKI = False

# The nki releases whose API and documented semantics the kernels were written against: 0.4 (Neuron
# 2.30, the competition environment) to 0.7 (Neuron 2.33, which rejects a launch whose logical core
# count differs from the compiler's; the launcher always matches them). Other releases may rename or
# change what the kernels call.
NKI_VERSIONS = ((0, 4), (0, 7))
PARTITIONS = 128  # rows per tile: SBUF and PSUM have 128 partitions
SBUF_BUDGET_BYTES = 160 * 1024  # per partition, of the 224 KiB on trn2: what one tile's working set may use
KERNEL_DEVICE = "neuron"  # tensors on this device run the kernels (the CPU tests point it at their emulator)

_NOTICES: set[str] = set()


def notice_once(message: str) -> None:
    """Print a notice once per process, on rank 0."""
    if message not in _NOTICES:
        _NOTICES.add(message)
        from prepare import print0  # the harness's rank-0 print; imported late, kernels/ is imported lazily
        print0(f"notice: {message}")


def logical_core_count() -> int:
    """This rank's logical NeuronCore size, NEURON_LOGICAL_NC_CONFIG: the launch grid of every kernel.
    It must be set: an NKI kernel's core count has to equal the compiler's and the runtime's (NKI 0.7
    refuses a mismatch, error NCC_EVRF066), and unset they disagree (kernel 1, trn2 compiler 2)."""
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG is {value!r}; the NKI kernels launch one instance per "
                         "physical core of the logical core and need it set to 1 or 2, e.g. "
                         "NEURON_LOGICAL_NC_CONFIG=2 torchrun --nproc_per_node=4 train.py ...")
    return int(value)


@functools.cache  # pick_kernel asks on every call; the package metadata lookup is slow
def installed_nki_version() -> str | None:
    try:
        return importlib.metadata.version("nki")
    except importlib.metadata.PackageNotFoundError:
        return getattr(nki, "__version__", None)


def nki_version_problem(version: str | None) -> str | None:
    """Why the kernels should not run on this nki version (None: they may)."""
    lo, hi = NKI_VERSIONS
    wanted = f"the kit's NKI kernels follow nki {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} (Neuron SDK 2.30 to 2.33)"
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match is None:
        return f"cannot tell which nki is installed (version {version!r}); {wanted}"
    found = (int(match.group(1)), int(match.group(2)))
    if not lo <= found <= hi:
        return (f"nki {version} is installed; {wanted}. Install one of those (the Neuron DLAMI venv has one), "
                "or check the kernels against the NKI migration guide and widen NKI_VERSIONS in kernels/common.py")
    return None


def launch(kernel, *args):
    """Run an @nki.jit kernel on every physical core of this rank's logical core: a grid of
    logical_core_count() instances, each of which takes its share of the row tiles by
    nl.program_id(0). On torch tensors the call goes through torch-neuronx's wrap_nki when it is
    importable (the launch that code for this stack uses, and that torch.compile can trace)."""
    return _framework(kernel)[logical_core_count()](*args)


_WRAP_NKI = []


def _framework(kernel):
    if not _WRAP_NKI:
        try:
            from torch_neuronx import wrap_nki
        except ImportError:
            try:
                from torch_neuronx.nki_hop import wrap_nki
            except ImportError:
                wrap_nki = None
        _WRAP_NKI.append(wrap_nki)
    return kernel if _WRAP_NKI[0] is None else _WRAP_NKI[0](kernel)


def pick_kernel(name: str, x: torch.Tensor, fits: bool, why: str, n_rows: int) -> bool:
    """True when x is on the kernels' device, nki is importable, the shape fits the kernel (`why`
    says how it does not) and its n_rows split into 128-row tiles evenly over the logical core's
    physical cores. A tensor the kernel cannot take runs the PyTorch reference, said once per reason."""
    if x.device.type != KERNEL_DEVICE:
        return False
    if not HAS_NKI:
        notice_once(f"{name}: the nki package is not importable; using the PyTorch reference")
        return False
    problem = nki_version_problem(installed_nki_version())
    if problem:
        raise RuntimeError(problem)
    if not fits:
        notice_once(f"{name}: {why}; using the PyTorch reference")
        return False
    cores = logical_core_count()
    if n_rows % (PARTITIONS * cores):
        notice_once(f"{name}: {n_rows} rows do not split into {PARTITIONS}-row tiles evenly over the {cores} "
                    f"physical cores of a logical core (NEURON_LOGICAL_NC_CONFIG={cores}); using the PyTorch reference")
        return False
    return True


def rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as a contiguous [N, width] matrix."""
    return x.reshape(-1, width).contiguous()
