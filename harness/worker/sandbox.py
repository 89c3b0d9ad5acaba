"""The worker's sandbox: what participant code may touch once the worker has applied it.

Applied inside the worker process (worker_side.enter_sandbox) before any participant code is
imported, while the worker is one thread (each part binds the thread that applies it and what it
starts later, not threads that already run; the seccomp filter goes on every thread at once), and
kept by everything the worker starts (no_new_privs; a Landlock domain and a seccomp filter are
inherited across clone, fork and exec and cannot be lifted); the worker then asks the kernel
whether every thread has no_new_privs, the filter and no capability (unconfined_threads):

- **A mount namespace where nothing moves an access time** (where the worker has CAP_SYS_ADMIN,
  before it drops it): every mount remounted noatime, so what the worker reads, lists or follows
  leaves no mark another worker could stat (without it, the harness reads ahead instead:
  access_times.py).
- **Linux Landlock** (an unprivileged LSM; its ABI version decides what it can restrict):
  the file system is readable only under the roots the harness names (the interpreter and its
  packages, the system's libraries, compiler and headers and the accelerators' runtimes, the
  devices of /sys, /proc, a few files of /etc, the private copy of the participant's files) and
  writable only in the worker's private folder (which holds its copy of the kit's harness code);
  device nodes of the accelerators are opened read-write; a CUDA worker may also write the files
  of its own threads (/proc/<pid>/task: the driver names its threads). TCP bind and connect are
  refused (ABI 4), and so are signals to, and abstract unix sockets of, processes outside the
  sandbox (ABI 6). Landlock also stops ptrace of any process outside the domain, which
  closes /proc/<pid>/mem, /fd and /environ of the harness.
- **A seccomp filter** for what Landlock does not cover: any new socket (the worker has the
  socket pair the harness gave it); io_uring (its operations do not pass through this filter);
  what could carry information from one worker to the next (System V IPC and POSIX message
  queues outlive their process; kernel keyrings; extended attributes, inode flags and metadata
  changes of files the worker can read); leaving the worker's process group (setsid, setpgid),
  so that one kill of the group reaches everything it started; new namespaces; perf events and
  BPF. Metadata calls report success and change nothing; xattr writes report "not supported";
  the rest fail with EPERM (socket() with EACCES).
- **No capabilities.** A worker started as root drops every capability (and the bounding set),
  so it cannot mount, set the hostname, trace, or override file permissions.

The harness decides the rules (`worker_rules`) and checks, before starting a worker, that no
file it scores lies under a readable root (`exposed_paths`). `landlock_abi()` tells whether this
kernel has Landlock; without it (or below LANDLOCK_MIN_ABI) a worker still runs, with whatever
the kernel offers, and the result says it is not official and why.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import site
import struct
import sys
from pathlib import Path
from typing import NamedTuple

# ---------------------------------------------------------------------------------------------
# Landlock (include/uapi/linux/landlock.h)
# ---------------------------------------------------------------------------------------------
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every arch
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_MIN_ABI = 6  # the first with TCP rules (4) and signal / abstract-socket scoping (6)

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # rights a rule on a file may hold

READ = FS_READ_FILE | FS_READ_DIR
READ_EXECUTE = READ | FS_EXECUTE
DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV | FS_TRUNCATE
WRITE_ALL = (1 << 16) - 1  # everything, inside the private folder

# Read (and execute) roots besides the interpreter's own: what the dynamic loader, the C compiler
# that torch.compile calls (its programs, headers, libraries and plugins) and the accelerators'
# runtimes need, under /usr and, where it is not a link to /usr's, under / (system_roots); /opt
# and /usr/local (CUDA, Neuron); time zones and certificates; of /sys, the devices and their
# indexes (CPU topology, PCI, accelerator classes, driver modules), not /sys/kernel or /sys/fs;
# /proc (ptrace checks guard other processes' sensitive files). Every file readable is a file whose
# access time or cached pages a worker could use to signal the next one, so the list is short.
SYSTEM_FOLDERS = ("bin", "sbin", "include", "lib64", "libexec", "lib/{arch}-linux-gnu", "lib/gcc", "lib/locale",
                  "lib/bfd-plugins", "lib/cpp")
SYSTEM_ROOTS = ("/opt", "/usr/local", "/usr/share/zoneinfo", "/usr/share/ca-certificates", "/sys/devices",
                "/sys/bus", "/sys/class", "/sys/dev", "/sys/module", "/proc")
# Of /etc, only what the dynamic loader, the C library and Python read (no /etc/shadow, no secrets).
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone",
             "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/host.conf", "/etc/hosts", "/etc/gai.conf",
             "/etc/os-release", "/etc/mime.types", "/etc/alternatives", "/etc/ssl/certs", "/etc/ca-certificates",
             "/etc/ld.so.preload")
DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri/*", "/dev/neuron*")  # accelerators
PLAIN_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int


class SandboxError(RuntimeError):
    pass


def _syscall(number: int, *args) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return result


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or it is disabled)."""
    if sys.platform != "linux":
        return 0
    try:
        return _syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                        ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    except OSError:
        return 0


def sandbox_shortfall(abi: int | None = None) -> str:
    """Why a sandboxed worker would not meet the official bar on this machine ('' if it would)."""
    abi = landlock_abi() if abi is None else abi
    if abi == 0:
        return "this kernel has no Landlock (Linux 5.13+ with landlock in the lsm= list), so the worker is not sandboxed"
    if abi < LANDLOCK_MIN_ABI:
        return (f"this kernel's Landlock ABI is {abi}; the worker's sandbox needs {LANDLOCK_MIN_ABI} (Linux 6.12+) "
                "to refuse TCP and to scope signals and abstract unix sockets")
    if seccomp_arch() is None:
        return f"no seccomp filter for this machine ({platform.machine()})"
    return ""


def _access_fs(abi: int) -> int:
    return FS_BY_ABI[max(k for k in FS_BY_ABI if k <= abi)]


def _ruleset(abi: int) -> int:
    fields = [_access_fs(abi)]
    if abi >= 4:
        fields.append(NET_BIND_TCP | NET_CONNECT_TCP)
    if abi >= 6:
        fields.append(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    attr = struct.pack(f"<{len(fields)}Q", *fields)
    return _syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))


def _add_path_rule(ruleset: int, path: str, access: int, abi: int) -> bool:
    """Allow `access` beneath path; False when the path does not exist."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not os.path.isdir(path):
            access &= FILE_ONLY
        access &= _access_fs(abi)
        attr = struct.pack("<Qi", access, fd)  # struct landlock_path_beneath_attr is packed: 12 bytes
        _syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                 ctypes.c_char_p(attr), ctypes.c_uint32(0))
    finally:
        os.close(fd)
    return True


ACCESS = {"read": READ, "execute": READ_EXECUTE, "list": FS_READ_DIR, "device": DEVICE, "write": WRITE_ALL,
          "thread_names": FS_WRITE_FILE | FS_TRUNCATE}
_PINNED: list[int] = []  # descriptors that keep a rule's procfs folder alive (thread_names_rule)


def thread_names_rule() -> tuple[str, str]:
    """The rule a CUDA worker adds for itself: write the files of its own threads, /proc/<pid>/task/*/*
    (the driver names each thread it starts through its comm file). What else a task's files let a
    process without capabilities do touches only itself: raise its own OOM score (the harness set its
    floor), reset its own page-reference bits and scheduler statistics, set its own LSM labels where
    the policy allows, set its audit login uid once where none is set (what the audit log records
    of it), write its own memory (as it can anyway: every thread is inside the sandbox); its
    user-namespace maps need a new namespace, which the seccomp filter refuses. Not /proc/<pid>/ itself (its cgroup files and the rest
    stay read-only), and no other process's tasks. The folder is kept open for the worker's life: a
    procfs folder looked up again would be another inode, without the rule."""
    path = f"/proc/{os.getpid()}/task"
    _PINNED.append(os.open(path, os.O_PATH | os.O_CLOEXEC))
    return path, "thread_names"


def apply_landlock(rules: list, abi: int) -> None:
    """Restrict this process (and all it starts) to rules: [(path, kind)], kind one of ACCESS's
    names. Paths that do not exist are skipped."""
    ruleset = _ruleset(abi)
    try:
        for path, kind in rules:
            _add_path_rule(ruleset, path, ACCESS[kind], abi)
        _syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


# ---------------------------------------------------------------------------------------------
# seccomp (include/uapi/linux/seccomp.h, filter.h, audit.h)
# ---------------------------------------------------------------------------------------------
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG = 4, 36, 1
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06

# Syscall numbers by machine: (audit arch, {name: number}). x86_64 from arch/x86/entry/syscalls/
# syscall_64.tbl; aarch64 from the generic table (include/uapi/asm-generic/unistd.h).
SYSCALLS = {
    "x86_64": (0xC000003E, {
        "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66, "shmdt": 67,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semtimedop": 220,
        "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244,
        "mq_getsetattr": 245, "add_key": 248, "request_key": 249, "keyctl": 250,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "setsid": 112, "setpgid": 109, "unshare": 272, "setns": 308, "perf_event_open": 298, "bpf": 321,
        "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198,
        "fremovexattr": 199, "setxattrat": 463, "removexattrat": 466,
        "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260, "fchmodat": 268,
        "fchmodat2": 452, "utime": 132, "utimes": 235, "futimesat": 261, "utimensat": 280,
        "socket": 41, "ioctl": 16, "bind": 49, "connect": 42, "listen": 50, "clone": 56, "clone3": 435,
        "prlimit64": 302, "fadvise64": 221, "readahead": 187, "mincore": 27, "cachestat": 451, "madvise": 28,
        "preadv2": 327}),
    "aarch64": (0xC00000B7, {
        "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
        "mq_getsetattr": 185, "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190,
        "semctl": 191, "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197,
        "add_key": 217, "request_key": 218, "keyctl": 219,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "setsid": 157, "setpgid": 154, "unshare": 97, "setns": 268, "perf_event_open": 241, "bpf": 280,
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16,
        "setxattrat": 463, "removexattrat": 466,
        "fchmod": 52, "fchmodat": 53, "fchownat": 54, "fchown": 55, "utimensat": 88, "fchmodat2": 452,
        "socket": 198, "ioctl": 29, "bind": 200, "connect": 203, "listen": 201, "clone": 220, "clone3": 435,
        "prlimit64": 261, "fadvise64": 223, "readahead": 213, "mincore": 232, "cachestat": 451, "madvise": 233,
        "preadv2": 286}),
}
# Refused (EPERM): state that outlives a process or is shared between processes (System V IPC, POSIX
# message queues, kernel keyrings); io_uring (its operations bypass this filter: sockets, xattrs);
# leaving the worker's process group or its namespaces (the harness kills the whole group at once);
# perf events and BPF.
DENIED = ("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd",
          "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
          "mq_getsetattr", "add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter",
          "io_uring_register", "setsid", "setpgid", "unshare", "setns", "perf_event_open", "bpf", "bind", "connect",
          "listen", "mincore")
# Which pages of a file are in memory is readable across processes, a channel from one worker to the
# next: the calls that set or read it directly are refused, or report success and do nothing.
NOT_IMPLEMENTED = ("clone3", "cachestat")  # ENOSYS: the C library falls back to clone(), whose flags are checked
NOT_SUPPORTED = ("setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "setxattrat",
                 "removexattrat")
PRETEND_DONE = ("chmod", "fchmod", "chown", "fchown", "lchown", "fchownat", "fchmodat", "fchmodat2", "utime",
                "utimes", "futimesat", "utimensat", "fadvise64", "readahead")
# socket() fails for every family (the worker talks to the harness over the socket pair it was given;
# socketpair() still works); ioctl() that sets inode flags or attributes fails.
DENIED_IOCTLS = (0x40086602, 0x40046602, 0x401C6620, 0x40087602, 0x40047602)  # FS_IOC_SETFLAGS (and 32-bit),
                                                                             # FS_IOC_FSSETXATTR, FS_IOC_SETVERSION (and 32-bit)
CLONE_NEW_FLAGS = 0x7E020080  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
RWF_NOWAIT = 0x8  # preadv2: read only what is cached (a page-cache probe)
PAGE_ADVICE = (3, 20, 21)  # madvise MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT


def seccomp_arch() -> str | None:
    machine = platform.machine().lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(machine)


def _bpf(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


BPF_JSET_K = 0x45


def _arg_checks(number: int, arg: int, tests: list[tuple[str, int, int]]) -> list[bytes]:
    """For syscall `number`: load the low half of argument `arg`, answer as the first matching test
    says (("eq", v, answer): the argument is v; ("set", mask, answer): it has a bit of mask;
    ("nonzero", 0, answer)), and otherwise allow the call."""
    block = [_bpf(BPF_LD_W_ABS, 0, 0, 16 + 8 * arg)]
    for kind, value, answer in tests:
        if kind == "nonzero":
            block += [_bpf(BPF_JEQ_K, 1, 0, 0), _bpf(BPF_RET_K, 0, 0, answer)]
        else:
            block += [_bpf(BPF_JEQ_K if kind == "eq" else BPF_JSET_K, 0, 1, value), _bpf(BPF_RET_K, 0, 0, answer)]
    block.append(_bpf(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    return [_bpf(BPF_JEQ_K, 0, len(block), number)] + block


def seccomp_program(arch: str) -> bytes:
    """A classic-BPF filter: other architectures' calls (x86's 32-bit and x32 ABIs) fail, the
    listed calls get their answer, socket() fails, a few calls fail for some arguments (ioctl
    requests that set inode flags, prlimit64 on another process, clone into new namespaces,
    madvise and preadv2 probes of the page cache), everything else runs."""
    audit_arch, numbers = SYSCALLS[arch]
    eperm, enotsup = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.EOPNOTSUPP
    done = SECCOMP_RET_ERRNO | 0
    answers = [(numbers[n], eperm) for n in DENIED if n in numbers]
    answers += [(numbers[n], SECCOMP_RET_ERRNO | errno.ENOSYS) for n in NOT_IMPLEMENTED if n in numbers]
    answers += [(numbers[n], enotsup) for n in NOT_SUPPORTED if n in numbers]
    answers += [(numbers[n], done) for n in PRETEND_DONE if n in numbers]
    answers += [(numbers["socket"], SECCOMP_RET_ERRNO | errno.EACCES)]
    prog = [_bpf(BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
            _bpf(BPF_JEQ_K, 1, 0, audit_arch),
            _bpf(BPF_RET_K, 0, 0, eperm),
            _bpf(BPF_LD_W_ABS, 0, 0, 0)]  # seccomp_data.nr
    if arch == "x86_64":
        prog += [_bpf(BPF_JGE_K, 0, 1, 0x40000000), _bpf(BPF_RET_K, 0, 0, eperm)]  # the x32 ABI
    for number, answer in answers:
        prog += [_bpf(BPF_JEQ_K, 0, 1, number), _bpf(BPF_RET_K, 0, 0, answer)]
    # each block below leaves the accumulator holding an argument, so it ends in an answer; the
    # jump over a block that does not apply keeps the syscall number for the next one
    prog += _arg_checks(numbers["ioctl"], 1, [("eq", r, eperm) for r in DENIED_IOCTLS])
    prog += _arg_checks(numbers["prlimit64"], 0, [("nonzero", 0, eperm)])
    prog += _arg_checks(numbers["clone"], 0, [("set", CLONE_NEW_FLAGS, eperm)])
    prog += _arg_checks(numbers["madvise"], 2, [("eq", a, done) for a in PAGE_ADVICE])
    prog += _arg_checks(numbers["preadv2"], 5, [("set", RWF_NOWAIT, enotsup)])
    prog += [_bpf(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
    return b"".join(prog)


SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1


def apply_seccomp(arch: str) -> None:
    """The filter on every thread of this process (TSYNC: threads a driver started are filtered too, and
    get no_new_privs from the caller), and on all they start."""
    program = seccomp_program(arch)
    buf = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    try:
        failed = _syscall(SYS_SECCOMP[arch], SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog))
    except OSError as e:
        raise SandboxError(f"seccomp filter refused: {e.strerror}") from None
    if failed:
        raise SandboxError(f"seccomp filter refused: thread {failed} could not take it")


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def unconfined_threads(seccomp: bool) -> list[str]:
    """This process's threads that lack no_new_privs or the seccomp filter (where one was applied), or still
    hold a capability: what the kernel says of each (/proc/self/task/<tid>/status)."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except FileNotFoundError:  # it ended
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if (fields["NoNewPrivs"].strip() != "1" or int(fields["CapEff"], 16) != 0
                or (seccomp and fields["Seccomp"].strip() != "2")):
            found.append(tid)
    return found


# ---------------------------------------------------------------------------------------------
# A mount namespace where no access time moves
# ---------------------------------------------------------------------------------------------
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME = 1, 2, 4, 8, 32, 1024
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
KEPT_MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]


class MountInfo(NamedTuple):
    point: str  # where it is mounted
    device: int
    fstype: str
    options: list[str]  # per-mount options (ro, nosuid, ...)
    root: str  # the folder of its file system mounted there (a cgroup hierarchy's sub-tree, a bind mount)
    super_options: list[str]  # the file system's own (a v1 cgroup hierarchy's controllers)


def read_mountinfo(mountinfo: str = "/proc/self/mountinfo") -> list[MountInfo]:
    """Every mount, parents first, as /proc/self/mountinfo lists them (octal escapes such as
    \\040, a space, decoded)."""
    found = []
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            major, minor = (int(x) for x in fields[2].split(":"))
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            tail = fields[fields.index("-") + 1:]
            found.append(MountInfo(point, os.makedev(major, minor), tail[0], fields[5].split(","), fields[3],
                                   tail[2].split(",") if len(tail) > 2 else []))
    return found


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, int]]:
    """(mount point, the per-mount flags to keep) of every mount, parents first."""
    return [(m.point, sum(KEPT_MOUNT_FLAGS.get(o, 0) for o in m.options)) for m in read_mountinfo(mountinfo)]


def remount_noatime() -> list[str]:
    """Move this process into a mount namespace of its own and remount every mount in it noatime,
    so that nothing it (or anything it starts) reads, lists or follows updates an access time,
    the same files seen by every other process included. Needs CAP_SYS_ADMIN; OSError without it.
    Returns the mount points that could not be remounted (none, or the run is not protected)."""
    if _libc.unshare(ctypes.c_int(CLONE_NEWNS)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(CLONE_NEWNS): {os.strerror(e)}")
    if _libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # nothing propagates back out
        e = ctypes.get_errno()
        raise OSError(e, f"making the mounts private: {os.strerror(e)}")
    failed = []
    for point, kept in mount_points():
        if _libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_NOATIME | kept, None) != 0:
            failed.append(point)
    return failed


# ---------------------------------------------------------------------------------------------
# Capabilities and process attributes
# ---------------------------------------------------------------------------------------------

def _prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def drop_capabilities() -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets (root included)."""
    for cap in range(64):
        try:
            _prctl(PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno == errno.EINVAL:  # past the kernel's last capability
                break
            if e.errno != errno.EPERM:  # EPERM: no CAP_SETPCAP, so there is nothing to drop
                raise
    try:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass
    header = struct.pack("<Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two cap_user_data_t {effective, permitted, inheritable}, all zero
    SYS_CAPSET = {"x86_64": 126, "aarch64": 91}[seccomp_arch() or "x86_64"]
    _syscall(SYS_CAPSET, ctypes.c_char_p(header), ctypes.c_char_p(data))


def set_no_new_privs() -> None:
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def make_undumpable() -> None:
    """This process's /proc files become root's and ptrace-protected (core dumps off)."""
    _prctl(PR_SET_DUMPABLE, 0)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process, so it can find and kill them."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(signal_number: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal_number)


# ---------------------------------------------------------------------------------------------
# The harness's side: the rules, and what they expose
# ---------------------------------------------------------------------------------------------

def interpreter_roots() -> list[str]:
    """The folders the interpreter and its packages live in: its prefixes and site-packages (the
    worker's own sys.path is added by the harness from what the worker reports)."""
    roots = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    roots.update(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        roots.add(site.getusersitepackages())
    return sorted(os.path.realpath(r) for r in roots if os.path.exists(r))


def system_roots() -> list[str]:
    """The system's folders a worker may read and execute (SYSTEM_FOLDERS under /usr, and under /
    where /lib is not a link into /usr; SYSTEM_ROOTS; every folder the dynamic loader is told to
    search in /etc/ld.so.conf.d), those that exist."""
    import glob
    arch = seccomp_arch() or platform.machine()
    prefixes = ["/usr"] + ([""] if os.path.isdir("/lib") and not os.path.islink("/lib") else [])
    roots = [f"{p}/{f.format(arch=arch)}" for p in prefixes for f in SYSTEM_FOLDERS] + list(SYSTEM_ROOTS)
    for conf in sorted(glob.glob("/etc/ld.so.conf.d/*.conf")):
        try:
            with open(conf) as f:
                roots += [line.strip() for line in f if line.strip().startswith("/")]
        except OSError:
            pass
    return [r for r in dict.fromkeys(roots) if os.path.isdir(r)]


def worker_rules(private_dir: Path, submission_dir: Path) -> list:
    """What a worker may touch, as [(path, kind)]: read and execute the interpreter and the system
    roots, read the few files of /etc the C library needs and the submission copy, read-write its
    private folder (which holds its copy of the kit's harness code) and the devices."""
    import glob
    rules = [(r, "execute") for r in interpreter_roots() + system_roots()]
    rules += [(f, "read") for f in ETC_FILES if os.path.exists(f)]
    rules += [(str(submission_dir), "read"), (str(private_dir), "write")]
    devices = [d for pattern in DEVICE_GLOBS for d in sorted(glob.glob(pattern))]
    rules += [(d, "device") for d in devices + [d for d in PLAIN_DEVICES if os.path.exists(d)]]
    return rules


def exposed_paths(paths, rules: list) -> list[str]:
    """The paths (files the harness scores) that a worker under rules could read: beneath a
    readable root, or a file with more than one hard link (another name of it may be)."""
    readable = [os.path.realpath(p) for p, kind in rules if kind != "list"]
    exposed = []
    for path in paths:
        real = os.path.realpath(path)
        if any(real == r or real.startswith(r.rstrip("/") + "/") for r in readable):
            exposed.append(str(path))
        elif os.path.isfile(real) and os.stat(real).st_nlink > 1:
            exposed.append(f"{path} (it has {os.stat(real).st_nlink} hard links)")
    return exposed
