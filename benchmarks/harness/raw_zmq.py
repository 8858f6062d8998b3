"""The peer benchmark's reference: raw pyzmq between two processes (``benchmarks/bench_peers.py``).

A helper process (``python -m benchmarks.bench_peers serve ...``: :func:`serve`) with a ROUTER
answers each DEALER request of :class:`RawPeer` (in the benchmark) with the same frames as a
fetch brings (the same count and sizes, sent ``copy=False`` from buffers allocated in advance,
received ``copy=False``), and nothing else. :func:`start_helper` starts either helper of the
benchmark (this one, or the floor's ``serve-tcp``, ``raw_tcp.py``). Plain functions and one
single-threaded class.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import zmq


def payload(key: bytes, nbytes: int) -> bytes:
    """``nbytes`` of ``key`` repeated: a chunk's part whose bytes say which key it is."""
    return (key * (nbytes // len(key) + 1))[:nbytes]


def serve(endpoint_file: str, part_bytes: int, n: int) -> int:
    """Helper process: a ROUTER answering every request with ``n`` frames of ``part_bytes``."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    frames = [bytearray(payload(b"ref%d" % i, part_bytes)) for i in range(n)]
    Path(endpoint_file).write_text(f"tcp://127.0.0.1:{port}")
    while True:
        ident, request = router.recv_multipart(copy=False)
        if request.bytes == b"stop":
            return 0
        router.send_multipart([ident.bytes, b"header", *frames], copy=False)


def start_helper(
    mode: str, workdir: Path, part_bytes: int, n: int, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], Path]:
    """The helper process of a reference (``mode``: ``serve`` or ``serve-tcp``) and the file
    where it wrote its endpoint, once written (bounded by 30 s)."""
    ep = workdir / f"{mode}-{part_bytes}-{time.monotonic_ns()}.ep"  # fresh each run
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_peers", mode, str(ep), str(part_bytes), str(n)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
    )
    deadline = time.monotonic() + 30
    while not ep.exists() or not ep.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"reference helper ({mode}) did not start")
        time.sleep(0.02)  # waiting for the helper's endpoint, bounded by the deadline
    return proc, ep


class RawPeer:
    """The reference's two processes: the helper (ROUTER) and this one (DEALER)."""

    def __init__(
        self, workdir: Path, part_bytes: int, n: int, env: dict[str, str], timeout_ms: int
    ) -> None:
        self.proc, ep = start_helper("serve", workdir, part_bytes, n, env)
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.dealer.connect(ep.read_text())
        self.n = n

    def round(self) -> float:
        start = time.perf_counter()
        self.dealer.send(b"get")
        frames = self.dealer.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
        assert len(frames) == self.n + 1
        return elapsed

    def close(self) -> None:
        self.dealer.send(b"stop")
        self.proc.wait(10)
        self.dealer.close()
        self.ctx.term()
