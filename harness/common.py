"""Errors and small helpers every harness module uses."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path


class HarnessError(Exception):
    """A problem with the user's input or environment; the message names the cause and the fix."""


class ConfigError(HarnessError):
    pass


class DataError(HarnessError):
    pass


class DownloadError(HarnessError):
    pass


class BadShardError(HarnessError):
    pass


class TokenizerError(HarnessError):
    pass


class EvalRefused(HarnessError):
    """The model breaks the load contract (type, shape, NaN, causality, batch independence)."""


class BudgetError(HarnessError):
    """The ledger was called out of order (steps must arrive consecutively)."""


class CoreError(HarnessError):
    """CORE gives no score; the message says why (the bundle, an argument, the time limit, the verification)."""


def get_dist_info() -> tuple[bool, int, int, int]:
    """(is_ddp, rank, local_rank, world_size) from torchrun's environment."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


def print0(*args, **kwargs) -> None:
    if get_dist_info()[1] == 0:
        print(*args, **kwargs, flush=True)


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def detect_device_type() -> str:
    """The fastest device present: neuron, then cuda, then cpu."""
    import torch
    try:
        if hasattr(torch, "neuron") and torch.neuron.is_available():
            return "neuron"
    except Exception:
        pass
    try:
        acc = torch.accelerator.current_accelerator()
        if acc is not None and acc.type == "neuron":
            return "neuron"
    except Exception:
        pass
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"
