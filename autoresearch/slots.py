"""
What each slot of the machine gets, and the process trees experiments run as.

A slot is one experiment's share of the machine: on Trainium one logical NeuronCore, on CUDA one
GPU, on a CPU an equal share of the CPUs this process may use (pinned, with as many threads). An
experiment's processes start in a session of their own (so Ctrl-C reaches only the loop, which
stops them in order) and carry a marker in their environment, so the whole tree can be found and
killed even where a child left the session (torchrun starts its workers in new sessions).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "AUTORESEARCH_RUN"  # environment variable naming the run directory; every descendant inherits it
KILL_GRACE_SECONDS = 5.0  # SIGTERM first (a compiler gets to drop its cache locks), then SIGKILL
POLL_SECONDS = 0.25


class SlotError(Exception):
    pass


@dataclass(frozen=True)
class Slot:
    index: int
    env: dict = field(default_factory=dict)  # variables this slot sets for its experiments
    cpus: tuple[int, ...] | None = None  # CPUs its processes are pinned to (a CPU slot); None: not pinned

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.env.items())]
        if self.cpus is not None:
            parts.insert(0, f"CPUs {','.join(map(str, self.cpus))}")
        return f"slot {self.index}: " + (", ".join(parts) or "the whole machine")


def parse_id_list(text: str, name: str) -> list[str]:
    """'0-3,6' -> ['0', '1', '2', '3', '6']; other ids (GPU UUIDs) pass through as they are."""
    ids = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise SlotError(f"{name}={text!r}: an empty entry")
        lo, sep, hi = part.partition("-")
        if sep and lo.isdigit() and hi.isdigit():
            if int(hi) < int(lo):
                raise SlotError(f"{name}={text!r}: the range {part} runs backwards")
            ids.extend(str(i) for i in range(int(lo), int(hi) + 1))
        else:
            ids.append(part)
    return ids


def accelerator_pool(name: str, n: int, environ: dict) -> list[str]:
    """The devices slots draw from: the ones `name` already makes visible, else 0..n-1."""
    if environ.get(name, "").strip():
        pool = parse_id_list(environ[name], name)
        if n > len(pool):
            raise SlotError(f"--slots {n}, but {name}={environ[name]} makes only {len(pool)} visible")
        return pool
    return [str(i) for i in range(n)]


def plan_slots(device: str, n: int, environ: dict, cores: list[tuple[int, ...]],
               cuda_count: int | None = None) -> list[Slot]:
    """The n slots for `device`. Neuron: one logical core each (NEURON_RT_VISIBLE_CORES), at the
    NEURON_LOGICAL_NC_CONFIG the environment sets (default 1). CUDA: one GPU each
    (CUDA_VISIBLE_DEVICES). CPU: len(cores) // n physical cores each (a core: the CPUs of its
    hardware threads), pinned, with one torch thread per core (OMP_NUM_THREADS), torch's own default."""
    if n < 1:
        raise SlotError(f"--slots must be at least 1, not {n}")
    if device == "neuron":
        pool = accelerator_pool("NEURON_RT_VISIBLE_CORES", n, environ)
        lnc = environ.get("NEURON_LOGICAL_NC_CONFIG", "1")
        return [Slot(k, {"NEURON_RT_VISIBLE_CORES": pool[k], "NEURON_LOGICAL_NC_CONFIG": lnc}) for k in range(n)]
    if device == "cuda":
        pool = accelerator_pool("CUDA_VISIBLE_DEVICES", n, environ)
        if cuda_count is not None and not environ.get("CUDA_VISIBLE_DEVICES", "").strip() and n > cuda_count:
            raise SlotError(f"--slots {n}, but this machine has {cuda_count} CUDA GPU(s)")
        return [Slot(k, {"CUDA_VISIBLE_DEVICES": pool[k]}) for k in range(n)]
    if device == "cpu":
        per = len(cores) // n
        if per == 0:
            raise SlotError(f"--slots {n}, but this process may use only {len(cores)} CPU core(s) "
                            f"({' '.join(','.join(map(str, c)) for c in cores)}): at most one slot per core")
        return [Slot(k, {"OMP_NUM_THREADS": str(per)}, tuple(sorted(cpu for core in cores[k * per:(k + 1) * per]
                                                                    for cpu in core))) for k in range(n)]
    raise SlotError(f"unknown device {device!r}: neuron, cuda or cpu")


def usable_cores() -> list[tuple[int, ...]]:
    """The physical cores this process may use, each as the usable CPUs of its hardware threads
    (Linux topology; elsewhere, or unreadable, every CPU counts as a core)."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = {}
    for cpu in usable:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
            key = tuple(sorted(set(int(i) for i in parse_id_list(siblings, "thread_siblings_list")) & set(usable)))
        except (OSError, ValueError, SlotError):
            key = (cpu,)
        cores.setdefault(key or (cpu,), None)
    return sorted(cores)


def pin_this_thread(slot: Slot) -> bool:
    """Pin the calling thread to the slot's CPUs: on Linux affinity belongs to a thread, and a child
    started from it inherits its mask (no preexec_fn, which is unsafe in a threaded process).
    False where the OS has no affinity call (the slot then gets only its thread count)."""
    if slot.cpus is None:
        return True
    if not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, slot.cpus)
    return True


# --- process trees -----------------------------------------------------------------------------

def marked_pids(marker: str, prefix: bool = False) -> set[int]:
    """Live processes whose environment has MARKER=marker (or, with prefix, a value starting with
    marker). Linux /proc; empty elsewhere."""
    needle = f"\0{MARKER}={marker}".encode() + (b"" if prefix else b"\0")
    found = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = b"\0" + f.read()
        except OSError:  # gone, or not ours
            continue
        if needle in environ:
            found.add(int(entry))
    return found


def kill_marked(prefix: str) -> set[int]:
    """SIGKILL every process whose marker starts with prefix (those a loop killed outright left)."""
    pids = marked_pids(prefix, prefix=True)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _signal_tree(proc: subprocess.Popen, marker: str, sig: int) -> set[int]:
    """Send sig to every process of the experiment; the ones it went to."""
    pids = marked_pids(marker)
    if proc.poll() is None:  # not reaped, so its pid still names its session's group
        pids.add(proc.pid)
        try:
            os.killpg(proc.pid, sig)  # children that dropped the marker but stayed in the group
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def kill_tree(proc: subprocess.Popen, marker: str, grace: float = KILL_GRACE_SECONDS) -> None:
    """Stop proc and every process of its experiment: SIGTERM, up to `grace` seconds to exit, then
    SIGKILL until none is left (a process forked meanwhile carries the marker and is found next)."""
    _signal_tree(proc, marker, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or marked_pids(marker)):
        time.sleep(POLL_SECONDS)
    for _ in range(100):
        if not _signal_tree(proc, marker, signal.SIGKILL):
            break
        time.sleep(POLL_SECONDS / 5)
    proc.wait()


def run_logged(cmd: list[str], cwd: Path, env: dict, log_path: Path, timeout: float,
               stop: threading.Event, header: str = "") -> tuple[str, int | None, str]:
    """Run cmd with stdout+stderr into log_path. (outcome, return code, the log): outcome is
    "exited", "timeout" (killed after `timeout` seconds) or "stopped" (`stop` was set)."""
    marker = env[MARKER]
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"{header}$ {shlex.join(cmd)}\n")
        log.flush()
        if stop.is_set():
            return "stopped", None, ""
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        outcome = "exited"
        while proc.poll() is None:
            if stop.is_set() or time.monotonic() > deadline:
                outcome = "stopped" if stop.is_set() else "timeout"
                kill_tree(proc, marker)
                break
            stop.wait(POLL_SECONDS)
        if outcome == "exited" and marked_pids(marker):
            kill_tree(proc, marker)  # the command exited but left processes behind: they go with it
    return outcome, proc.returncode if outcome == "exited" else None, log_path.read_text(encoding="utf-8",
                                                                                          errors="replace")
