"""The receiving thread woken once ``WAKE_BYTES`` of a reply are unread (``SO_RCVLOWAT``,
``stream_connection.WAKE_BYTES``), less towards the reply's end (``wake_at``), not at every
TCP segment, and never waiting for more than the peer still owes it: the kernel's cap, the
bound's steps, and the tail of a reply, smaller than the bound, arriving while the thread
waits (a wait for more than is left would sleep, every byte in, until the deadline), over
real loopback TCP."""

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


def test_the_bound_halves_towards_the_end_and_never_passes_what_is_left() -> None:
    """32 MiB at a 4 MiB bound: 4 MiB while more than 8 MiB are to come, then half of what is
    left down to 1 MiB, then the rest: 10 wake-ups at most, the last copy after the last byte
    at most 1 MiB; a bound the kernel capped lower, or a reply shorter than it, is kept to."""
    mib = 1 << 20
    steps, left = [], 32 * mib
    while left:
        steps.append(stream_connection.wake_at(left, 4 * mib))
        left -= steps[-1]
    assert steps == [4 * mib] * 7 + [2 * mib, mib, mib]
    assert stream_connection.wake_at(32 * mib, 512 << 10) == 512 << 10  # the kernel's cap
    assert stream_connection.wake_at(1000, 4 * mib) == 1000  # never more than is owed
    assert stream_connection.wake_at(3 * mib, 4 * mib) == 1_572_864  # half of it


async def test_a_reply_smaller_than_the_bound_wakes_the_thread() -> None:
    """640 KiB in four parts, fewer bytes than the 1 MiB tail bound: the thread waits for what
    the peer owes it, not for the bound; the peer keeps the connection open, and the receive
    ends long before its deadline (waiting for 1 MiB, it would sleep, every byte in, until
    then)."""
    part = 160 << 10
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    try:
        conn = StreamConnection(ours, PEER)
        assert conn._wake == stream_connection.WAKE_BYTES == 4 << 20  # this kernel takes it
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


async def test_a_reply_ending_in_the_halving_steps_is_received_whole() -> None:
    """6 MiB in six parts at the 4 MiB bound (the first wait is for 3 MiB, half of what is
    owed), the last 1.5 MiB sent only once the thread has read and waits on a smaller bound
    for fewer bytes than are unread, while the peer keeps the connection open: every byte
    lands, long before the deadline."""
    part = 1 << 20
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    try:
        conn = StreamConnection(ours, PEER)
        rows = [[memoryview(bytearray(part))] for _ in range(6)]
        job = conn.start_reply(9, rows, 1, part, time.monotonic() + 60, lambda head: None)
        body = b"".join(bytes([i + 1]) * part for i in range(6))
        head = wire_stream.encode_ok(9, 6, 1, part)
        await asyncio.to_thread(theirs.sendall, head + body[: 9 * part // 2])
        async with asyncio.timeout(20):  # past its first bound, waiting for more than is in
            while not (1 < conn._lowat < 3 << 20 and unread(ours) < conn._lowat):
                await asyncio.sleep(0.01)  # polling a condition, bounded by the timeout
        theirs.sendall(body[9 * part // 2 :])
        async with asyncio.timeout(20):
            got, error = await job.result()
        assert error is None and got.count == 6
        assert b"".join(bytes(row[0]) for row in rows) == body
        assert unread(ours) == 0
    finally:
        ours.close()
        theirs.close()
        listener.close()
