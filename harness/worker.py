"""The worker: a separate process that runs participant code (train.py's load_for_eval and the
model's forward, or inference.py's scorer), so that nothing a participant writes ever runs in the
process that computes the metric.

The harness starts it clean: a fresh interpreter, its own empty working directory, an environment
without the data locations (FRONTIER_*, NEURON_COMPETITION_R1_*, torchrun's variables) and argv
holding only the number of its socket. It receives the files to load and the token rows to run
over a private socket, and writes logits into a memory-mapped file the harness then copies: plain
arrays, never objects. Whatever the worker prints goes to the harness's stderr, each line marked
with `[worker]`; only the harness writes result lines on stdout.

    parent (harness)                              child (python -m harness.worker FD)
    Worker("model", train.py, ckpt, device) --->  load_for_eval(ckpt, device), contract checks
    ModelForward.submit(rows) / .result()  --->   model(rows) -> logits written to the mapped file
    Worker("scorer", inference.py, ckpt, ...) ->  load_scorer(ckpt, device)
    score_sequences(worker, sequences)     --->   scorer.score(sequences) -> losses, greedy

Everything the child sends is untrusted input to the parent: sizes are bounded, shapes checked,
values copied once out of the shared file before anything reads them.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from harness.common import EvalRefused, HarnessError
from harness.config import REPO_DIR

MAX_HEADER_BYTES = 1 << 20  # a reply header larger than this is a broken or hostile worker
LOGIT_DTYPES = ("float32", "bfloat16", "float16")  # what model(inputs) may return
STDERR_TAIL_LINES = 40  # worker output kept for error messages
WORKER_START_TIMEOUT_SECONDS = 3600.0  # loading (and compiling) a model; the caller's deadline may be shorter
# Environment variables the worker never sees: data and output locations, and torchrun's (the worker
# is one single-device process; it must not join the harness's process group).
HIDDEN_ENV_PREFIXES = ("FRONTIER_", "NEURON_COMPETITION_R1_", "TORCHELASTIC_")
HIDDEN_ENV_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}


class WorkerError(HarnessError):
    """The worker failed: it could not load the participant's files, crashed, or broke the protocol."""


class WorkerTimeout(HarnessError):
    pass


# ---------------------------------------------------------------------------------------------
# Messages: a 4-byte length, a JSON header, then `payload` raw bytes
# ---------------------------------------------------------------------------------------------

def _send(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    data = json.dumps({**header, "payload": len(payload)}).encode()
    sock.sendall(struct.pack("<I", len(data)) + data + payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout("the worker did not answer in time")
            sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout:
            raise WorkerTimeout("the worker did not answer in time") from None
        if not chunk:
            raise ConnectionError("the worker closed its connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, deadline: float | None = None, max_payload: int = 1 << 34) -> tuple[dict, bytes]:
    (size,) = struct.unpack("<I", _recv_exact(sock, 4, deadline))
    if size > MAX_HEADER_BYTES:
        raise WorkerError(f"the worker sent a {size}-byte message header (at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(_recv_exact(sock, size, deadline))
        payload_size = int(header["payload"])
    except (ValueError, KeyError, TypeError) as e:
        raise WorkerError(f"the worker sent a malformed message ({type(e).__name__}: {e})") from None
    if not 0 <= payload_size <= max_payload:
        raise WorkerError(f"the worker announced a {payload_size}-byte payload (at most {max_payload})")
    return header, _recv_exact(sock, payload_size, deadline)


# ---------------------------------------------------------------------------------------------
# The parent's side
# ---------------------------------------------------------------------------------------------

def worker_environment(tokenizer_copy: Path | None = None, tokenizer_sha256: str | None = None) -> dict:
    """The worker's environment: the harness's, without data locations and torchrun's variables,
    with the kit on PYTHONPATH (train.py files import `prepare`) and, when given, a private copy of
    the pinned tokenizer (so ensure_tokenizer() works there without naming any data folder)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(HIDDEN_ENV_PREFIXES) and k not in HIDDEN_ENV_NAMES}
    if tokenizer_copy is not None:
        env["FRONTIER_TOKENIZER_PATH"], env["FRONTIER_TOKENIZER_SHA256"] = str(tokenizer_copy), tokenizer_sha256
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR)] + ([os.environ["PYTHONPATH"]]
                                                          if os.environ.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _shared_dir() -> Path:
    """Where the mapped files live: shared memory when the machine has room there."""
    base = Path("/dev/shm")
    return base if base.is_dir() and os.access(base, os.W_OK) else Path(tempfile.gettempdir())


class Worker:
    """One worker process. mode "model": `participant_file` is a train.py with load_for_eval;
    mode "scorer": an inference.py with load_scorer. `info` holds what the worker reported after
    loading (for a model: its compute dtype; for a scorer: max_seq_len). `tokenizer` (the harness's
    verified one) is copied into the worker's folder for ensure_tokenizer() there."""

    def __init__(self, mode: str, participant_file, checkpoint, device, *, label: str = "worker",
                 deadline: float | None = None, local_rank: int = 0, tokenizer=None):
        if mode not in ("model", "scorer"):
            raise ValueError(f"unknown worker mode {mode!r}")
        participant_file, checkpoint = Path(participant_file), Path(checkpoint)
        if not participant_file.is_file():
            raise HarnessError(f"{participant_file}: no such file")
        if not checkpoint.is_file():
            raise HarnessError(f"checkpoint {checkpoint}: no such file")
        self.mode, self.label = mode, label
        self.workdir = Path(tempfile.mkdtemp(prefix="frontier-worker-"))
        tokenizer_copy = None
        if tokenizer is not None:
            tokenizer_copy = self.workdir / "tokenizer.json"
            shutil.copyfile(tokenizer.path, tokenizer_copy)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        parent_sock, child_sock = socket.socketpair()
        self.sock = parent_sock
        env = worker_environment(tokenizer_copy, getattr(tokenizer, "sha256", None))
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.worker", str(child_sock.fileno())],
                                     cwd=self.workdir, env=env, pass_fds=(child_sock.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        child_sock.close()
        self._pumps = [threading.Thread(target=self._pump, args=(stream,), daemon=True)
                       for stream in (self.proc.stdout, self.proc.stderr)]
        for t in self._pumps:
            t.start()
        start_deadline = time.monotonic() + WORKER_START_TIMEOUT_SECONDS
        deadline = min(deadline, start_deadline) if deadline is not None else start_deadline
        try:
            self.info = self.request({"cmd": "load", "mode": mode, "file": str(participant_file.resolve()),
                                      "checkpoint": str(checkpoint.resolve()), "device": str(device),
                                      "local_rank": local_rank}, deadline=deadline)[0]
        except BaseException:
            self.close()
            raise

    def _pump(self, stream) -> None:
        """Forward the worker's output to our stderr, marked, and keep its tail for error messages."""
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.stderr_tail.append(line)
            print(f"[{self.label}] {line}", file=sys.stderr, flush=True)

    def _failure(self, what: str) -> WorkerError:
        code = self.proc.poll()
        if code is None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        for t in self._pumps:
            t.join(timeout=2)
        tail = "\n    ".join(list(self.stderr_tail)[-12:]) or "(no output)"
        state = f"exited with code {code}" if code is not None else "stopped answering"
        return WorkerError(f"the {self.mode} worker {state} while {what}. Its last output:\n    {tail}")

    def send(self, header: dict, payload: bytes = b"") -> None:
        try:
            _send(self.sock, header, payload)
        except OSError:
            raise self._failure(f"receiving the request {header.get('cmd')!r}") from None

    def receive(self, what: str, deadline: float | None = None, max_payload: int = 1 << 34) -> tuple[dict, bytes]:
        """The next reply; EvalRefused when the worker reports a contract failure, WorkerError on a
        crash, WorkerTimeout past the deadline."""
        try:
            header, payload = _recv(self.sock, deadline, max_payload)
        except ConnectionError:
            raise self._failure(what) from None
        if "refused" in header:
            raise EvalRefused(str(header["refused"])[:2000])
        if "error" in header:
            raise WorkerError(str(header["error"])[:4000])
        return header, payload

    def request(self, header: dict, payload: bytes = b"", deadline: float | None = None,
                max_payload: int = 1 << 34) -> tuple[dict, bytes]:
        self.send(header, payload)
        return self.receive(f"answering {header.get('cmd')!r}", deadline, max_payload)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    _send(self.sock, {"cmd": "exit"})
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.sock.close()
            for t in self._pumps:
                t.join(timeout=2)
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ModelForward:
    """model(rows) through a model worker, pipelined: up to two requests in flight, each with its
    own pair of mapped files (inputs int32 [B, L], logits float32 [B, L, vocab]); a request may
    use fewer rows and a shorter length. result() returns a private copy of the logits: the worker
    cannot change them after they were read."""

    SLOTS = 2

    def __init__(self, worker: Worker, batch_size: int, max_len: int, vocab_size: int):
        self.worker, self.batch_size, self.max_len, self.vocab = worker, batch_size, max_len, vocab_size
        self.dir = Path(tempfile.mkdtemp(prefix="frontier-logits-", dir=_shared_dir()))
        self.inputs, self.outputs = [], []
        for slot in range(self.SLOTS):
            self.inputs.append(np.lib.format.open_memmap(self.dir / f"inputs{slot}.npy", mode="w+", dtype=np.int32,
                                                         shape=(batch_size, max_len)))
            self.outputs.append(np.lib.format.open_memmap(self.dir / f"logits{slot}.npy", mode="w+",
                                                          dtype=np.float32, shape=(batch_size, max_len, vocab_size)))
        worker.request({"cmd": "buffers", "dir": str(self.dir), "slots": self.SLOTS, "vocab_size": vocab_size})
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
        self.inputs[slot][:n, :length] = rows
        self.worker.send({"cmd": "forward", "slot": slot, "rows": n, "length": length})
        self.pending.append((slot, n, length))

    def result(self, deadline: float | None = None) -> np.ndarray:
        """The logits of the oldest submitted forward: a private float32 copy [n, L, vocab]."""
        slot, n, length = self.pending.popleft()
        self.worker.receive("running the model's forward", deadline, max_payload=0)
        return np.array(self.outputs[slot][:n, :length], dtype=np.float32, copy=True)

    def close(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def score_sequences(worker: Worker, sequences: list[list[int]], deadline: float | None = None
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """inference.py's score(sequences) through a scorer worker: for each sequence of n tokens,
    (losses float32 [n-1], greedy int64 [n-1]), checked for count, shape and finiteness."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    if (lengths < 2).any():
        raise ValueError("every sequence needs at least 2 tokens")
    flat = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences])
    expected = int((lengths - 1).sum())
    header, payload = worker.request({"cmd": "score", "lengths": lengths.tolist()}, flat.tobytes(), deadline,
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


# ---------------------------------------------------------------------------------------------
# The child's side: everything below runs in the worker process, with participant code
# ---------------------------------------------------------------------------------------------

def import_participant_module(path, module_name: str):
    """Import a participant file by path without running its main(). Its folder goes first on
    sys.path, so `import kernels` and `from train import ...` find the participant's files."""
    path = Path(path)
    if not path.is_file():
        raise HarnessError(f"{path}: no such file")
    parent = str(path.resolve().parent)
    if parent in sys.path:
        sys.path.remove(parent)
    sys.path.insert(0, parent)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise HarnessError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def call_participant_loader(path, module_name: str, hook_name: str, checkpoint, device, why: str):
    """`hook_name(checkpoint, device)` from the participant file at path, with clear errors for a
    missing hook and a checkpoint the hook cannot load."""
    import torch
    module = import_participant_module(path, module_name)
    hook = getattr(module, hook_name, None)
    if not callable(hook):
        raise HarnessError(f"{path} defines no {hook_name}(checkpoint_path, device); {why}")
    try:
        return hook(str(checkpoint), torch.device(device))
    except Exception as e:
        raise HarnessError(f"{hook_name} could not load {checkpoint}: {type(e).__name__}: {e}") from e


def load_participant_model(train_py, checkpoint, device):
    """train_py's load_for_eval(checkpoint, device), checked against the load contract."""
    import torch
    model = call_participant_loader(train_py, "participant_train", "load_for_eval", checkpoint, device,
                                    "the scorer loads the model through it (see the README, 'The metric and the "
                                    "load contract')")
    if not isinstance(model, torch.nn.Module):
        raise HarnessError(f"load_for_eval returned {type(model).__name__}, expected a torch.nn.Module")
    if model.training:
        raise HarnessError("load_for_eval returned a model in training mode; the contract asks for model.eval()")
    hooked = [name or "<root>" for name, m in model.named_modules()
              if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        raise HarnessError(f"load_for_eval returned a model with forward hooks on {hooked[:5]}; the contract "
                           "asks for a pure forward without hooks")
    return model


def logits_array(out, batch: int, seq_len: int, vocab: int) -> np.ndarray:
    """model(inputs)'s output as float32 [batch, seq_len, vocab], or EvalRefused: it must be
    exactly a plain torch.Tensor (no subclass) of a floating dtype and shape [batch, seq_len, V >= vocab]."""
    import torch
    if type(out) is not torch.Tensor:
        raise EvalRefused(f"model(inputs) must return a plain torch.Tensor of logits, got {type(out).__module__}."
                          f"{type(out).__qualname__}")
    if str(out.dtype).replace("torch.", "") not in LOGIT_DTYPES:
        raise EvalRefused(f"model(inputs) returned logits of dtype {out.dtype}; expected one of {LOGIT_DTYPES}")
    if out.dim() != 3 or out.shape[0] != batch or out.shape[1] != seq_len or out.shape[2] < vocab:
        raise EvalRefused(f"model(inputs) returned shape {tuple(out.shape)} for inputs {(batch, seq_len)}; "
                          f"expected logits [{batch}, {seq_len}, V] with V >= {vocab}")
    return out.detach()[..., :vocab].to("cpu", torch.float32).numpy()


def resolve_device(name: str, local_rank: int):
    """The worker's device: "auto" is the fastest present (neuron, cuda, cpu), chosen here, so the
    harness process itself never touches an accelerator; CUDA takes the rank's own GPU."""
    import torch
    from harness.common import detect_device_type
    kind = detect_device_type() if name == "auto" else name
    return torch.device(f"cuda:{local_rank}" if kind == "cuda" else kind)


class _Child:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.model = self.scorer = self.device = None
        self.inputs, self.outputs = [], []

    def load(self, msg: dict) -> dict:
        import torch
        self.device = resolve_device(msg["device"], int(msg["local_rank"]))
        if self.device.type == "neuron" and hasattr(torch, "neuron") and hasattr(torch.neuron, "set_device"):
            torch.neuron.set_device(int(msg["local_rank"]))
        if msg["mode"] == "model":
            self.model = load_participant_model(msg["file"], msg["checkpoint"], self.device)
            dtype = getattr(self.model, "compute_dtype", None)
            return {"compute_dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                    "device": str(self.device)}
        self.scorer = call_participant_loader(msg["file"], "participant_inference", "load_scorer", msg["checkpoint"],
                                              self.device, "the CORE scorer calls it (see the README, 'Phase 2: CORE')")
        if not callable(getattr(self.scorer, "score", None)):
            raise HarnessError(f"load_scorer returned {type(self.scorer).__name__}, which has no score(sequences) method")
        max_len = getattr(self.scorer, "max_seq_len", None)
        if max_len is not None and not (isinstance(max_len, int) and max_len >= 2):
            raise HarnessError(f"scorer.max_seq_len must be an int >= 2 or None, got {max_len!r}")
        return {"max_seq_len": max_len, "device": str(self.device)}

    def buffers(self, msg: dict) -> dict:
        folder, v = Path(msg["dir"]), msg["vocab_size"]
        self.inputs = [np.load(folder / f"inputs{s}.npy", mmap_mode="r") for s in range(msg["slots"])]
        self.outputs = [np.load(folder / f"logits{s}.npy", mmap_mode="r+") for s in range(msg["slots"])]
        self.vocab = v
        return {}

    def forward(self, msg: dict) -> dict:
        import torch
        slot, n, length = msg["slot"], msg["rows"], msg["length"]
        x = torch.from_numpy(np.array(self.inputs[slot][:n, :length], dtype=np.int64)).to(self.device)  # a private copy
        with torch.no_grad():
            out = self.model(x)
        self.outputs[slot][:n, :length] = logits_array(out, n, length, self.vocab)
        return {}

    def score(self, msg: dict, payload: bytes) -> tuple[dict, bytes]:
        import torch
        lengths = msg["lengths"]
        flat = np.frombuffer(payload, dtype=np.int32)
        cuts = np.cumsum(lengths)[:-1]
        sequences = [s.tolist() for s in np.split(flat, cuts)]
        out = self.scorer.score(sequences)
        if len(out) != len(sequences):
            raise HarnessError(f"score() returned {len(out)} results for {len(sequences)} sequences")
        losses, greedy = [], []
        for seq, (loss, pred) in zip(sequences, out):
            loss, pred = torch.as_tensor(loss).detach().cpu(), torch.as_tensor(pred).detach().cpu()
            if loss.shape != (len(seq) - 1,) or pred.shape != (len(seq) - 1,):
                raise HarnessError(f"score() must return {len(seq) - 1} losses and predictions for a sequence of "
                                   f"{len(seq)} tokens, got shapes {tuple(loss.shape)} and {tuple(pred.shape)}")
            losses.append(loss.to(torch.float32).numpy())
            greedy.append(pred.to(torch.int32).numpy())
        return {}, np.concatenate(losses).tobytes() + np.concatenate(greedy).tobytes()

    def serve(self) -> None:
        while True:
            try:
                msg, payload = _recv(self.sock)
            except ConnectionError:
                return
            cmd = msg.get("cmd")
            if cmd == "exit":
                return
            reply, data = {}, b""
            try:
                if cmd == "load":
                    reply = self.load(msg)
                elif cmd == "buffers":
                    reply = self.buffers(msg)
                elif cmd == "forward":
                    reply = self.forward(msg)
                elif cmd == "score":
                    reply, data = self.score(msg, payload)
                else:
                    reply = {"error": f"unknown command {cmd!r}"}
            except EvalRefused as e:
                reply, data = {"refused": str(e)}, b""
            except HarnessError as e:
                reply, data = {"error": str(e)}, b""
            except Exception as e:  # the participant's code failed: report it, with where
                import traceback
                where = traceback.format_exc(limit=-3)
                reply, data = {"error": f"{cmd} failed: {type(e).__name__}: {e}\n{where}"}, b""
            _send(self.sock, reply, data)


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sys.path.insert(0, str(REPO_DIR))  # `import prepare` finds the kit's harness (unless the participant's folder has one)
    _Child(sock).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
