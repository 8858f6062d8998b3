"""The receiving thread woken once ``WAKE_BYTES`` of a reply are unread (``SO_RCVLOWAT``,
``stream_connection.WAKE_BYTES``), not at every TCP segment, and never waiting for more than
the peer still owes it: the kernel's cap, and the tail of a reply, smaller than the bound,
arriving while the thread waits (a wait for more than is left would sleep, every byte in,
until the deadline), over real loopback TCP."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import time

import pytest

from kvserver import wire_stream
from kvserver.daemon.peers import stream_connection
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.stream_connection import StreamConnection

PEER = Peer("F", "", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1")


def unread(sock: socket.socket) -> int:
    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", raw)[0])


def test_the_wake_bound_is_what_the_kernel_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for more than the kernel allows (half the largest receive buffer), the bound is
    the kernel's: a receive never waits for more than the socket will wake it for."""
    monkeypatch.setattr(stream_connection, "WAKE_BYTES", 2**31 - 1)
    with socket.socket() as sock:
        got = stream_connection._wake_bytes(sock)
        assert 1 < got < 2**31 - 1
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # left as it was


async def test_a_reply_smaller_than_the_bound_wakes_the_thread() -> None:
    """640 KiB in four parts, fewer bytes than the 1 MiB bound: the thread waits for what the
    peer owes it, not for the bound; the peer keeps the connection open, and the receive ends
    long before its deadline (waiting for 1 MiB, it would sleep, every byte in, until then)."""
    part = 160 << 10
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    try:
        conn = StreamConnection(ours, PEER)
        assert conn._wake == stream_connection.WAKE_BYTES == 1 << 20  # this kernel takes it
        rows = [[memoryview(bytearray(part))] for _ in range(4)]
        job = conn.start_reply(7, rows, 1, part, time.monotonic() + 60, lambda head: None)
        theirs.sendall(wire_stream.encode_ok(7, 4, 1, part))
        for i in range(4):
            theirs.sendall(bytes([i + 1]) * part)
        async with asyncio.timeout(20):  # a wait for 1 MiB would last the 60 s deadline
            head, error = await job.result()
        assert error is None and head.count == 4
        assert [bytes(row[0]) for row in rows] == [bytes([i + 1]) * part for i in range(4)]
        assert unread(ours) == 0
    finally:
        ours.close()
        theirs.close()
        listener.close()
