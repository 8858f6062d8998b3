"""A raw connection to the daemon's local channel for tests: frames in, frames out.

Shaped like the ZMQ DEALER the tests use (``send_multipart``, ``recv_multipart``, ``poll``,
``close``) so that the same test can speak to either transport.
"""

from __future__ import annotations

import select
import socket
from typing import Any

from kvserver import wire_local


class LocalConn:
    """One Unix-socket connection; every call blocks at most ``timeout`` seconds."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_multipart(self, frames: list[Any]) -> None:
        self.send_raw(b"".join(bytes(b) for b in wire_local.encode(frames)))

    def poll(self, timeout_ms: int) -> bool:
        return bool(select.select([self.sock], [], [], timeout_ms / 1000)[0])

    def recv_exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise EOFError("the daemon closed the connection")
            out += got
        return bytes(out)

    def recv_multipart(self) -> list[bytes]:
        (size,) = wire_local.SIZE.unpack(self.recv_exactly(wire_local.SIZE.size))
        body = memoryview(self.recv_exactly(size))
        return [bytes(v) for v in wire_local.decode(body)]

    def closed_by_peer(self) -> bool:
        """True once the daemon has closed its end (EOF)."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True

    def close(self) -> None:
        self.sock.close()
