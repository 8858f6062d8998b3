"""The peer benchmark's floor: the same bytes moved arena pages to arena pages over plain TCP,
with no protocol at all (``benchmarks/bench_peers.py``).

Two processes: :func:`serve_tcp` runs in a helper process (``python -m benchmarks.bench_peers
serve-tcp ...``), :class:`RawArenaTcp` in the benchmark. Plain functions and one
single-threaded class.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import time
from pathlib import Path


def shm_mapping(size: int) -> mmap.mmap:
    """A prefaulted shared mapping of a /dev/shm file, like a daemon's arena (unlinked)."""
    path = f"/dev/shm/kvserver-bench-peers-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    page = b"\1" * 4096
    for off in range(0, size, len(page)):
        m[off : off + len(page)] = page
    return m


def serve_tcp(endpoint_file: str, part_bytes: int, n: int, batches: int) -> int:
    """Helper process of the floor: per request byte, ``n`` parts of ``part_bytes`` sent over
    plain TCP out of a /dev/shm mapping of ``batches`` batches, a batch after another (as A
    sends out of its arena), with ``sendmsg`` of the parts' views; b"s" stops it. Writes its
    port to ``endpoint_file``."""
    batch = n * part_bytes
    arena = memoryview(shm_mapping(batches * batch))
    listener = socket.create_server(("127.0.0.1", 0))
    Path(endpoint_file).write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    r = 0
    while conn.recv(1) == b"g":
        base = (r % batches) * batch
        views = [arena[base + i * part_bytes : base + (i + 1) * part_bytes] for i in range(n)]
        while views:
            sent = conn.sendmsg(views[:1024])
            while views and sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            if views and sent:
                views[0] = views[0][sent:]
        r += 1
    return 0


class RawArenaTcp:
    """The floor: the helper's (``proc``, listening on ``port``) plain TCP stream received
    with ``recvmsg_into`` (``MSG_WAITALL``, every part's view in one call) straight into a
    /dev/shm mapping of ``recv_bytes`` (B's DRAM), rotating as B's pages do: arena pages to
    arena pages with no protocol at all."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        port: int,
        part_bytes: int,
        n: int,
        recv_bytes: int,
        timeout_s: float,
    ) -> None:
        self.proc = proc
        self.sock = socket.create_connection(("127.0.0.1", port), 30)
        self.sock.settimeout(timeout_s)
        self.part_bytes, self.n = part_bytes, n
        self.size = recv_bytes
        self.arena = memoryview(shm_mapping(recv_bytes))
        self.rounds = 0

    def round(self) -> float:
        size, region = self.part_bytes, self.size // 3  # a batch starts a third further each time
        base = (self.rounds % 3) * region
        self.rounds += 1
        start = time.perf_counter()
        self.sock.sendall(b"g")
        views = [self.arena[(base + i * size) % self.size :][:size] for i in range(self.n)]
        while views:
            got = self.sock.recvmsg_into(views[:1024], 0, socket.MSG_WAITALL)[0]
            while views and got >= views[0].nbytes:
                got -= views.pop(0).nbytes
            if views and got:
                views[0] = views[0][got:]
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.sendall(b"s")
        self.proc.wait(10)
        self.sock.close()
