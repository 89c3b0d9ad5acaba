"""The worker's device and its sandbox: the device is found before the sandbox without starting one ("auto" is
never turned into a slower device by what the sandbox keeps from starting: on an H200 under Firecracker CUDA
failed under the sandbox and "auto" silently scored on the CPU); every part of the sandbox binds only the thread
that applies it and the threads started later, so the worker applies it while it is one thread, starts the
device inside it (the driver's threads inherit it), puts the seccomp filter on every thread at once, and asks the
kernel whether each thread is confined; a CUDA worker's threads may name themselves and do nothing more; a device
that does not work is one clear error before any participant code runs."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.common import HarnessError
from harness.worker import harness_side, sandbox, worker_side
from helpers import REPO

FULL_SANDBOX = pytest.mark.skipif(sandbox.sandbox_shortfall() != "", reason="needs the worker's full sandbox "
                                                                              "(Landlock 6+, seccomp)")


def test_auto_is_the_device_found_before_the_sandbox(monkeypatch):
    server = worker_side.Server.__new__(worker_side.Server)
    worker_side.Server.__init__(server, sock=None)
    started = []
    monkeypatch.setattr(worker_side, "device_present", lambda: "cuda")
    monkeypatch.setattr(worker_side, "start_device", started.append)
    assert server.sandbox({"off": True, "rlimits": {}, "device": "auto", "local_rank": 3}) == {"applied": []}
    assert server.present == "cuda" and started == [torch.device("cuda:3")]
    assert worker_side.resolve_device("auto", 3, server.present) == torch.device("cuda:3")
    assert worker_side.resolve_device("cpu", 3, server.present) == torch.device("cpu")
    assert worker_side.resolve_device("auto", 0, "cpu") == torch.device("cpu")


def test_a_gpu_is_found_without_starting_it(monkeypatch):
    """A GPU's device node and a CUDA build say "cuda"; CUDA itself (whose driver starts threads) is not asked."""
    def started(*args):
        raise AssertionError("CUDA was started to find it")
    monkeypatch.setattr(torch.cuda, "is_available", started)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr("glob.glob", lambda pattern: ["/dev/nvidia0"] if pattern == "/dev/nvidia[0-9]*" else [])
    assert worker_side.device_present() == "cuda"


def test_a_cuda_device_that_does_not_start_is_one_clear_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Unexpected error from cudaGetDeviceCount(). Error 304: OS call failed\nmore")
    monkeypatch.setattr(torch, "ones", broken)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(HarnessError, match=r"cannot start cuda:0 on this machine .*Error 304.*--device cpu.*"
                                           r"--no-sandbox"):
        worker_side.start_device(torch.device("cuda:0"))
    worker_side.start_device(torch.device("cpu"))  # nothing to start on the CPU


def test_a_worker_has_one_blas_thread():
    """numpy's OpenBLAS starts a pool at import (before the sandbox); the worker's environment keeps it to one
    thread, so the worker is one thread when its sandbox applies."""
    env = harness_side.worker_environment(REPO / "x", REPO)
    assert env["OPENBLAS_NUM_THREADS"] == "1"
    count = "import os, numpy, torch; print(len(os.listdir('/proc/self/task')))"
    out = subprocess.run([sys.executable, "-c", count], capture_output=True, text=True, timeout=120,
                         env={"PATH": env["PATH"], "OPENBLAS_NUM_THREADS": "1"})
    assert out.stdout.strip() == "1", out.stderr[-2000:]


# A child enters the worker's sandbox (worker_side.enter_sandbox): "early" starts a thread first; "driver" starts
# one where the device starts (after Landlock, before the seccomp filter), as a CUDA driver does, and that thread
# then tries what the sandbox refuses.
THREADS_PROBE = r"""
import os, socket, sys, tempfile, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from harness.worker import sandbox, worker_side
import torch
secret = Path(sys.argv[3])
rules = sandbox.worker_rules(Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp()))
rules += [(p, "execute") for p in sys.path if os.path.isabs(p) and os.path.isdir(p)]
msg = {"noatime": False, "abi": sandbox.landlock_abi(), "rules": rules, "seccomp": sandbox.seccomp_arch()}
go, done = threading.Event(), threading.Event()


def driver_thread():
    go.wait()
    for name, action in (("read", lambda: secret.read_text()), ("socket", lambda: socket.socket(socket.AF_UNIX))):
        try:
            action()
            print("PROBE", name, "ALLOWED")
        except OSError:
            print("PROBE", name, "DENIED")
    status = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
    print("PROBE seccomp", "2" if "Seccomp:	2" in status else "0")
    done.set()


if sys.argv[2] == "early":
    threading.Thread(target=driver_thread, daemon=True).start()
else:
    worker_side.start_device = lambda device: threading.Thread(target=driver_thread, daemon=True).start()
try:
    print("PROBE applied", "+".join(worker_side.enter_sandbox(msg, torch.device("cpu"))))
except Exception as e:
    print("PROBE refused", str(e).replace(chr(10), " "))
    sys.exit(0)
go.set()
done.wait(60)
"""


@FULL_SANDBOX
def test_a_thread_started_before_the_sandbox_is_refused_and_one_started_inside_is_confined(tmp_path):
    """The escape this closes: a thread that existed before the sandbox (numpy's BLAS pool, a driver started
    first) kept no seccomp filter, no Landlock domain and every capability, and participant code could run on it.
    Now a worker with such a thread refuses to go on; a thread started where the device starts, between Landlock
    and the seccomp filter, gets both."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the private shard")
    probes = {}
    for variant in ("early", "driver"):
        out = subprocess.run([sys.executable, "-c", THREADS_PROBE, str(REPO), variant, str(secret)],
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                               "OPENBLAS_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        probes[variant] = {line.split()[1]: " ".join(line.split()[2:]) for line in out.stdout.splitlines()
                           if line.startswith("PROBE ")}
    assert probes["early"]["refused"].startswith("the worker runs 2 threads before its sandbox"), probes["early"]
    assert "applied" not in probes["early"]
    assert probes["driver"] == {"applied": f"capabilities+landlock-{sandbox.landlock_abi()}+seccomp", "read": "DENIED",
                                "socket": "DENIED", "seccomp": "2"}, probes["driver"]
    assert sandbox.unconfined_threads(seccomp=True)  # the control: the test's own threads are outside any sandbox


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


@FULL_SANDBOX
def test_a_cuda_worker_s_threads_name_themselves_inside_the_sandbox_and_nothing_more():
    """What CUDA's start needs of the sandbox, on a CPU: a thread writes its own name through
    /proc/self/task/<tid>/comm under the rule a CUDA worker adds (and not without it); the parent's
    threads, the process's own /proc files, its cgroup, a lower OOM score and every other write stay
    refused."""
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
