"""Caps the kernel enforces on a worker (limits.py names them; the harness's side).

    memory, tasks   a cgroup of the worker's own, created before it starts and joined by it before
                    it execs: a memory limit with swap off (the kernel counts anonymous, shared and
                    memfd memory, page cache, page tables, pipe and socket buffers and other kernel
                    memory, whoever holds the descriptor, and its OOM killer stops the cgroup at the
                    limit) and a pids limit (a fork or thread past it fails with EAGAIN).
                    cgroup v2 (memory.max, memory.swap.max, pids.max; memory.events and pids.events
                    name the cause), or v1 where the controllers are mounted there (memory.limit_in_bytes,
                    memory.memsw.limit_in_bytes, pids.max; memory.oom_control, pids.events).
    disk, files     the private folder is a tmpfs mounted for the worker: size= the disk cap,
                    nr_inodes= the files cap, so a write or create past either ends with ENOSPC.
                    A tmpfs holds its files in memory, and the pages the worker writes are charged
                    to its cgroup: what its folder holds counts against both caps (folder <= disk
                    cap, folder + memory <= memory cap). Deleted files it holds open stay in the
                    tmpfs, so they count too.

The worker cannot lift them: it has no capabilities (no mount, no remount) and Landlock keeps it
from writing any cgroup file. The harness reads what the kernel counted (`Caps.usage`, `Caps.over`):
reading a few small files costs the same whatever the worker does. Where this machine does not let
the harness create a cgroup or mount a tmpfs (not root, no writable hierarchy, no memory or pids
controller), `create` says why: the run is then not official and limits.Watchdog measures from user
space instead. A crashed harness leaves a mount and cgroups behind; `remove_stale` (called before a
worker starts) removes those whose harness is dead (their names carry its pid)."""
from __future__ import annotations

import ctypes
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.worker.sandbox import read_mountinfo

PREFIX = "frontier-worker-"  # of a worker's cgroup and folder: frontier-worker-<harness pid>-...
V2_PARENT = "frontier-workers"  # on cgroup v2, the cgroup (under the root) that holds the workers' cgroups
REMOVE_SECONDS = 10.0  # how long a cgroup's removal waits for its processes to be gone
MNT_DETACH = 2
_STALE = re.compile(rf"{PREFIX}(\d+)-")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: Path, value) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")


def _keyed(path: Path, key: str) -> int:
    """The number after `key` in a file of `key value` lines (memory.events, pids.events,
    memory.oom_control); 0 if the file or the key is missing."""
    try:
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _int(path: Path) -> int:
    try:
        text = _read(path).strip()
        return int(text) if text.isdigit() else 0
    except OSError:
        return 0


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> dict[str, tuple[str, str]]:
    """Where each hierarchy is mounted: {"v2": (mount point, mount root)} and, per v1 controller
    mounted, {"memory": (...), "pids": (...)}."""
    found = {}
    for mount in read_mountinfo(mountinfo):
        if mount.fstype == "cgroup2":
            found.setdefault("v2", (mount.point, mount.root))
        elif mount.fstype == "cgroup":
            for controller in set(mount.super_options) & {"memory", "pids"}:
                found.setdefault(controller, (mount.point, mount.root))
    return found


def own_cgroups(path: str = "/proc/self/cgroup") -> dict[str, str]:
    """This process's cgroup per hierarchy: {"v2": path} and {"memory": path, "pids": path} (v1)."""
    found = {}
    for line in _read(Path(path)).splitlines():
        _, controllers, cgroup = line.split(":", 2)
        if controllers == "":
            found["v2"] = cgroup
        for controller in controllers.split(","):
            found[controller] = cgroup
    return found


def _under(mount: tuple[str, str], cgroup: str) -> Path:
    """The folder of `cgroup` in a hierarchy mounted at mount (a mount of a sub-tree starts there)."""
    point, root = mount
    relative = os.path.relpath(cgroup, root) if cgroup.startswith(root) else cgroup.lstrip("/")
    return Path(point) / ("" if relative == "." else relative)


@dataclass
class Caps:
    """One worker's caps, in force until `remove`: its cgroup folders (`folders`: one on v2; the
    memory and the pids folder on v1) and its private folder, a tmpfs."""
    version: int
    folders: list[Path]
    private_dir: Path
    memory: int
    tasks: int
    mounted: bool = False

    def join_fds(self) -> list[int]:
        """Descriptors of the cgroup.procs files, opened for the child to write "0" (itself) into
        before it execs (`join`): nothing it runs ever runs outside the cgroup."""
        return [os.open(folder / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for folder in self.folders]

    @property
    def memory_folder(self) -> Path:
        return self.folders[0]

    @property
    def pids_folder(self) -> Path:
        return self.folders[-1]

    def set_memory(self, memory: int) -> None:
        """The memory limit, with swap off (v1: memory + swap limited to the same; raised in the
        order the kernel accepts)."""
        if self.version == 2:
            _write(self.memory_folder / "memory.max", memory)
            _write(self.memory_folder / "memory.swap.max", 0)
            return
        limit = self.memory_folder / "memory.limit_in_bytes"
        memsw = self.memory_folder / "memory.memsw.limit_in_bytes"  # absent without swap accounting
        if memsw.exists() and memory > _int(limit):  # memory + swap may never be below memory alone
            _write(memsw, memory)
        _write(limit, memory)
        if memsw.exists():
            _write(memsw, memory)
        self.memory = memory

    def usage(self) -> dict:
        """What the kernel counted: memory (the most at any moment, page cache included), tasks
        (now, and the most), the private folder's bytes and entries (now)."""
        if self.version == 2:
            memory = _int(self.memory_folder / "memory.peak") or _int(self.memory_folder / "memory.current")
        else:
            memory = _int(self.memory_folder / "memory.max_usage_in_bytes")
        tasks = max(_int(self.pids_folder / "pids.current"), _int(self.pids_folder / "pids.peak"))
        disk, files = self.folder_use()
        return {"memory": memory, "tasks": tasks, "disk": disk, "files": files}

    def folder_use(self) -> tuple[int, int]:
        """(bytes, entries) the private folder holds: the tmpfs's own count (files deleted but held
        open included)."""
        st = os.statvfs(self.private_dir)
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree - 1  # less the root

    def over(self) -> dict:
        """What the kernel stopped: {"memory": OOM kills, "tasks": forks refused, "disk": 1 if the
        folder is full, "files": 1 if its inodes are spent}."""
        if self.version == 2:
            oom = _keyed(self.memory_folder / "memory.events", "oom_kill")
        else:
            oom = _keyed(self.memory_folder / "memory.oom_control", "oom_kill")
        st = os.statvfs(self.private_dir)
        return {"memory": oom, "tasks": _keyed(self.pids_folder / "pids.events", "max"),
                "disk": int(st.f_bfree == 0), "files": int(st.f_ffree == 0)}

    def pids(self) -> set[int]:
        found = set()
        for folder in self.folders:
            try:
                found |= {int(p) for p in _read(folder / "cgroup.procs").split()}
            except (OSError, ValueError):
                pass
        return found

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (v2: cgroup.kill, which no fork can race)."""
        if self.version == 2 and (self.memory_folder / "cgroup.kill").exists():
            try:
                _write(self.memory_folder / "cgroup.kill", 1)
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def remove(self) -> None:
        """Kill what is left in the cgroup, remove its folders (waiting up to REMOVE_SECONDS for
        the processes to be gone) and unmount the private folder (what it held is freed). OSError
        if a cgroup outlives the wait."""
        give_up = time.monotonic() + REMOVE_SECONDS
        for folder in self.folders:
            while folder.exists():
                self.kill()
                try:
                    folder.rmdir()
                except OSError:
                    if time.monotonic() > give_up:
                        raise
                    time.sleep(0.01)
        if self.mounted and _libc.umount2(str(self.private_dir).encode(), MNT_DETACH) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"unmounting the worker's folder: {os.strerror(e)}", str(self.private_dir))
        self.mounted = False


def join(fds: list[int]) -> None:
    """The child's end, between fork and exec: move itself into the cgroup (a "0" written to each
    cgroup.procs is the writer itself)."""
    for fd in fds:
        os.write(fd, b"0")


def _mount_tmpfs(folder: Path, size: int, inodes: int) -> None:
    options = f"size={size},nr_inodes={inodes},mode=0700".encode()
    if _libc.mount(b"tmpfs", str(folder).encode(), b"tmpfs", 0, options) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mounting a tmpfs there: {os.strerror(e)}", str(folder))


def _v2_parent(mounts: dict) -> Path:
    """The v2 cgroup that holds the workers' (created under the hierarchy's root, where controllers
    can be handed down while processes live in the root), with memory and pids handed down."""
    root = Path(mounts["v2"][0])
    available = _read(root / "cgroup.controllers").split()
    missing = {"memory", "pids"} - set(available)
    if missing:
        raise OSError(0, f"cgroup v2 lacks the {' and '.join(sorted(missing))} controller", str(root))
    parent = root / V2_PARENT
    parent.mkdir(exist_ok=True)
    for folder in (root, parent):
        enabled = _read(folder / "cgroup.subtree_control").split()
        if not {"memory", "pids"} <= set(enabled):
            _write(folder / "cgroup.subtree_control", "+memory +pids")
    return parent


def create(private_dir: Path, memory: int, disk: int, files: int, tasks: int, name: str) -> Caps:
    """The caps for one worker: a tmpfs mounted on private_dir (empty) and a cgroup `name` with its
    limits. OSError (with what failed) where this machine does not allow it; nothing is left then."""
    mounts = cgroup_mounts()
    own = own_cgroups()
    v2_ready = "v2" in mounts and {"memory", "pids"} <= set(
        _read(Path(mounts["v2"][0]) / "cgroup.controllers").split())
    if v2_ready:
        folders = [_v2_parent(mounts) / name]
    elif "memory" in mounts and "pids" in mounts:
        folders = [_under(mounts[c], own[c]) / name for c in ("memory", "pids")]
    else:
        raise OSError(0, "no cgroup hierarchy with the memory and pids controllers is mounted", "/proc/self/mountinfo")
    caps = Caps(2 if v2_ready else 1, [], private_dir, memory, tasks)
    try:
        for folder in folders:
            folder.mkdir()
            caps.folders.append(folder)
        caps.set_memory(memory)
        if caps.version == 2:
            _write(caps.memory_folder / "memory.oom.group", 1)  # an OOM kill takes the whole worker
        _write(caps.pids_folder / "pids.max", tasks)
        _mount_tmpfs(private_dir, disk, files + 1)  # + its root folder
        caps.mounted = True
    except OSError:
        try:
            caps.remove()
        except OSError:
            pass
        raise
    return caps


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale() -> list[str]:
    """Remove what a harness that died left: its workers' tmpfs mounts (in the temporary folder)
    and cgroups, recognised by the PREFIX and the dead harness's pid in their names. Returns what
    it removed."""
    removed = []
    temp = os.path.realpath(tempfile.gettempdir())
    try:
        points = [mount.point for mount in read_mountinfo()]
    except OSError:
        points = []
    for point in points:
        found = _STALE.match(os.path.basename(point))
        if found and os.path.dirname(point) == temp and not _alive(int(found.group(1))):
            if _libc.umount2(point.encode(), MNT_DETACH) == 0:
                removed.append(point)
    try:
        mounts, own = cgroup_mounts(), own_cgroups()
    except OSError:
        return removed
    parents = []
    if "v2" in mounts:
        parents.append(Path(mounts["v2"][0]) / V2_PARENT)
    parents += [_under(mounts[c], own[c]) for c in ("memory", "pids") if c in mounts and c in own]
    for parent in parents:
        for folder in parent.glob(f"{PREFIX}*") if parent.is_dir() else ():
            found = _STALE.match(folder.name)
            if found and not _alive(int(found.group(1))):
                stale = Caps(2 if parent.name == V2_PARENT else 1, [folder], Path("/"), 0, 0)
                try:
                    stale.remove()
                    removed.append(str(folder))
                except OSError:
                    pass
    return removed
