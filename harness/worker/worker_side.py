"""The worker's end: the worker process itself, `python -m harness.worker.worker_side FD`,
started by harness_side.Worker. Everything here runs beside participant code, so the harness
trusts nothing this process does once that code is loaded; no module of the harness imports it.

The order is what makes the sandbox hold. The harness's requests arrive in this order:

    hello     report sys.path (the harness turns it into read rules)
    sandbox   set the rlimits the harness names (limits.py); while the worker is one thread (a
              thread started earlier would stay outside what follows: each part below binds the
              thread that applies it and those it starts), move into a mount namespace where no
              access time moves (where the worker has the privilege), drop every capability and
              apply Landlock (sandbox.py); start the accelerator (its driver starts threads, which
              inherit all of that, names them, and opens a socket); then the seccomp filter, on
              every thread at once, and a check that the kernel reports each thread confined.
              From here on, this process and all it starts can read only what the rules name and
              write only the private folder (and, on CUDA, the files of its own threads)
    load      import train.py (load_for_eval) or inference.py (load_scorer) from the harness's
              private copy, and load the checkpoint copy
    buffers   map the sealed shared-memory buffers the logits go into (model mode)
    forward   model(rows) -> logits into a buffer          (model mode; repeated)
    score     scorer.score(sequences) -> losses, greedy     (scorer mode; repeated)

Until `load`, only the interpreter, numpy, torch and the kit's harness code have run."""
from __future__ import annotations

import importlib.util
import mmap
import os
import signal
import socket
import sys
from pathlib import Path

import numpy as np

from harness.common import EvalRefused, HarnessError
from harness.worker import limits, sandbox, wire


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
        raise HarnessError(f"importing {path.name} failed: {type(e).__name__}: {e}") from e
    return module


def call_participant_loader(path, module_name: str, hook_name: str, checkpoint, device, why: str):
    """`hook_name(checkpoint, device)` from the participant file at path, with clear errors for a
    missing hook and a checkpoint the hook cannot load."""
    import torch
    module = import_participant_module(path, module_name)
    hook = getattr(module, hook_name, None)
    if not callable(hook):
        raise HarnessError(f"{Path(path).name} defines no {hook_name}(checkpoint_path, device); {why}")
    try:
        return hook(str(checkpoint), torch.device(device))
    except Exception as e:
        raise HarnessError(f"{hook_name} could not load {Path(checkpoint).name}: {type(e).__name__}: {e}") from e


def load_participant_model(train_py, checkpoint, device):
    """train_py's load_for_eval(checkpoint, device), checked against the load contract."""
    import torch
    model = call_participant_loader(train_py, "participant_train", "load_for_eval", checkpoint, device,
                                    "the scorer loads the model through it (see docs/trust-model.md, 'The metric "
                                    "and the load contract')")
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


def device_present() -> str:
    """The fastest device present, found without starting one (a driver's threads started before the sandbox
    would stay outside it): CUDA where torch was built for it and a GPU's device node exists, else what
    detect_device_type finds (neuron or cpu; on those it starts nothing)."""
    import glob
    import torch
    from harness.common import detect_device_type
    if torch.backends.cuda.is_built() and glob.glob("/dev/nvidia[0-9]*"):
        return "cuda"
    return detect_device_type()


def resolve_device(name: str, local_rank: int, present: str):
    """The worker's device: "auto" is `present`, the fastest device the worker found before its sandbox, so
    the harness process itself never touches an accelerator and the sandbox can never turn "auto" into a
    slower device; CUDA takes the rank's own GPU."""
    import torch
    kind = present if name == "auto" else name
    return torch.device(f"cuda:{local_rank}" if kind == "cuda" else kind)


def start_device(device) -> None:
    """Start a CUDA device: its context, and a matmul in fp32 and bf16 (cuBLAS's handles). Its start writes
    /proc/<pid>/task/<tid>/comm to name the driver's threads (the thread-names rule) and asks for a socket
    (allowed until the seccomp filter applies); once started, the forwards need neither. A device that does
    not start is one clear error, before any participant code runs."""
    import torch
    if device.type != "cuda":
        return
    try:
        torch.cuda.set_device(device)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(16, 16, device=device, dtype=dtype)
            (x @ x).sum().item()
    except RuntimeError as e:
        raise HarnessError(f"the worker cannot start {device} on this machine ({str(e).splitlines()[0][:200]}). "
                           "Score with --device cpu, or with --no-sandbox to tell a sandbox problem from a device "
                           "problem (not official).") from None


def enter_sandbox(msg: dict, device) -> list[str]:
    """Apply the sandbox msg names, start the device inside it, and check with the kernel that every thread
    is confined; returns what was applied. Any failure is an error (participant code never runs in a
    half-applied sandbox), but for the noatime namespace, which needs a privilege the worker may lack: its
    absence is reported (no "noatime"), and the harness reads ahead instead."""
    threads = sandbox.thread_count()
    if threads != 1:  # each part below binds only the thread that applies it and the threads it starts later
        raise HarnessError(f"the worker runs {threads} threads before its sandbox, and a thread started before it "
                           "would stay outside it (a thread pool started at import: OPENBLAS_NUM_THREADS=1)")
    applied, noatime = [], False
    if msg.get("noatime"):  # first: it needs CAP_SYS_ADMIN, and Landlock forbids mounting
        try:
            noatime = not sandbox.remount_noatime()
        except OSError:
            pass  # no privilege: the harness reads ahead instead (access_times.py)
    sandbox.set_no_new_privs()
    sandbox.drop_capabilities()
    applied.append("capabilities")
    if msg["abi"] > 0:
        rules = msg["rules"]
        if device.type == "cuda":  # the driver names the threads it starts
            rules = rules + [sandbox.thread_names_rule()]
            applied.append("thread-names")
        sandbox.apply_landlock(rules, msg["abi"])
        applied.append(f"landlock-{msg['abi']}")
    start_device(device)
    if msg["seccomp"]:
        sandbox.apply_seccomp(msg["seccomp"])  # on every thread, the driver's included
        applied.append("seccomp")
    unconfined = sandbox.unconfined_threads(seccomp=bool(msg["seccomp"]))
    if unconfined:
        raise HarnessError(f"threads {unconfined[:5]} of the worker are outside its sandbox")
    return applied + ["noatime"] * noatime


class Server:
    """Answers the harness's requests, one at a time, until it says "exit" or hangs up."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.model = self.scorer = self.device = None
        self.present = "cpu"  # the fastest device present, found before the sandbox (see sandbox())
        self.outputs: list[np.ndarray] = []

    def hello(self, msg: dict) -> dict:
        return {"sys_path": [os.path.abspath(p) for p in sys.path if p]}

    def sandbox(self, msg: dict) -> dict:
        """The rlimits (they hold with or without the sandbox), the device found, and the sandbox entered."""
        limits.apply_rlimits(msg["rlimits"])
        self.present = device_present()  # trusted code, before the sandbox: the device is not the sandbox's choice
        device = resolve_device(msg.get("device", "auto"), int(msg.get("local_rank", 0)), self.present)
        if msg.get("off"):
            start_device(device)
            return {"applied": []}
        return {"applied": enter_sandbox(msg, device)}

    def load(self, msg: dict) -> dict:
        import torch
        self.device = resolve_device(msg["device"], int(msg["local_rank"]), self.present)
        start_device(self.device)  # started in sandbox(): a check that it still works
        if self.device.type == "neuron" and hasattr(torch, "neuron") and hasattr(torch.neuron, "set_device"):
            torch.neuron.set_device(int(msg["local_rank"]))
        if msg["mode"] == "model":
            self.model = load_participant_model(msg["file"], msg["checkpoint"], self.device)
            return {"device": str(self.device)}
        self.scorer = call_participant_loader(msg["file"], "participant_inference", "load_scorer", msg["checkpoint"],
                                              self.device, "the CORE scorer calls it (see docs/phase2.md, 'CORE')")
        if not callable(getattr(self.scorer, "score", None)):
            raise HarnessError(f"load_scorer returned {type(self.scorer).__name__}, which has no score(sequences) "
                               "method")
        max_len = getattr(self.scorer, "max_seq_len", None)
        if max_len is not None and not (isinstance(max_len, int) and max_len >= 2):
            raise HarnessError(f"scorer.max_seq_len must be an int >= 2 or None, got {max_len!r}")
        return {"max_seq_len": max_len, "device": str(self.device)}

    def buffers(self, msg: dict, fds: list[int]) -> dict:
        shape = tuple(msg["shape"])
        self.outputs = []
        for fd in fds:
            mapped = mmap.mmap(fd, int(np.prod(shape)) * 4, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            self.outputs.append(np.ndarray(shape, dtype=np.float32, buffer=mapped))
        self.vocab = shape[2]
        return {}

    def forward(self, msg: dict, payload: bytes) -> dict:
        import torch
        slot, n, length = msg["slot"], msg["rows"], msg["length"]
        x = torch.from_numpy(np.frombuffer(payload, dtype=np.int32).reshape(n, length).astype(np.int64))
        with torch.no_grad():
            out = self.model(x.to(self.device))
        self.outputs[slot][:n, :length] = wire.logits_array(out, n, length, self.vocab)
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
                msg, payload, fds = wire.recv_request(self.sock)
            except ConnectionError:
                return
            cmd = msg.get("cmd")
            if cmd == "exit":
                return
            reply, data = {}, b""
            try:
                if cmd == "hello":
                    reply = self.hello(msg)
                elif cmd == "sandbox":
                    reply = self.sandbox(msg)
                elif cmd == "load":
                    reply = self.load(msg)
                elif cmd == "buffers":
                    reply = self.buffers(msg, fds)
                elif cmd == "forward":
                    reply = self.forward(msg, payload)
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
            wire.send(self.sock, reply, data)


def main() -> None:
    sandbox.die_with_parent(signal.SIGKILL)
    sock = socket.socket(fileno=int(sys.argv[1]))
    import torch  # noqa: F401  (trusted code, before the sandbox: the import needs nothing later)
    Server(sock).serve()
    # Done: the harness kills this process group next. Skip the interpreter's teardown (collecting
    # torch's objects takes about 0.5 s, which every evaluation would wait for twice) and run no
    # participant finaliser after the last answer; only the output is flushed first.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)  # and what native code wrote through C's stdio
    except (OSError, AttributeError):
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
