"""The harness's end of the worker protocol holds its deadline whatever the worker sends: nothing,
part of a frame, or a payload dripped a byte at a time (each read waits only for what is left of
the deadline, never for a fresh timeout). Sub-second deadlines on a socketpair; the end-to-end run
of a stalled worker is test_containment.py's test_a_worker_that_never_answers_meets_the_deadline."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from harness.worker import wire
from harness.worker.wire import WorkerTimeout

DEADLINE = 0.3  # seconds


def frame(header: dict) -> bytes:
    data = json.dumps(header).encode()
    return struct.pack("<I", len(data)) + data


def drip(sock: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    for k in range(len(data)):
        if stop.wait(every):
            return
        try:
            sock.send(data[k:k + 1])
        except OSError:
            return


SENDS = {
    "nothing": b"",
    "half a length": struct.pack("<I", 40)[:2],
    "a length, no header": struct.pack("<I", 40),
    "a header, half its payload": frame({"payload": 100}) + b"x" * 50,
}


@pytest.mark.parametrize("what", sorted(SENDS))
def test_a_worker_that_stops_mid_frame_meets_the_deadline(what):
    harness, worker = socket.socketpair()
    with harness, worker:
        worker.sendall(SENDS[what])
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout, match="did not answer in time"):
            wire.recv(harness, t0 + DEADLINE, max_payload=1000)
        assert DEADLINE - 0.01 < time.monotonic() - t0 < DEADLINE + 0.5


def test_a_payload_dripped_byte_by_byte_does_not_extend_the_deadline():
    harness, worker = socket.socketpair()
    stop = threading.Event()
    with harness, worker:
        dripper = threading.Thread(target=drip, args=(worker, frame({"payload": 10_000}) + b"x" * 10_000, 0.02, stop))
        dripper.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(WorkerTimeout):
                wire.recv(harness, t0 + DEADLINE, max_payload=10_000)
            assert time.monotonic() - t0 < DEADLINE + 0.5
        finally:
            stop.set()
            dripper.join()


def test_a_deadline_already_past_raises_before_reading():
    harness, worker = socket.socketpair()
    with harness, worker:
        worker.sendall(frame({"payload": 0}))
        with pytest.raises(WorkerTimeout):
            wire.recv(harness, time.monotonic() - 1)
        assert wire.recv(harness, time.monotonic() + DEADLINE) == ({"payload": 0}, b"")  # the frame was left alone


def test_a_peer_that_closes_mid_frame_is_a_connection_error_at_once():
    harness, worker = socket.socketpair()
    with harness:
        worker.sendall(struct.pack("<I", 40)[:2])
        worker.close()
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            wire.recv(harness, t0 + 10)
        assert time.monotonic() - t0 < 1
