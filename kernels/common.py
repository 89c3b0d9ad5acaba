"""What the kernel modules share: the NKI import, the tile limits, and the rule that picks the
kernel or the reference."""
from __future__ import annotations

import torch

try:
    import nki
    import nki.isa as nisa
    import nki.language as nl
    HAS_NKI = True
except ImportError:
    nki = nisa = nl = None
    HAS_NKI = False

PARTITIONS = 128  # rows per tile: SBUF and PSUM have 128 partitions
SBUF_BUDGET_BYTES = 160 * 1024  # per partition, of the 224 KiB on trn2: what one tile's working set may use

_NOTICES: set[str] = set()


def notice_once(message: str) -> None:
    if message not in _NOTICES:
        _NOTICES.add(message)
        print(f"notice: {message}", flush=True)


def pick_kernel(name: str, x: torch.Tensor, fits: bool, why: str) -> bool:
    """True when x is on the neuron device, nki is importable and the shape fits the kernel. A
    neuron tensor the kernel cannot take runs the PyTorch reference, said once per reason."""
    if x.device.type != "neuron":
        return False
    if not HAS_NKI:
        notice_once(f"{name}: the nki package is not importable; using the PyTorch reference")
        return False
    if not fits:
        notice_once(f"{name}: {why}; using the PyTorch reference")
        return False
    return True


def rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as a contiguous [N, width] matrix."""
    return x.reshape(-1, width).contiguous()
