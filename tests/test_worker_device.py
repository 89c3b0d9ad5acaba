"""The worker's device is found before its sandbox, in trusted code: "auto" is never turned into a slower
device by what the sandbox keeps from starting (on an H200 under Firecracker, CUDA failed to start under the
sandbox and "auto" silently scored on the CPU), and a device that does not work is one clear error before any
participant code runs."""
from __future__ import annotations

import pytest
import torch

from harness.common import HarnessError
from harness.worker import worker_side


def test_auto_is_the_device_found_before_the_sandbox(monkeypatch):
    server = worker_side.Server.__new__(worker_side.Server)
    worker_side.Server.__init__(server, sock=None)
    found = []
    monkeypatch.setattr("harness.common.detect_device_type", lambda: found.append(1) or "cuda")
    assert server.sandbox({"off": True, "rlimits": {}}) == {"applied": []}
    assert found == [1] and server.present == "cuda"
    assert worker_side.resolve_device("auto", 3, server.present) == torch.device("cuda:3")
    assert worker_side.resolve_device("cpu", 3, server.present) == torch.device("cpu")
    assert worker_side.resolve_device("auto", 0, "cpu") == torch.device("cpu")


def test_a_cuda_device_that_does_not_start_is_one_clear_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Unexpected error from cudaGetDeviceCount(). Error 304: OS call failed\nmore")
    monkeypatch.setattr(torch, "ones", broken)
    with pytest.raises(HarnessError, match=r"cannot use cuda:0 inside its sandbox .*Error 304.*--no-sandbox"):
        worker_side.check_device_works(torch.device("cuda:0"))
    worker_side.check_device_works(torch.device("cpu"))  # nothing to check on the CPU
