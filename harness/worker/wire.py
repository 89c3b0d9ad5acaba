"""What travels between the harness and a worker, and the checks both ends share.

The messages: a 4-byte length, a JSON header, then `payload` raw bytes (the header says how
many). File descriptors (the shared logits buffers) travel with a header as SCM_RIGHTS, harness
to worker only.

Everything the worker sends is untrusted input to the harness, so the harness's end (`recv`) is
strict: the header is at most MAX_HEADER_BYTES of plain JSON (no NaN or Infinity) holding an
object, `payload` is an int no larger than the caller allows (0 where a reply carries no
payload), and every read has a deadline. Any deviation is a WorkerError with one line saying what
was wrong. The worker's end (`recv_request`) reads the harness's requests as they come.

A model's output: `logits_array` turns what model(inputs) returned into float32 logits, or
refuses it. The worker runs it on its model's output; metric's in-process path on the caller's
model."""
from __future__ import annotations

import json
import socket
import struct
import time

import numpy as np

from harness.common import EvalRefused, HarnessError

MAX_HEADER_BYTES = 64 << 10  # a reply header larger than this is a broken or hostile worker
LOGIT_DTYPES = ("float32", "bfloat16", "float16")  # what model(inputs) may return


class WorkerError(HarnessError):
    """The worker failed: it could not load the participant's files, crashed, or broke the protocol."""


class WorkerTimeout(HarnessError):
    pass


def send(sock: socket.socket, header: dict, payload=b"", fds=()) -> None:
    data = json.dumps({**header, "payload": len(payload)}).encode()
    message = struct.pack("<I", len(data)) + data
    sent = socket.send_fds(sock, [message], list(fds)) if fds else 0
    sock.sendall(message[sent:])
    if len(payload):
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """n bytes, or WorkerTimeout past the deadline, ConnectionError if the peer closed."""
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout("the worker did not answer in time")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], min(n - got, 1 << 20))
        except socket.timeout:
            raise WorkerTimeout("the worker did not answer in time") from None
        if k == 0:
            raise ConnectionError("the worker closed its connection")
        got += k
    return bytes(buf)


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_header(raw: bytes, max_payload: int) -> tuple[dict, int]:
    """(header, payload size) of a reply, or WorkerError."""
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WorkerError(f"the worker sent a malformed message header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise WorkerError("the worker sent a message header that is not a JSON object")
    size = header.get("payload")
    if type(size) is not int or not 0 <= size <= max_payload:
        raise WorkerError(f"the worker announced a payload of {str(size)[:40]!r} bytes (expected an integer from 0 to "
                          f"{max_payload})")
    return header, size


def recv(sock: socket.socket, deadline: float | None, max_payload: int = 0) -> tuple[dict, bytes]:
    """The harness's end: one reply, checked (see the module docstring)."""
    (size,) = struct.unpack("<I", recv_exact(sock, 4, deadline))
    if size > MAX_HEADER_BYTES:
        raise WorkerError(f"the worker sent a {size}-byte message header (at most {MAX_HEADER_BYTES})")
    header, payload_size = parse_header(recv_exact(sock, size, deadline), max_payload)
    return header, recv_exact(sock, payload_size, deadline)


def recv_request(sock: socket.socket) -> tuple[dict, bytes, list[int]]:
    """The worker's end: one request from the harness (trusted), with any file descriptors."""
    raw, fds, _, _ = socket.recv_fds(sock, 4, 8)
    if not raw:
        raise ConnectionError("the harness closed the connection")
    raw += recv_exact(sock, 4 - len(raw), None)
    (size,) = struct.unpack("<I", raw)
    header = json.loads(recv_exact(sock, size, None))
    return header, recv_exact(sock, header["payload"], None), fds


def logits_array(out, batch: int, seq_len: int, vocab: int) -> np.ndarray:
    """model(inputs)'s output as float32 [batch, seq_len, vocab], or EvalRefused: it must be
    exactly a plain torch.Tensor (no subclass) of a floating dtype and shape [batch, seq_len, V >= vocab]."""
    import torch  # only here: the messages need no torch
    if type(out) is not torch.Tensor:
        raise EvalRefused(f"model(inputs) must return a plain torch.Tensor of logits, got {type(out).__module__}."
                          f"{type(out).__qualname__}")
    if str(out.dtype).replace("torch.", "") not in LOGIT_DTYPES:
        raise EvalRefused(f"model(inputs) returned logits of dtype {out.dtype}; expected one of {LOGIT_DTYPES}")
    if out.dim() != 3 or out.shape[0] != batch or out.shape[1] != seq_len or out.shape[2] < vocab:
        raise EvalRefused(f"model(inputs) returned shape {tuple(out.shape)} for inputs {(batch, seq_len)}; "
                          f"expected logits [{batch}, {seq_len}, V] with V >= {vocab}")
    return out.detach()[..., :vocab].to("cpu", torch.float32).numpy()
