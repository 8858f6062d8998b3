"""benchmarks/peers_wire.py moves real batches over loopback TCP from both senders into every
kind of destination (and pinned to one CPU), beside the raw ZMQ reference (and the ZMQ pair
pinned): each case's bytes are the sender's, and every figure of the report is there and
positive; a case it does not know is refused."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from benchmarks.harness.raw_tcp import shm_mapping
from benchmarks.harness.splice import SpliceSender, address
from benchmarks.peers_wire import Case, measure


def test_every_sender_and_destination_moves_the_batch(tmp_path: Path) -> None:
    cases = ["blocking:rotate", "loop:rotate", "loop:same", "loop:heap", "loop:rotate:same",
             "zmq:heap:split", "splice:rotate", "splice:heap:split"]  # fmt: skip
    result = measure(4 << 20, 1, cases, tmp_path)  # 8 parts of 4 MiB, one timed round
    assert result["reference_ms"] > 0 and result["reference_sender_cpu_ms"] > 0
    assert sorted(result["cases"]) == sorted(cases)
    for row in result["cases"].values():
        assert row["ms"] > 0 and row["ratio"] > 0 and row["paired_ratio"] > 0
        assert row["receiver_cpu_ms"] > 0 and row["sender_cpu_ms"] > 0
        assert min(row["sender_user_sys_ms"].values()) >= 0
    assert min(result["reference_sender_user_sys_ms"].values()) >= 0


def test_an_unknown_case_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SENDER:DEST"):
        Case("sendfile:rotate", tmp_path, 1 << 20, {})
    with pytest.raises(ValueError, match="SENDER:DEST"):
        Case("loop:rotate:elsewhere", tmp_path, 1 << 20, {})
    with pytest.raises(ValueError, match="SENDER:DEST"):
        Case("zmq:rotate", tmp_path, 1 << 20, {})


def test_the_splice_sender_sends_every_span_in_order() -> None:
    """Spans of a /dev/shm mapping, larger than the pipe, at offsets not page-aligned, arrive
    whole and in order through vmsplice and splice."""
    mapping = shm_mapping(8 << 20)
    mapping[:] = bytes(range(251)) * ((8 << 20) // 251) + bytes((8 << 20) % 251)
    spans = [(3, 5 << 20), (7 << 20, 12345), (6 << 20, 1)]
    a, b = socket.socketpair()
    out = SpliceSender(a.fileno())
    try:
        sent: list[int] = []
        base = address(mapping)
        sender = threading.Thread(
            target=lambda: sent.append(out.send([(base + o, n) for o, n in spans]))
        )
        sender.start()
        want = b"".join(mapping[o : o + n] for o, n in spans)
        got = bytearray()
        while len(got) < len(want):
            got += b.recv(1 << 20)
        sender.join(30)
        assert out.pipe_bytes > 0 and bytes(got) == want and sent == [len(want)]
    finally:
        out.close()
        a.close()
        b.close()
