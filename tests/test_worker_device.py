"""The worker's device is found and started before its sandbox, in trusted code: "auto" is never turned into a
slower device by what the sandbox keeps from starting (on an H200 under Firecracker, CUDA failed to start under
the sandbox and "auto" silently scored on the CPU), CUDA's start (which names threads and opens sockets) is over
before the restrictions apply, a CUDA worker's threads may name themselves inside the sandbox and do nothing
more, and a device that does not work is one clear error before any participant code runs."""
from __future__ import annotations

import pytest
import torch

from harness.common import HarnessError
from harness.worker import sandbox, worker_side


def test_auto_is_the_device_found_before_the_sandbox(monkeypatch):
    server = worker_side.Server.__new__(worker_side.Server)
    worker_side.Server.__init__(server, sock=None)
    found, started = [], []
    monkeypatch.setattr("harness.common.detect_device_type", lambda: found.append(1) or "cuda")
    monkeypatch.setattr(worker_side, "start_device", started.append)  # CUDA starts before the sandbox applies
    assert server.sandbox({"off": True, "rlimits": {}, "device": "auto", "local_rank": 3}) == {"applied": []}
    assert found == [1] and server.present == "cuda" and started == [torch.device("cuda:3")]
    assert worker_side.resolve_device("auto", 3, server.present) == torch.device("cuda:3")
    assert worker_side.resolve_device("cpu", 3, server.present) == torch.device("cpu")
    assert worker_side.resolve_device("auto", 0, "cpu") == torch.device("cpu")


def test_a_cuda_device_that_does_not_start_is_one_clear_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Unexpected error from cudaGetDeviceCount(). Error 304: OS call failed\nmore")
    monkeypatch.setattr(torch, "ones", broken)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(HarnessError, match=r"cannot use cuda:0 inside its sandbox .*Error 304.*--no-sandbox"):
        worker_side.check_device_works(torch.device("cuda:0"))
    with pytest.raises(HarnessError, match=r"cannot start cuda:0 on this machine .*Error 304.*--device cpu"):
        worker_side.start_device(torch.device("cuda:0"))
    worker_side.check_device_works(torch.device("cpu"))  # nothing to check or start on the CPU
    worker_side.start_device(torch.device("cpu"))


# A child applies the worker's sandbox as a worker does (no_new_privs, no capabilities, Landlock with the
# worker's rules, the seccomp filter), with or without the rule a CUDA worker adds, then tries each write.
NAMES_PROBE = r"""
import os, sys, tempfile, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from harness.worker import sandbox
parent, pid = os.getppid(), os.getpid()
rules = sandbox.worker_rules(Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp()))
rules += [(p, "execute") for p in sys.path if os.path.isabs(p) and os.path.isdir(p)]
if sys.argv[2] == "rule":
    rules.append(sandbox.thread_names_rule())
sandbox.set_no_new_privs()
sandbox.drop_capabilities()
sandbox.apply_landlock(rules, sandbox.landlock_abi())
sandbox.apply_seccomp(sandbox.seccomp_arch())


def attempt(name, path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
        print("PROBE", name, "ALLOWED")
    except OSError:
        print("PROBE", name, "DENIED")


def name_itself():
    attempt("thread_names_itself", f"/proc/self/task/{threading.get_native_id()}/comm", "frontier-thread")
    print("PROBE name", open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip())


thread = threading.Thread(target=name_itself)
thread.start()
thread.join()
attempt("parent_thread_name", f"/proc/{parent}/task/{parent}/comm", "x")
attempt("process_files", f"/proc/{pid}/oom_score_adj", "1000")
attempt("own_cgroup_files", f"/proc/{pid}/task/{pid}/../../cgroup", "x")
attempt("lower_own_oom_score", f"/proc/{pid}/task/{pid}/oom_score_adj", "-1000")
attempt("write_tmp", "/tmp/frontier-thread-probe", "x")
"""


@pytest.mark.skipif(sandbox.sandbox_shortfall() != "", reason="needs the worker's full sandbox (Landlock 6+, seccomp)")
def test_a_cuda_worker_s_threads_name_themselves_inside_the_sandbox_and_nothing_more():
    """What CUDA's start needs of the sandbox, on a CPU: a thread writes its own name through
    /proc/self/task/<tid>/comm under the rule a CUDA worker adds (and not without it); the parent's
    threads, the process's own /proc files, its cgroup, a lower OOM score and every other write stay
    refused."""
    import subprocess
    import sys
    from helpers import REPO
    probes = {}
    for variant in ("rule", "none"):
        out = subprocess.run([sys.executable, "-c", NAMES_PROBE, str(REPO), variant], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        probes[variant] = dict(line.split()[1:3] for line in out.stdout.splitlines() if line.startswith("PROBE "))
    assert probes["rule"]["thread_names_itself"] == "ALLOWED" and probes["rule"]["name"] == "frontier-thread"
    assert probes["none"]["thread_names_itself"] == "DENIED"
    for denied in ("parent_thread_name", "process_files", "own_cgroup_files", "lower_own_oom_score", "write_tmp"):
        assert probes["rule"][denied] == "DENIED", (denied, probes["rule"])
