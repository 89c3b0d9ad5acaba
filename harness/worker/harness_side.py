"""The harness's end of a worker: a separate, sandboxed process that runs participant code
(train.py's load_for_eval and the model's forward, or inference.py's scorer), so that nothing a
participant writes ever runs in the process that computes the metric. The worker's own end is
worker_side.py; the messages are wire.py; the sandbox is sandbox.py.

    harness (this module)                            worker (python -m harness.worker.worker_side FD)
    Worker("model", submission, device)   ----->    sandbox, load_for_eval(ckpt copy, device)
    ModelForward.submit(rows) / .result() ----->    model(rows) -> logits into a sealed memfd
    Worker("scorer", submission, device)  ----->    sandbox, load_scorer(ckpt copy, device)
    score_sequences(worker, sequences)    ----->    scorer.score(sequences) -> losses, greedy

Containment, and where each part lives:
- The worker starts clean: a fresh interpreter in its own private folder (its HOME, TMPDIR and
  compiler caches point there; the harness deletes it), an environment without the data
  locations or torchrun's variables, stdin /dev/null, stdout and stderr pipes the harness reads
  (each line marked `[label]`, length and total capped), no other descriptor of the harness.
- It loads the harness's private copy of the participant's files (harness/submission.py).
- Before any participant code is imported it applies the sandbox the harness names; the
  harness first checks that no file it scores lies where the sandbox lets the worker read.
- Every request has a deadline; every reply is size-bounded and checked (wire.py), and the
  values it carries are names from fixed lists (_checked_info), never text the harness prints.
- Logits come back through memfds the harness created, sized and sealed (no shrinking, no
  growing), so the worker cannot make the harness's mapping fault.
- The harness is a child subreaper: whatever the worker starts, however detached, is re-parented
  to the harness when its parent dies, and close() kills and reaps all of it before returning,
  then removes the worker's folder whatever it holds (limits.remove_tree).
- What the worker may consume (memory, its folder's size and entries, processes and threads) is
  capped (limits.py): past a cap a watchdog kills it, and the worker's one error says which cap."""
from __future__ import annotations

import collections
import fcntl
import mmap
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from harness.common import EvalRefused
from harness.config import REPO_DIR, keep_kernel_caches
from harness.submission import Submission
from harness.worker import access_times, kernel_caps, limits, sandbox, wire
from harness.worker.wire import WorkerError

STDERR_TAIL_LINES = 40  # worker output kept for error messages
MAX_LINE_CHARS = 4000  # a longer output line is cut into pieces of this size
MAX_FORWARDED_BYTES = 8 << 20  # worker output forwarded to stderr; the rest is read and dropped
MAX_MESSAGE_CHARS = 4000  # of an error text the worker reports
EXIT_GRACE_SECONDS = 2.0  # after "exit", how long the worker may take before it is killed
REAP_SECONDS = 10.0  # how long close() keeps killing what the worker left behind, once nothing more dies
MAX_SEQ_LEN = 1 << 24  # a scorer's max_seq_len above this is not a length
DEVICE_NAME = re.compile(r"(cpu|cuda|neuron|mps|xla)(:[0-9]{1,4})?")
SANDBOX_PART = re.compile(r"noatime|capabilities|seccomp|landlock-[0-9]{1,2}|thread-names")
# How a worker is kept from moving access times (a channel to the next worker, access_times.py):
# a mount namespace where every mount is noatime (where the worker has CAP_SYS_ADMIN), else the
# harness reads ahead whatever a read would move. Tests empty it for a control run.
ATIME_DEFENCES = ("noatime", "read ahead")
# What a worker's reads and lookups leave in the kernel's caches (which pages of a readable file are
# cached, which names were looked up, the missing ones included) outlives it and can be timed by the
# next worker (docs/trust-model.md): before a second worker starts, the harness drops them all.
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
# The worker's environment: only these variables of the harness's (an allowlist: no credentials, no
# data locations), less the hidden ones: data and output locations, and torchrun's (the worker is one
# single-device process; it must not join the harness's process group). SUBMISSION_* variables are
# the way to hand a model settings at evaluation time.
WORKER_ENV_NAMES = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX",
                    "CONDA_DEFAULT_ENV"}
WORKER_ENV_PREFIXES = ("LC_", "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "CUDA_", "NVIDIA_", "NEURON_",
                       "XLA_", "TORCH", "TRITON_", "NKI_", "SUBMISSION_")
HIDDEN_ENV_PREFIXES = ("FRONTIER_", "NEURON_COMPETITION_R1_", "TORCHELASTIC_")
HIDDEN_ENV_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}
WORKER_MODULE = "harness.worker.worker_side"  # what the worker runs: `python -m WORKER_MODULE FD`
# Caches a compiler may write: all of them go to the worker's private folder, so nothing one
# worker writes is read by another (a shared cache would be a channel between them).
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "XDG_CACHE_HOME": "xdg",
                   "CUDA_CACHE_PATH": "cuda", "NEURON_COMPILE_CACHE_URL": "neuron", "NKI_COMPILE_CACHE_URL": "nki",
                   "TORCH_NEURONX_NEFF_CACHE_DIR": "neff"}


_ESCAPED = {c: f"\\x{c:02x}" for c in [*range(32), 127, *range(0x80, 0xA0)] if c != 10}
_ESCAPED.update({c: f"\\u{c:04x}" for c in (0x2028, 0x2029, 0x200E, 0x200F, *range(0x202A, 0x202F),
                                               *range(0x2066, 0x206A))})  # line separators, text direction


def quoted(text, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A worker-supplied text made safe to print on stderr: cut to limit, control characters
    escaped, every line after the first indented (it can never pass for a result line)."""
    return str(text)[:limit].translate(_ESCAPED).replace("\n", "\n    | ")


def worker_environment(private_dir: Path, kit_dir: Path, tokenizer_copy: Path | None = None,
                       tokenizer_sha256: str | None = None) -> dict:
    """The worker's environment: the allowed variables of the harness's (WORKER_ENV_*), the copy of
    the kit's code on PYTHONPATH (train.py files import `prepare`), one BLAS thread for numpy, HOME, TMPDIR and every compiler
    cache in its private folder, and, when given, a private copy of the pinned tokenizer (so
    ensure_tokenizer() works there without naming any data folder)."""
    env = {k: v for k, v in os.environ.items()
           if (k in WORKER_ENV_NAMES or k.startswith(WORKER_ENV_PREFIXES))
           and not k.startswith(HIDDEN_ENV_PREFIXES) and k not in HIDDEN_ENV_NAMES}
    if tokenizer_copy is not None:
        env["FRONTIER_TOKENIZER_PATH"], env["FRONTIER_TOKENIZER_SHA256"] = str(tokenizer_copy), tokenizer_sha256
    env["PYTHONPATH"] = os.pathsep.join([str(kit_dir)] + ([os.environ["PYTHONPATH"]]
                                                         if os.environ.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS starts its pool at import, before the sandbox (worker_side)
    env["HOME"] = str(private_dir)
    env["TMPDIR"] = str(private_dir / "tmp")
    for name, folder in CACHE_VARIABLES.items():
        env[name] = str(private_dir / "cache" / folder)
    return env


def copy_code(submission: Submission, dest: Path) -> Path:
    """The submission's code (train.py, inference.py, kernels/), copied from the harness's copy into
    the worker's own folder: no two workers read the same source files, so their access times and
    cached pages carry nothing from one to the next. (The checkpoint is read from the shared copy.)"""
    dest.mkdir()
    for name in ("train.py", "inference.py", "kernels"):
        source = submission.dir / name
        if source.is_file():
            shutil.copyfile(source, dest / name)
        for root, _, files in os.walk(source) if source.is_dir() else ():
            target = dest / Path(root).relative_to(submission.dir)
            target.mkdir(exist_ok=True)  # plain modes: the copy must be removable by the harness
            for f in files:
                shutil.copyfile(Path(root) / f, target / f)
    return dest


def copy_kit(dest: Path) -> None:
    """The kit's harness code, copied for a worker (so no rule of its sandbox names the kit's folder,
    which may hold anything)."""
    dest.mkdir()
    shutil.copyfile(REPO_DIR / "prepare.py", dest / "prepare.py")
    shutil.copytree(REPO_DIR / "harness", dest / "harness", ignore=shutil.ignore_patterns("__pycache__"))


# ---------------------------------------------------------------------------------------------
# Processes: the worker's tree, found through /proc and killed whole
# ---------------------------------------------------------------------------------------------

def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    return {pid: ppid for pid, (ppid, _, _) in limits.process_table().items()}


def _descendants(root: int, parents: dict[int, int]) -> set[int]:
    children = collections.defaultdict(list)
    for pid, ppid in parents.items():
        children[ppid].append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(pid: int) -> bool:
    """True once pid (a child of this process) has exited and is reaped."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def drop_kernel_caches() -> tuple[float | None, list[str]]:
    """Drop the page cache, the dentries (negative ones included) and the inodes, machine-wide,
    once a worker and all it started are dead and before the next worker starts: then nothing the
    first read or looked up is faster for the second. Root only (and the whole machine's caches go:
    score on a machine of its own). Returns (the seconds it took or None, why the run is not official)."""
    if keep_kernel_caches():
        return None, ["the kernel's caches were kept between the workers (FRONTIER_KEEP_KERNEL_CACHES): the "
                      "second worker could time which files and names the first read"]
    t0 = time.monotonic()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")  # 1: clean page cache, 2: dentries and inodes
    except OSError as e:
        return None, [f"the kernel's caches could not be dropped between the workers ({DROP_CACHES}: "
                      f"{e.strerror}; that needs root and a writable /proc/sys): the second worker could time "
                      "which files and names the first read"]
    return time.monotonic() - t0, []


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------

def sandbox_plan(enabled: bool) -> tuple[int, str | None, str]:
    """(Landlock ABI to apply, seccomp arch or None, why the result is not official: '' if it is)."""
    if not enabled:
        return 0, None, "the worker's sandbox is off (--no-sandbox)"
    abi, arch = sandbox.landlock_abi(), sandbox.seccomp_arch()
    return abi, arch, sandbox.sandbox_shortfall(abi)


def _checked_info(mode: str, header: dict) -> dict:
    """What the worker reported after loading, as names from fixed lists (WorkerError otherwise)."""
    device = header.get("device")
    if not isinstance(device, str) or not DEVICE_NAME.fullmatch(device):
        raise WorkerError(f"the worker reported a device that is not a device name ({quoted(repr(device), 60)})")
    if mode == "model":
        return {"device": device}
    max_len = header.get("max_seq_len")
    if max_len is not None and not (type(max_len) is int and 2 <= max_len <= MAX_SEQ_LEN):
        raise WorkerError(f"the scorer's max_seq_len must be an int from 2 to {MAX_SEQ_LEN} or None")
    return {"max_seq_len": max_len, "device": device}


class Worker:
    """One worker process. mode "model": the submission's train.py with load_for_eval; mode
    "scorer": its inference.py with load_scorer. `info` holds what the worker reported after
    loading (checked: a model's compute dtype, a scorer's max_seq_len, the device). `protected`
    are the files the harness scores: if the sandbox would let the worker read one, the run is
    not official (`not_official_because`). Everything must finish before `deadline`
    (time.monotonic()); past it, WorkerTimeout. What it consumes is capped (`limits`, from
    limits.worker_limits()); `watchdog.peak` holds the most of each it used."""

    def __init__(self, mode: str, submission: Submission, device, *, deadline: float, label: str = "worker",
                 local_rank: int = 0, tokenizer=None, protected=(), use_sandbox: bool = True):
        if mode not in ("model", "scorer"):
            raise ValueError(f"unknown worker mode {mode!r}")
        self.mode, self.label, self.deadline = mode, label, deadline
        self.not_official_because: list[str] = []
        self.sandbox_applied: list[str] = []
        self._cap_reported = False
        self.start_seconds = self.sandbox_seconds = 0.0  # interpreter start and imports; the sandbox alone
        self.settled: access_times.Settled | None = None  # what the harness read ahead, without noatime
        self.limits = limits.worker_limits()
        self.watchdog = self.caps = None
        t_start = time.monotonic()
        kernel_caps.remove_stale()
        self.private_dir = Path(tempfile.mkdtemp(prefix=f"{kernel_caps.PREFIX}{os.getpid()}-"))
        try:
            self.caps = kernel_caps.create(self.private_dir, self.limits.memory, self.limits.disk, self.limits.files,
                                           self.limits.tasks, self.private_dir.name)
        except OSError as e:
            self.not_official_because.append(
                f"the worker's caps could not be left to the kernel ({e.strerror or 'refused'}: "
                f"{quoted(e.filename or '', 200)}; that needs root, a writable cgroup hierarchy with the memory and "
                "pids controllers and a tmpfs mount): a watchdog measured them from user space, which a worker can "
                "outrun")
        try:  # until the worker runs, close() cannot clean up: a failure here removes what was made
            (self.private_dir / "tmp").mkdir()
            tokenizer_copy = None
            if tokenizer is not None:
                tokenizer_copy = self.private_dir / "tokenizer.json"
                shutil.copyfile(tokenizer.path, tokenizer_copy)
            copy_kit(self.private_dir / "kit")
            code = copy_code(submission, self.private_dir / "code")
            participant_file = code / ("train.py" if mode == "model" else "inference.py")
            self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
            self._forwarded = 0
            self._output_lock = threading.Lock()
            sandbox.become_subreaper()
            self._children_before = {pid for pid, ppid in _parents().items() if ppid == os.getpid()}
            parent_sock, child_sock = socket.socketpair()
            self.sock = parent_sock
            env = worker_environment(self.private_dir, self.private_dir / "kit", tokenizer_copy,
                                     getattr(tokenizer, "sha256", None))
            join_fds = self.caps.join_fds() if self.caps else []
            try:
                self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(child_sock.fileno())],
                                             cwd=self.private_dir, env=env, pass_fds=(child_sock.fileno(),),
                                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             start_new_session=True,
                                             preexec_fn=(lambda: kernel_caps.join(join_fds)) if join_fds else None)
            finally:
                for fd in join_fds:
                    os.close(fd)
        except BaseException:
            self._remove_folder()
            raise
        child_sock.close()
        self.watchdog = limits.Watchdog(self.proc.pid, self.private_dir, self.limits, self._kill_group, self.caps)
        self.watchdog.start()
        self._pumps = [threading.Thread(target=self._pump, args=(stream,), daemon=True)
                       for stream in (self.proc.stdout, self.proc.stderr)]
        for t in self._pumps:
            t.start()
        try:
            with open(f"/proc/{self.proc.pid}/oom_score_adj", "w") as f:
                f.write("1000")  # out of memory, the kernel kills the worker first
        except OSError:
            pass
        try:
            sys_path = self.request({"cmd": "hello"})[0].get("sys_path")
            self.start_seconds = time.monotonic() - t_start
            self._start_sandbox(sys_path, submission, protected, use_sandbox, device, local_rank)
            self.info = _checked_info(mode, self.request(
                {"cmd": "load", "mode": mode, "file": str(participant_file), "checkpoint": str(submission.checkpoint),
                 "device": str(device), "local_rank": local_rank})[0])
        except BaseException:
            self.close()
            raise

    def _start_sandbox(self, sys_path, submission: Submission, protected, use_sandbox: bool, device,
                       local_rank: int) -> None:
        t0 = time.monotonic()
        if not isinstance(sys_path, list) or not all(isinstance(p, str) for p in sys_path):
            raise WorkerError("the worker's hello did not list its sys.path")
        abi, arch, shortfall = sandbox_plan(use_sandbox)
        private = os.path.realpath(self.private_dir)
        rules = sandbox.worker_rules(self.private_dir, submission.dir)
        rules += [(p, "execute") for p in sys_path
                  if os.path.isabs(p) and not os.path.realpath(p).startswith(private) and os.path.isdir(p)]
        reply = self.request({"cmd": "sandbox", "off": not use_sandbox, "abi": abi, "seccomp": arch,
                              "noatime": "noatime" in ATIME_DEFENCES, "device": str(device), "local_rank": local_rank,
                              "rules": [list(r) for r in rules], "rlimits": limits.worker_rlimits(self.limits)})[0]
        applied = reply.get("applied")
        if not isinstance(applied, list) or not all(isinstance(a, str) and SANDBOX_PART.fullmatch(a) for a in applied):
            raise WorkerError("the worker's sandbox reply is malformed")
        self.sandbox_applied = applied
        if shortfall:
            self.not_official_because.append(shortfall)
        if use_sandbox and "noatime" not in applied:
            self.not_official_because += self._read_ahead(rules)
        exposed = sandbox.exposed_paths(protected, rules) if use_sandbox and abi else []
        if exposed:
            self.not_official_because.append(f"the worker can read {', '.join(exposed[:3])} (scored data, or what it "
                                              "was built from, under a folder the interpreter or the system needs)")
        self.sandbox_seconds = time.monotonic() - t0

    def _read_ahead(self, rules: list) -> list[str]:
        """Without a noatime mount namespace: read whatever the worker may read whose access time
        a read would still move before the deadline (access_times.settle), before any participant
        code runs. Returns why the run is still not official (what reading ahead cannot cover)."""
        if "read ahead" not in ATIME_DEFENCES:
            return ["access times: a worker's reads can move them (no noatime namespace, no reading ahead)"]
        roots = access_times.readable_roots(rules)
        seconds_left = self.deadline - time.monotonic()
        reasons = ["no mount namespace for the worker (the harness lacks CAP_SYS_ADMIN): following a symbolic "
                   "link outside the folders it may read still moves the link's access time"]
        if seconds_left > access_times.longest_settled_run_seconds():
            reasons.append("the deadline is more than a day away: relatime would move access times read a day "
                           "earlier")
        strict = access_times.strict_mounts(roots, access_times.mount_table())
        if strict:
            reasons.append(f"{', '.join(strict[:3])} is mounted strictatime: every read moves an access time")
        self.settled = access_times.settle(roots, seconds_left)
        return reasons

    def _pump(self, stream) -> None:
        """Forward the worker's output to our stderr, marked, in lines of at most MAX_LINE_CHARS,
        up to MAX_FORWARDED_BYTES; keep its tail for error messages."""
        while True:
            raw = stream.readline(MAX_LINE_CHARS)
            if not raw:
                return
            line = quoted(raw.decode("utf-8", errors="replace").rstrip("\n"), MAX_LINE_CHARS)
            with self._output_lock:
                self.stderr_tail.append(line)
                self._forwarded += len(raw)
                if self._forwarded <= MAX_FORWARDED_BYTES:
                    print(f"[{self.label}] {line}", file=sys.stderr, flush=True)
                elif self._forwarded - len(raw) <= MAX_FORWARDED_BYTES:
                    print(f"[{self.label}] ... more than {MAX_FORWARDED_BYTES >> 20} MiB of output; the rest is not "
                          "shown", file=sys.stderr, flush=True)

    def _exit_code(self, timeout: float) -> int | None:
        """The worker's exit code once it has exited (waiting up to timeout), None while it runs.
        It is not reaped here: until close() has killed its process group, its pid (the group's id)
        must stay reserved."""
        end = time.monotonic() + timeout
        while True:
            try:
                info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return self.proc.returncode
            if info is not None:
                return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            if time.monotonic() >= end:
                return None
            time.sleep(0.01)

    def _failure(self, what: str) -> WorkerError:
        code = self._exit_code(2.0)
        if self.watchdog.reason:
            return self._over_cap()
        for t in self._pumps:
            t.join(timeout=1)
        tail = "\n    ".join(list(self.stderr_tail)[-12:]) or "(no output)"
        state = f"exited with code {code}" if code is not None else "stopped answering"
        return WorkerError(f"the {self.mode} worker {state} while {what}. Its last output:\n    {tail}")

    def _over_cap(self) -> WorkerError:
        self._cap_reported = True
        return WorkerError(f"the {self.mode} worker was stopped: it {self.watchdog.reason}; no score")

    def share_buffers(self, size: int, fds) -> None:
        """Buffers of the harness's (memfds of size bytes in all) that the worker will write: not the
        worker's memory to pay for. The kernel charges the pages to whoever first writes them, so its
        cgroup's limit grows by their size."""
        self.watchdog.shared_bytes = size
        self.watchdog.shared_files = {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in fds}
        if self.caps is not None:
            self.caps.set_memory(self.limits.memory + size)

    def send(self, header: dict, payload=b"", fds=()) -> None:
        try:
            wire.send(self.sock, header, payload, fds)
        except OSError:
            raise self._failure(f"receiving the request {header.get('cmd')!r}") from None

    def receive(self, what: str, max_payload: int = 0) -> tuple[dict, bytes]:
        """The next reply; EvalRefused when the worker reports a contract failure, WorkerError on a
        crash or a malformed reply, WorkerTimeout past the deadline."""
        try:
            header, payload = wire.recv(self.sock, self.deadline, max_payload)
        except ConnectionError:
            raise self._failure(what) from None
        if ("refused" in header or "error" in header) and self.watchdog.look_now():
            raise self._over_cap()  # the error (a write that failed, a thread not started) is the cap's
        if "refused" in header:
            raise EvalRefused(quoted(header["refused"]))
        if "error" in header:
            raise WorkerError(quoted(header["error"]))
        return header, payload

    def request(self, header: dict, payload=b"", max_payload: int = 0, fds=()) -> tuple[dict, bytes]:
        self.send(header, payload, fds)
        return self.receive(f"answering {header.get('cmd')!r}", max_payload)

    def close(self) -> None:
        """Stop the worker and everything it started (killed and reaped), and remove its folder.
        WorkerError if the folder cannot be removed, or if the worker went past a cap that no
        error has reported yet (after its last answer, say)."""
        try:
            if self.watchdog is not None:
                self.watchdog.stop()
            if self._exit_code(0) is None:
                try:
                    wire.send(self.sock, {"cmd": "exit"})
                    self._exit_code(EXIT_GRACE_SECONDS)
                except OSError:
                    pass
        finally:
            self._kill_everything()
            self.sock.close()
            for t in self._pumps:
                t.join(timeout=2)
            self._remove_folder()
        if self.watchdog is not None:
            print(f"[{self.label}] used at most: {limits.describe(self.watchdog.peak, self.limits)}", file=sys.stderr)
        if self.watchdog is not None and self.watchdog.reason and not self._cap_reported:
            raise self._over_cap()

    def _remove_folder(self) -> None:
        try:
            if self.caps is not None:
                self.caps.remove()  # what is left in its cgroup killed, the tmpfs unmounted
            limits.remove_tree(self.private_dir)
        except OSError as e:
            raise WorkerError(f"could not remove the worker's folder {self.private_dir}: {e.strerror} "
                              f"({quoted(e.filename or '', 200)})") from None

    def _kill_group(self) -> None:
        """SIGKILL the worker's process group (and its cgroup, where it has one). Its leader is
        reaped only in close(), so until then the group's id cannot name another process's group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.caps is not None:
            self.caps.kill()

    def _kill_everything(self) -> None:
        """SIGKILL the worker's process group, which holds everything it started: the sandbox refuses
        setsid() and setpgid(), so nothing can leave it, and the kernel delivers a group kill to a
        process that is forking and to the child it makes. The worker is reaped only afterwards, so
        the group's id cannot have been reused. Then, for a worker without the sandbox, whatever was
        re-parented to this process (a child subreaper) is killed too, until none is left."""
        for _ in range(2):  # the second catches a member that was in fork() during the first
            self._kill_group()
            self._exit_code(1.0)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # an unkillable (uninterruptible) worker: say so, do not hang
            print(f"[{self.label}] warning: the worker did not die within 10 s of SIGKILL", file=sys.stderr)
        me, give_up, clean, left = os.getpid(), time.monotonic() + REAP_SECONDS, 0, None
        last_chance = time.monotonic() + 3 * REAP_SECONDS  # however slowly they die, close() ends
        while clean < 3:
            parents = _parents()
            orphans = {pid for pid, ppid in parents.items() if ppid == me} - self._children_before
            orphans = {pid for pid in orphans if not _reap(pid)}
            if orphans:
                clean = 0
                _kill(orphans | set().union(*(_descendants(p, parents) for p in orphans)))
            else:
                clean += 1
            if left is None or len(orphans) < left:  # killed processes still dying: wait while they do
                left, give_up = len(orphans), time.monotonic() + REAP_SECONDS
            if time.monotonic() > min(give_up, last_chance):
                print(f"[{self.label}] warning: processes the worker started were still alive after "
                      f"{REAP_SECONDS:.0f}s", file=sys.stderr)
                return
            time.sleep(0.01)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# The model's forward, through a worker
# ---------------------------------------------------------------------------------------------

def sealed_buffer(size: int) -> tuple[int, mmap.mmap]:
    """A shared-memory file of exactly size bytes that nobody can shrink or grow (a memfd with
    F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), and the harness's mapping of it."""
    fd = os.memfd_create("frontier-logits", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


class ModelForward:
    """model(rows) through a model worker, pipelined: up to two requests in flight. Rows go in the
    request; logits come back in a sealed shared buffer per slot (float32 [B, L, vocab]); a request
    may use fewer rows and a shorter length. result() returns a private copy of the logits: the
    worker cannot change them after they were read."""

    SLOTS = 2

    def __init__(self, worker: Worker, batch_size: int, max_len: int, vocab_size: int):
        self.worker, self.batch_size, self.max_len, self.vocab = worker, batch_size, max_len, vocab_size
        shape = (batch_size, max_len, vocab_size)
        size = batch_size * max_len * vocab_size * 4
        fds, self.maps, self.outputs = [], [], []
        try:
            for _ in range(self.SLOTS):
                fd, mapped = sealed_buffer(size)
                fds.append(fd)
                self.maps.append(mapped)
                self.outputs.append(np.ndarray(shape, dtype=np.float32, buffer=mapped))
            worker.share_buffers(self.SLOTS * size, fds)
            worker.request({"cmd": "buffers", "shape": list(shape)}, fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        self.pending: collections.deque[tuple[int, int, int]] = collections.deque()  # (slot, rows, length)
        self.next_slot = 0

    def submit(self, rows: np.ndarray) -> None:
        """Queue model(rows) for rows int [n, L], n <= batch_size, L <= max_len. At most SLOTS in flight."""
        n, length = rows.shape
        if len(self.pending) >= self.SLOTS:
            raise RuntimeError("too many forwards in flight: call result() first")
        if not (1 <= n <= self.batch_size and 1 <= length <= self.max_len):
            raise ValueError(f"rows of shape {rows.shape} do not fit the buffers [{self.batch_size}, {self.max_len}]")
        slot = self.next_slot
        self.next_slot = (slot + 1) % self.SLOTS
        self.worker.send({"cmd": "forward", "slot": slot, "rows": n, "length": length},
                         np.ascontiguousarray(rows, dtype=np.int32).tobytes())
        self.pending.append((slot, n, length))

    def result(self) -> np.ndarray:
        """The logits of the oldest submitted forward: a private float32 copy [n, L, vocab]."""
        slot, n, length = self.pending.popleft()
        self.worker.receive("running the model's forward")
        return np.array(self.outputs[slot][:n, :length], dtype=np.float32, copy=True)

    def close(self) -> None:
        self.outputs.clear()
        for mapped in self.maps:
            mapped.close()
        self.maps.clear()


def score_sequences(worker: Worker, sequences: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """inference.py's score(sequences) through a scorer worker: for each sequence of n tokens,
    (losses float32 [n-1], greedy int64 [n-1]), checked for count, shape and finiteness."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    if (lengths < 2).any():
        raise ValueError("every sequence needs at least 2 tokens")
    flat = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences])
    expected = int((lengths - 1).sum())
    header, payload = worker.request({"cmd": "score", "lengths": lengths.tolist()}, flat.tobytes(),
                                     max_payload=8 * expected)
    if len(payload) != 8 * expected:
        raise WorkerError(f"score() results hold {len(payload)} bytes for {len(sequences)} sequences; expected "
                          f"{8 * expected} (one loss and one prediction per position)")
    losses = np.frombuffer(payload[:4 * expected], dtype=np.float32).copy()
    greedy = np.frombuffer(payload[4 * expected:], dtype=np.int32).astype(np.int64)
    if not np.isfinite(losses).all():
        raise EvalRefused("inference.py's score() returned non-finite losses")
    cuts = np.cumsum(lengths - 1)[:-1]
    return list(zip(np.split(losses, cuts), np.split(greedy, cuts)))
