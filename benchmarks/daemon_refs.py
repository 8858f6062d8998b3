"""The other processes of ``kvserver bench`` and its references: what is compared to what.

Runs in the bench process (:func:`own_daemon`, :func:`memcpy_round`, :class:`ZmqPeer`) and in
the helper process that :class:`ZmqPeer` starts (``python -m benchmarks.daemon_refs STORE_EP
LOAD_EP``). Nothing here imports daemon code but the allocator settings
(``kvserver/daemon/malloc.py``, shared with the daemon); nothing is thread-safe (one bench, one
thread).

- :func:`own_daemon`: ``kvserver start`` as a subprocess on ephemeral loopback ports, stopped
  with SIGTERM (the bench process stays a client in another process).
- :func:`memcpy_round`: the co-located reference. The same parts copied, one single-threaded
  memoryview slice assignment per part, from the source buffers into a staging buffer (the
  stand-in for the arena) and back out into the destination buffers: one memcpy per part and
  direction, exactly the copies the shared-memory path makes, with no protocol around them.
- :class:`ZmqPeer`: the remote reference, raw pyzmq between two processes over TCP loopback,
  PUSH → PULL one way and PUSH → PULL back. One *round* mirrors ``put`` + ``get``:

  1. store: bench → peer ``[b"store", part * n]`` (``copy=False``); peer → bench ``[b"ack"]``
     once it has received the whole message (``copy=False``);
  2. load: bench → peer ``[b"load", size, n]``; peer → bench ``[b"data", part * n]`` sent with
     ``copy=False`` from buffers it allocated in advance; the bench receives it
     (``copy=False``).

  Same frame sizes, the same number of frames per message, the same two round trips and the
  same ``copy=False`` as the kvserver client and daemon use. The peer does nothing with what it
  receives (no copy into storage, no validation, no bookkeeping): that work is kvserver's
  overhead and is what the ratio shows.

Allocator settings (:data:`MALLOC_ENV`, :func:`tune_malloc`, from ``kvserver/daemon/malloc.py``,
which the daemon also applies to itself): with glibc's defaults a process that receives large
ZMQ messages returns their buffers to the kernel after each batch (dynamic mmap threshold, heap
trimming, one arena per thread) and page-faults them in again on the next one; on a VM this
costs more than the copy itself and varies from run to run. ``kvserver bench`` therefore gives
every process of the run — the daemon, the raw-ZMQ peer and itself — the same settings (one
arena, mmap threshold 32 MiB, trim threshold 1 GiB), unless told not to. The reference is
tuned exactly as kvserver is.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvserver.daemon.malloc import MALLOC_ENV as MALLOC_ENV
from kvserver.daemon.malloc import tune_malloc as tune_malloc

PEER_TIMEOUT_MS = 30_000
READY_TIMEOUT_S = 60.0
_LOAD = struct.Struct("<QQ")

# --------------------------------------------------------------------------- the daemon


@dataclass(frozen=True, slots=True)
class Target:
    """A daemon to bench: its ZMQ data-plane endpoint and its gRPC address."""

    zmq: str
    grpc: str


def unanswered(target: Target, timeout_s: float) -> str | None:
    """Why the running daemon ``target`` names does not answer, or None when it does: asked as
    ``kvserver status`` asks (a gRPC Stats bounded by ``timeout_s``, its ``--timeout``
    default, said in status's words), then a ZMQ hello bounded the same. The bench's own calls
    wait up to a minute each; a daemon that is not there is said at once."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # as status: no gRPC C-core log lines
    from kvserver.cli_ops import unreachable
    from kvserver.client import KVClient
    from kvserver.errors import KVServerError, Unavailable
    from kvserver.grpc_client import GrpcClient

    try:
        with GrpcClient(target.grpc, timeout=timeout_s) as grpc:
            grpc.stats()
    except Unavailable as exc:
        return unreachable(target.grpc, timeout_s, exc.message)
    except KVServerError as exc:
        return f"the daemon at {target.grpc}: {exc}"
    try:
        with KVClient(target.zmq, timeout=timeout_s) as kv:
            kv.hello()
    except KVServerError as exc:
        return f"the daemon at {target.grpc} answers over gRPC, but {exc}"
    return None


@contextmanager
def own_daemon(
    dram: str, workdir: Path, env: dict[str, str], policy: str = "prefix"
) -> Iterator[Target]:
    """Run ``kvserver start`` on ephemeral loopback ports (``env`` added) with DRAM eviction
    policy ``policy`` (default: the recorded figures', harness.daemon.RECORDED_POLICY);
    SIGTERM it on exit."""
    ready = workdir / "ready.json"
    log_path = workdir / "daemon.log"
    args = [
        sys.executable, "-m", "kvserver.cli", "start", "--host", "127.0.0.1",
        "--grpc-port", "0", "--zmq-port", "0", "--pub-port", "0", "--dram", dram,
        "--policy", policy, "--ready-file", str(ready), "--log-level", "WARNING",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        env = {**os.environ, **env}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.02)  # polling for the ready file, bounded by the deadline
        info = json.loads(ready.read_text())
        yield Target(f"tcp://127.0.0.1:{info['zmq_port']}", f"127.0.0.1:{info['grpc_port']}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(10)
        if rc != 0:
            tail = log_path.read_text(errors="replace")[-4000:]
            print(f"kvserver bench: the daemon exited with {rc}:\n{tail}", file=sys.stderr)


# --------------------------------------------------------------------------- references


def page_aligned(nbytes: int, fill: bytes | None = None) -> memoryview:
    """A buffer of ``nbytes`` at a page boundary (a private anonymous mapping), touched in
    advance: ``fill`` copied in (REQUIRES: ``nbytes`` long), else zeroed.

    The bench's source, staging and destination buffers are these, not ``bytearray``s: glibc
    maps a ``bytearray`` this large with its 16-byte chunk header in front, so its bytes start
    16 past a page boundary, while every arena extent starts on one. A copy out of the arena
    into such a buffer has its destination 16 bytes past its source modulo 4 KiB, and ``rep
    movsb`` (glibc's memcpy for these sizes) runs ~25 % slower at a distance of 1-63 bytes
    modulo 4 KiB on this machine's CPU (measured at 256 KiB parts; 0 and >= 64 run alike),
    whereas the memcpy reference copied between two ``bytearray``s, at distance 0. Page-aligned
    buffers give both sides the same copies, as a worker's tensors (64-byte aligned, blocks at
    multiples of their size) have them (docs/benchmarks.md, session 14).
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    buf = memoryview(mapping)
    buf[:] = fill if fill is not None else bytes(nbytes)
    return buf


def memcpy_round(src: Sequence[memoryview], stage: memoryview, dst: Sequence[memoryview]) -> None:
    """Copy every ``src[i]`` into consecutive slices of ``stage``, then those into ``dst[i]``.

    REQUIRES: ``stage`` holds at least the sum of the part sizes; ``dst[i]`` has ``src[i]``'s
    size. Single-threaded; one memcpy per part and direction.
    """
    pos = 0
    for part in src:
        stage[pos : pos + part.nbytes] = part
        pos += part.nbytes
    pos = 0
    for out in dst:
        out[:] = stage[pos : pos + out.nbytes]
        pos += out.nbytes


class ZmqPeer:
    """A raw-ZMQ peer process and the bench's end of the two PUSH/PULL pipes (see module doc).

    Call order: ``start()`` → ``store_load()`` any number of times → ``close()``.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        for sock in (self._push, self._pull):
            sock.setsockopt(zmq.LINGER, 0)
        store_port = self._push.bind_to_random_port(f"tcp://{host}")
        load_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self._endpoints = (f"tcp://{host}:{store_port}", f"tcp://{host}:{load_port}")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start the peer process (``env`` added to ours) and wait until both pipes work."""
        args = [sys.executable, "-m", "benchmarks.daemon_refs", *self._endpoints]
        self._proc = subprocess.Popen(args, env={**os.environ, **(env or {})})
        self._push.send_multipart([b"ping"])
        self._expect(b"pong")

    def store_load(self, parts: Sequence[memoryview]) -> list[Any]:
        """One store + load round (see the module docstring); returns the received frames.

        REQUIRES: every part has the same size.
        """
        self._push.send_multipart([b"store", *parts], copy=False)
        self._expect(b"ack")
        size = parts[0].nbytes if parts else 0
        self._push.send_multipart([b"load", _LOAD.pack(size, len(parts))])
        frames = self._expect(b"data")
        return frames[1:]

    def close(self) -> None:
        """Stop the peer (a ``stop`` message, then kill after a timeout) and close sockets."""
        if self._proc is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._push.send_multipart([b"stop"], flags=zmq.NOBLOCK)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    def _expect(self, tag: bytes) -> list[Any]:
        if not self._pull.poll(PEER_TIMEOUT_MS, zmq.POLLIN):
            raise TimeoutError(f"raw ZMQ peer sent no {tag!r} within {PEER_TIMEOUT_MS} ms")
        frames: list[Any] = self._pull.recv_multipart(copy=False)
        if frames[0].bytes != tag:
            raise RuntimeError(f"raw ZMQ peer: expected {tag!r}, got {frames[0].bytes[:16]!r}")
        return frames


def _peer_main(store_endpoint: str, load_endpoint: str) -> int:
    """The peer process: answers ping / store / load until ``stop`` (or a quiet timeout)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.connect(store_endpoint)
    push.connect(load_endpoint)
    buffers: dict[tuple[int, int], list[memoryview]] = {}
    try:
        while pull.poll(PEER_TIMEOUT_MS * 4, zmq.POLLIN):
            frames = pull.recv_multipart(copy=False)
            op = frames[0].bytes
            if op == b"ping":
                push.send_multipart([b"pong"])
            elif op == b"store":
                del frames  # received in full; nothing else to do with it
                push.send_multipart([b"ack"])
            elif op == b"load":
                size, count = _LOAD.unpack(frames[1].bytes)
                parts = buffers.get((size, count))
                if parts is None:
                    block = memoryview(bytearray(size * count))
                    parts = [block[i * size : (i + 1) * size] for i in range(count)]
                    buffers = {(size, count): parts}  # keep one set: bounded memory
                push.send_multipart([b"data", *parts], copy=False)
            else:
                break
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(_peer_main(sys.argv[1], sys.argv[2]))
