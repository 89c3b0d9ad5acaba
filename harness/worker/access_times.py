"""Access times no worker can move: the harness reads, before a worker runs participant code,
every file, folder and link that worker may read whose access time a read would still update.

Reading a file, listing a folder or following a link updates its access time (atime) for any
user, and stat() shows it to any other: without this, the first worker could read a chosen set of
the files its sandbox allows and the second decode them from their atimes. On a `relatime` mount
(Linux's default) a read updates the atime only when it is not after the mtime or the ctime, or
is more than a day old (`would_move`). Once the harness has read it, no read moves it again
until its atime is a day old: so the harness reads whatever a read would move before the
worker's deadline (the day counted back from it, with a minute's slack), and a worker can move
nothing its sandbox lets it read. On a `noatime` mount nothing moves; on a `strictatime` mount
every read moves the atime, so no reading ahead can help, and the result is not official
(`strict_mounts`).

Of the kernel's own file systems, /proc moves no time at all (it is mounted without folder
atimes, and its files are generated, never read through the page cache: a test checks it), so
it is not walked; on sysfs and its kin folders and links move but files do not, so their folders
are listed and their links read, and no file of theirs is ever opened (reading some of them has
side effects or blocks). On a later run almost nothing needs reading: the walk is a stat() of
each entry."""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field

from harness.worker.sandbox import read_mountinfo

DAY_NS = 24 * 3600 * 10**9  # relatime updates an atime this old
SLACK_NS = 60 * 10**9  # the deadline may be passed by a little while the worker is stopped
NOT_WALKED = {"proc"}  # no folder atimes, no file atimes (tests/test_containment.py checks it)
FILES_NOT_READ = {"sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf", "pstore",
                  "efivarfs", "fusectl", "devtmpfs", "devpts", "mqueue", "hugetlbfs", "binfmt_misc"}


@dataclass
class Mount:
    point: str
    fstype: str
    options: set[str]


@dataclass
class Settled:
    """What settle() did: entries looked at, and those it read (files), listed (folders) or
    followed (links) because a read would have moved their atime; how long it took."""
    entries: int = 0
    files_read: int = 0
    folders_listed: int = 0
    links_read: int = 0
    unreadable: int = 0
    seconds: float = 0.0
    roots: list[str] = field(default_factory=list)


def mount_table(mountinfo: str = "/proc/self/mountinfo") -> dict[int, Mount]:
    """st_dev -> the mount of that device (the last one listed wins: it is the one on top)."""
    return {m.device: Mount(m.point, m.fstype, set(m.options)) for m in read_mountinfo(mountinfo)}


def atime_mode(mount: Mount) -> str:
    """'noatime', 'relatime' or 'strictatime': how reads on this mount update access times."""
    if "noatime" in mount.options:
        return "noatime"
    return "relatime" if "relatime" in mount.options else "strictatime"


def readable_roots(rules: list) -> list[str]:
    """The distinct real paths a worker under rules may read (not its own folder, not devices),
    none inside another."""
    paths = sorted({os.path.realpath(p) for p, kind in rules if kind in ("read", "execute", "list")
                    and os.path.lexists(p)})
    roots: list[str] = []
    for p in paths:
        if not any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots):
            roots.append(p)
    return roots


def strict_mounts(roots: list[str], mounts: dict[int, Mount]) -> list[str]:
    """The mount points, among those holding a root, where every read moves an atime."""
    found = []
    for root in roots:
        mount = mounts.get(os.stat(root).st_dev)
        if mount is not None and mount.fstype not in NOT_WALKED | FILES_NOT_READ and atime_mode(mount) == "strictatime":
            found.append(mount.point)
    return sorted(set(found))


def would_move(st: os.stat_result, horizon_ns: int) -> bool:
    """Whether a relatime read before the deadline could update this atime: it is not after the
    mtime or the ctime, or it will be a day old by then (horizon_ns = deadline - a day)."""
    return st.st_atime_ns <= st.st_mtime_ns or st.st_atime_ns <= st.st_ctime_ns or st.st_atime_ns <= horizon_ns


def _read_one_byte(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        os.read(fd, 1)  # even at the end of an empty file, a read updates the atime
    finally:
        os.close(fd)


def _touch(path: str, st: os.stat_result, fstype: str, done: Settled) -> None:
    """Read a file (one byte) or follow a link, so that its atime no longer moves."""
    try:
        if stat.S_ISLNK(st.st_mode):
            os.readlink(path)
            done.links_read += 1
        elif stat.S_ISREG(st.st_mode) and fstype not in FILES_NOT_READ:
            _read_one_byte(path)
            done.files_read += 1
    except OSError:
        done.unreadable += 1  # the harness cannot read it, so neither can a worker (it has fewer rights)


def _walk(folder: str, mounts: dict[int, Mount], horizon_ns: int, done: Settled) -> None:
    """List folder (its atime settles in the listing itself) and settle everything beneath it."""
    todo = [folder]
    while todo:
        current = todo.pop()
        try:
            before = os.lstat(current)
            with os.scandir(current) as entries:  # the listing: getdents updates the folder's atime
                listed = list(entries)
        except OSError:
            done.unreadable += 1
            continue
        done.folders_listed += would_move(before, horizon_ns)
        for entry in listed:
            done.entries += 1
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                done.unreadable += 1
                continue
            mount = mounts.get(st.st_dev)
            fstype = mount.fstype if mount is not None else ""
            if fstype in NOT_WALKED or (mount is not None and atime_mode(mount) == "noatime"):
                continue
            if stat.S_ISDIR(st.st_mode):
                todo.append(entry.path)
            elif would_move(st, horizon_ns):
                _touch(entry.path, st, fstype, done)


def settle(roots: list[str], seconds_left: float) -> Settled:
    """Read, list or follow everything beneath roots whose atime a read could still move within
    seconds_left (the worker's time to its deadline)."""
    t0 = time.monotonic()
    mounts = mount_table()
    horizon_ns = time.time_ns() + int(seconds_left * 1e9) + SLACK_NS - DAY_NS
    done = Settled(roots=list(roots))
    for root in roots:
        try:
            st = os.stat(root)
        except OSError:
            continue
        mount = mounts.get(st.st_dev)
        fstype = mount.fstype if mount is not None else ""
        if fstype in NOT_WALKED or (mount is not None and atime_mode(mount) == "noatime"):
            continue
        done.entries += 1
        if stat.S_ISDIR(st.st_mode):
            _walk(root, mounts, horizon_ns, done)
        elif would_move(st, horizon_ns):
            _touch(root, st, fstype, done)
    done.seconds = time.monotonic() - t0
    return done


def longest_settled_run_seconds() -> float:
    """The longest a worker may run for its reads to stay unable to move an atime (a day, less the slack)."""
    return (DAY_NS - SLACK_NS) / 1e9
