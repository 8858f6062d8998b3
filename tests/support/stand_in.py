"""Helpers for a test's stand-in server (a socket in place of a daemon's, answering what a
real daemon cannot be made to send: ``tests/kvserver/client/test_stream_lies.py``,
``test_local_lies.py``)."""

from __future__ import annotations

import socket


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    """The next ``n`` bytes of ``conn``; ConnectionError if it closes first."""
    out = b""
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out
