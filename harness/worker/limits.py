"""What a worker may consume, and the removal of what it leaves. The harness's side, but for the
rlimits, which the worker sets on itself (`apply_rlimits`).

The caps (`worker_limits`), each with a default an honest model never meets and an environment
variable that changes it (the worker never sees FRONTIER_* variables):

    memory   FRONTIER_WORKER_MEMORY_MB  the anonymous and shared memory of all its processes (the
                                        logits buffers the harness shares with it not counted), and
                                        memory files it holds; default 3/4 of the machine's memory,
                                        shared out over the local ranks under torchrun
    disk     FRONTIER_WORKER_DISK_MB    what its private folder holds (allocated blocks), and files
                                        there it deleted but still holds open; default 16 GiB
    files    FRONTIER_WORKER_FILES      entries in its private folder; default 100,000
    tasks    FRONTIER_WORKER_TASKS      processes and threads of its process group (which nothing it
                                        starts can leave); default 1,024 + 16 per CPU (thread pools
                                        grow with the CPUs)

`Watchdog` measures them while the worker runs (tasks and memory every TICK_SECONDS, the folder
every DISK_SECONDS or less often when it is large) and, past a cap, kills the worker's process
group and keeps the reason, which the harness then reports as the worker's one error. What it
measures between two looks can exceed a cap; the worker's own rlimits (`worker_rlimits`: no file
larger than the disk cap, no core dump) bound a single file exactly.

`remove_tree` removes a worker's folder whatever it holds: nesting of any depth, paths longer
than PATH_MAX, folders and files without permissions, FIFOs, sockets, hard links, symbolic links
(removed, never followed)."""
from __future__ import annotations

import os
import resource
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness.common import HarnessError

TICK_SECONDS = 0.1  # how often tasks and memory are measured
DISK_SECONDS = 1.0  # how often the private folder is measured, at most
MAX_SCAN_SHARE = 0.1  # a measurement that took t seconds waits t / MAX_SCAN_SHARE for the next ...
MAX_WAIT_SECONDS = 1.0  # ... but never longer than this
LOOK_SECONDS = 5.0  # the most one look from user space may take; past it the worker is stopped
MAX_DESCRIPTORS = 16384  # open files per process of the worker (RLIMIT_NOFILE); an honest one holds hundreds
DEFAULT_DISK_BYTES = 16 << 30
DEFAULT_FILES = 100_000
BASE_TASKS, TASKS_PER_CPU = 1024, 16
MEMORY_SHARE = 0.75  # of the machine's memory, for all the local ranks' workers together
LIMIT_VARIABLES = {"memory": ("FRONTIER_WORKER_MEMORY_MB", 1 << 20), "disk": ("FRONTIER_WORKER_DISK_MB", 1 << 20),
                   "files": ("FRONTIER_WORKER_FILES", 1), "tasks": ("FRONTIER_WORKER_TASKS", 1)}


@dataclass(frozen=True)
class Limits:
    memory: int  # bytes
    disk: int  # bytes
    files: int
    tasks: int


def machine_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise HarnessError("/proc/meminfo has no MemTotal line")


def worker_limits() -> Limits:
    """The caps in force: the defaults, or the FRONTIER_WORKER_* variables (positive integers)."""
    local_workers = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    values = {"memory": int(MEMORY_SHARE * machine_memory_bytes()) // local_workers, "disk": DEFAULT_DISK_BYTES,
              "files": DEFAULT_FILES, "tasks": BASE_TASKS + TASKS_PER_CPU * (os.cpu_count() or 1)}
    for key, (variable, unit) in LIMIT_VARIABLES.items():
        raw = os.environ.get(variable, "").strip()
        if raw:
            if not raw.isdigit() or int(raw) < 1:
                raise HarnessError(f"${variable} must be a positive integer, got {raw!r}")
            values[key] = int(raw) * unit
    return Limits(**values)


def worker_rlimits(limits: Limits) -> dict:
    """The rlimits a worker sets on itself before participant code runs (kept by all it starts):
    no file larger than the disk cap; no core dump (it would land in the private folder); at most
    MAX_DESCRIPTORS open files per process (or the harness's own hard limit, if lower)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    descriptors = MAX_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(MAX_DESCRIPTORS, hard)
    return {"RLIMIT_FSIZE": limits.disk, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": descriptors}


def apply_rlimits(rlimits: dict) -> None:
    """The worker's end: set each rlimit, soft and hard (so nothing it starts can raise it)."""
    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


# ---------------------------------------------------------------------------------------------
# Measuring a worker
# ---------------------------------------------------------------------------------------------

def process_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, process group, threads) of every process visible in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                table[int(entry)] = (int(fields[1]), int(fields[2]), int(fields[17]))
            except (OSError, ValueError, IndexError):
                continue
    return table


def group_tasks(group: int, table: dict) -> dict[int, int]:
    """pid -> threads of the processes of a process group (zombies count: they hold their pid)."""
    return {pid: threads for pid, (_, pgrp, threads) in table.items() if pgrp == group}


def process_memory(pid: int, proportional: bool = False) -> int:
    """Bytes of anonymous and shared memory a process has mapped: what it allocated, whatever the
    call (its files' pages are the page cache's). Resident (RssAnon + RssShmem, cheap), or
    proportional (Pss_Anon + Pss_Shmem: a page shared by n processes counts 1/n in each, as the
    pages a fork shares with its parent are; it costs a walk of the process's page tables).
    0 once the process is gone."""
    path, keys = (f"/proc/{pid}/smaps_rollup", (b"Pss_Anon:", b"Pss_Shmem:")) if proportional else \
        (f"/proc/{pid}/status", (b"RssAnon:", b"RssShmem:"))
    total = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(keys):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def group_memory(pids, shared_bytes: int, cap: int) -> int:
    """The memory of the processes, less the harness's buffers they map: resident, or, when that
    exceeds cap, proportional (a fork's pages shared with its parent then count once)."""
    used = sum(process_memory(p) for p in pids) - shared_bytes
    if used > cap:
        used = sum(process_memory(p, proportional=True) for p in pids) - shared_bytes
    return max(0, used)


def folder_use(root: Path, max_entries: int, deadline: float = float("inf")) -> tuple[int, int]:
    """(allocated bytes, entries) beneath root, at any depth (walk_tree); stops counting past
    max_entries (the cap is exceeded then, whatever the rest holds). LookTooLong past deadline."""
    total = Usage()

    def count(fd: int, entries: list) -> list[str] | None:
        if time.monotonic() > deadline:
            raise LookTooLong
        folders = []
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:  # removed meanwhile
                continue
            total.files += 1
            total.disk += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                folders.append(entry.name)
        return folders if total.files <= max_entries else None

    walk_tree(root, count)
    return total.disk, total.files


def held_files(pids, device: int, skip: set, deadline: float = float("inf")) -> tuple[int, int]:
    """(bytes of deleted files on `device` that the processes still hold open, bytes of memory
    files they hold), each file once; `skip` holds (device, inode) of the harness's own buffers.
    LookTooLong past deadline (a process can hold many descriptors, and pass them on)."""
    seen, on_disk, in_memory = set(skip), 0, 0
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for i, name in enumerate(names):
            if i % 256 == 0 and time.monotonic() > deadline:
                raise LookTooLong
            path = f"/proc/{pid}/fd/{name}"
            try:
                if not os.readlink(path).endswith(" (deleted)"):
                    continue
                info = os.stat(path)
            except OSError:
                continue
            if (info.st_dev, info.st_ino) in seen or not stat.S_ISREG(info.st_mode):
                continue
            seen.add((info.st_dev, info.st_ino))
            if info.st_dev == device:
                on_disk += info.st_blocks * 512
            elif os.readlink(path).startswith("/memfd:"):
                in_memory += info.st_blocks * 512
    return on_disk, in_memory


@dataclass
class Usage:
    memory: int = 0
    disk: int = 0
    files: int = 0
    tasks: int = 0

    def peak(self, other: "Usage") -> None:
        for key in ("memory", "disk", "files", "tasks"):
            setattr(self, key, max(getattr(self, key), getattr(other, key)))


def describe(usage: Usage, limits: Limits) -> str:
    """The usage beside its caps, in one line."""
    mib = 1 << 20
    return (f"memory {usage.memory // mib} of {limits.memory // mib} MiB, disk {usage.disk // mib} of "
            f"{limits.disk // mib} MiB, {usage.files} of {limits.files} files, {usage.tasks} of {limits.tasks} "
            "processes and threads")


def over_cap(usage: Usage, limits: Limits) -> str:
    """What usage exceeds, in words ('' when nothing)."""
    mib = 1 << 20
    if usage.tasks > limits.tasks:
        return (f"ran {usage.tasks} processes and threads, more than its cap of {limits.tasks} "
                f"(${LIMIT_VARIABLES['tasks'][0]})")
    if usage.memory > limits.memory:
        return (f"held {usage.memory // mib} MiB of memory, more than its cap of {limits.memory // mib} MiB "
                f"(${LIMIT_VARIABLES['memory'][0]})")
    if usage.disk >= limits.disk:  # no file grows past the cap (RLIMIT_FSIZE): reaching it is the flood
        return (f"wrote {usage.disk // mib} MiB into its private folder, up to its cap of {limits.disk // mib} "
                f"MiB (${LIMIT_VARIABLES['disk'][0]})")
    if usage.files > limits.files:
        return (f"made more than {limits.files} files and folders in its private folder, its cap "
                f"(${LIMIT_VARIABLES['files'][0]})")
    return ""


class LookTooLong(Exception):
    """A look at a worker from user space ran past LOOK_SECONDS."""


def kernel_reason(stopped: dict, usage: Usage, limits: Limits) -> str:
    """What the kernel stopped (kernel_caps.Caps.over), in words ('' when nothing)."""
    mib = 1 << 20
    if stopped["memory"]:
        return (f"held more memory than its cap of {limits.memory // mib} MiB: the kernel's OOM killer stopped it "
                f"(${LIMIT_VARIABLES['memory'][0]})")
    if stopped["tasks"]:
        return (f"tried to run more processes and threads than its cap of {limits.tasks}: the kernel refused "
                f"the rest (${LIMIT_VARIABLES['tasks'][0]})")
    if stopped["disk"]:
        return (f"wrote {usage.disk // mib} MiB into its private folder, up to its cap of {limits.disk // mib} MiB "
                f"(${LIMIT_VARIABLES['disk'][0]})")
    if stopped["files"]:
        return (f"made more than {limits.files} files and folders in its private folder, its cap "
                f"(${LIMIT_VARIABLES['files'][0]})")
    return ""


class Watchdog:
    """Watches a running worker and stops it past a cap: `reason` then says which, `peak` holds the
    most of each it saw. With `caps` (kernel_caps.Caps: the kernel enforces the caps) a look reads
    what the kernel counted and stopped, a few small files whatever the worker does. Without, it
    measures from user space: the worker's process group (/proc) and its private folder (a walk),
    each look within LOOK_SECONDS. Whatever a look meets, the watchdog does not die: a look that
    fails or runs out of time stops the worker, with the reason. `shared_bytes` and `shared_files`
    are the harness's buffers the worker maps (not the worker's to pay for)."""

    def __init__(self, group: int, private_dir: Path, limits: Limits, kill, caps=None):
        self.group, self.private_dir, self.limits, self.kill, self.caps = group, private_dir, limits, kill, caps
        self.device = os.stat(private_dir).st_dev
        self.shared_bytes, self.shared_files = 0, set()
        self.reason = ""
        self.peak = Usage()
        self._disk, self._over_memory = Usage(), 0  # the folder's last measure; memory looks over in a row
        self._lock = threading.Lock()  # one look at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="frontier-watchdog")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, after one last look (what the worker did since the previous one counts)."""
        self._stop.set()
        self._thread.join(timeout=LOOK_SECONDS + 1)
        self.look_now()

    def look_now(self) -> str:
        """Look once more, folder included (the worker has just failed, or is about to be
        stopped): what is over its cap, and the worker stopped if anything is; '' if nothing."""
        with self._lock:
            if not self.reason:
                self._over_memory = max(self._over_memory, 1)  # one more look over is enough now
                self._safe_look(True)
        return self.reason

    def _run(self) -> None:
        next_disk, wait = 0.0, TICK_SECONDS
        try:
            while not self._stop.wait(wait):
                t0 = time.monotonic()
                with self._lock:
                    if self.reason or self._safe_look(t0 >= next_disk):
                        return
                spent = time.monotonic() - t0
                if t0 >= next_disk:
                    next_disk = time.monotonic() + max(DISK_SECONDS, spent / MAX_SCAN_SHARE)
                wait = min(MAX_WAIT_SECONDS, max(TICK_SECONDS, spent / MAX_SCAN_SHARE))
        except BaseException as e:  # noqa: BLE001 - a watchdog that stops watching stops the worker
            self.reason = self.reason or f"outlived its watchdog ({type(e).__name__})"
            self.kill()

    def _safe_look(self, with_disk: bool) -> str:
        """One look, under the lock; the worker stopped if it is over a cap, or if the look failed
        or ran out of time (a worker is never left running unwatched). Returns the reason or ''."""
        try:
            if self.caps is not None:
                reason = self._kernel_look()
            else:
                reason, self._over_memory = self._look(with_disk, self._disk, self._over_memory,
                                                       time.monotonic() + LOOK_SECONDS)
        except LookTooLong:
            reason = (f"kept its watchdog from measuring it within {LOOK_SECONDS:.0f} s (more descriptors or "
                      "folder entries than a look can read)")
        except Exception as e:  # noqa: BLE001 - whatever it is, the worker is stopped, not left unwatched
            cause = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else type(e).__name__
            reason = f"made its watchdog fail ({cause})"  # no text of the worker's: a file name could be
        if reason:
            self.reason = reason
            self.kill()
        return reason

    def _kernel_look(self) -> str:
        got = self.caps.usage()
        usage = Usage(memory=max(0, got["memory"] - self.shared_bytes), disk=got["disk"], files=got["files"],
                      tasks=got["tasks"])
        self.peak.peak(usage)
        return kernel_reason(self.caps.over(), usage, self.limits)

    def _look(self, with_disk: bool, disk: Usage, over_memory: int, deadline: float) -> tuple[str, int]:
        """One measurement from user space: (what is over its cap or '', looks in a row with memory
        over its cap). The cheapest first: a worker over its task cap is stopped before its memory
        is summed. LookTooLong past deadline."""
        members = group_tasks(self.group, process_table())
        usage = Usage(tasks=sum(members.values()), disk=disk.disk, files=disk.files)
        self.peak.peak(usage)
        if usage.tasks > self.limits.tasks:
            return over_cap(usage, self.limits), 0
        if with_disk:
            disk.disk, disk.files = folder_use(self.private_dir, self.limits.files, deadline)
            held_disk, disk.memory = held_files(members, self.device, self.shared_files, deadline)
            disk.disk += held_disk
        usage.disk, usage.files = disk.disk, disk.files
        usage.memory = group_memory(members, self.shared_bytes, self.limits.memory) + disk.memory
        self.peak.peak(usage)
        reason = over_cap(usage, self.limits)
        # Memory is over only when two looks in a row say so: a vfork()ed child shares its
        # parent's memory until it execs, and both would count it.
        over_memory = over_memory + 1 if reason.startswith("held") else 0
        return (reason if over_memory >= 2 or not reason.startswith("held") else ""), over_memory


# ---------------------------------------------------------------------------------------------
# Removing what a worker leaves
# ---------------------------------------------------------------------------------------------

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _make_enterable(parent_fd: int, name: str) -> None:
    """Give the folder `name` (in parent_fd) rwx for its owner, so it can be listed and emptied
    (the harness may not be root). Through an O_PATH descriptor: no symbolic link is followed."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
            os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def _enter(fd: int, name: str) -> int:
    """The folder `name` in fd, opened (made enterable first); fd stays open."""
    _make_enterable(fd, name)
    return os.open(name, DIR_FLAGS, dir_fd=fd)


def walk_tree(root: Path, on_folder, on_left=None) -> None:
    """Visit root and every folder beneath it, depth first, without recursion and without paths:
    the walk holds one folder descriptor at a time and, per level, the names of the folders left
    to visit, so neither depth, nor path length, nor permission bits stop it. on_folder(fd,
    entries) gets each folder's descriptor and its os.DirEntry list, and returns the names of the
    subfolders to visit (None: stop the walk); on_left(parent_fd, name), if given, runs once a
    folder and all beneath it have been visited (for root, with its parent's descriptor). A
    subfolder removed between its listing and its visit is skipped; each descriptor is closed once."""
    root = Path(os.path.abspath(root))
    parent = os.open(root.parent, DIR_FLAGS)
    try:
        fd = _enter(parent, root.name)
    finally:
        os.close(parent)
    try:
        stack = [(root.name, None)]  # (a folder's name in its parent, its subfolders left to visit)
        while stack:
            name, pending = stack[-1]
            if pending is None:
                with os.scandir(fd) as it:
                    pending = on_folder(fd, list(it))
                if pending is None:
                    return
                stack[-1] = (name, pending)
            elif pending:
                sub = pending.pop()
                try:
                    inner = _enter(fd, sub)
                except FileNotFoundError:  # removed since it was listed: nothing beneath it to visit
                    continue
                os.close(fd)
                fd = inner
                stack.append((sub, None))
            else:
                stack.pop()
                parent = os.open("..", DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                if on_left is not None:
                    on_left(fd, name)
    finally:
        os.close(fd)


def remove_tree(root: Path) -> None:
    """Remove root (a folder) and everything beneath it (walk_tree: any depth, any path length,
    any permission bits; symbolic links are removed, never followed). OSError if something cannot
    be removed. Call it only once nothing can still write there (the worker and all it started
    are dead)."""

    def unlink_files(fd: int, entries: list) -> list[str]:
        folders = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
        return folders

    walk_tree(root, unlink_files, lambda parent_fd, name: os.rmdir(name, dir_fd=parent_fd))
