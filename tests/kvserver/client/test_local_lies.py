"""A co-located client's local channel against a daemon whose reply framing lies
(``kvserver/client/links.py`` ``LocalLink.recv``): each frame is bounded by the daemon's
``max_message_bytes`` (its hello's), checked at the framing before the bytes are received,
and a large reply is received into a buffer grown as its bytes arrive, never to its announced
size ahead of them. An announcement past the bound fails the request with InvalidArgument (as
the ZMQ path fails an oversized reply) and the link is closed.

The client is a real one on a real daemon; the local channel's socket is a stand-in bound at
the daemon's path (a real daemon cannot be made to send these replies). What the client
allocates is measured with tracemalloc.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver import wire_local
from kvserver.client import KVClient
from kvserver.errors import InvalidArgument, Unavailable
from tests.support.daemon import DaemonProc, start_daemon
from tests.support.stand_in import recv_exactly

pytestmark = pytest.mark.multiprocess

MAX_MESSAGE = 1 << 20  # the daemon's max_message_bytes


def framing(lengths: list[int]) -> bytes:
    """A reply's framing announcing frames of ``lengths`` (no frame bytes)."""
    count = len(lengths)
    size = wire_local.overhead(count) + sum(lengths)
    return (
        wire_local.SIZE.pack(size)
        + wire_local.COUNT.pack(count)
        + struct.pack(f">{count}Q", *lengths)
    )


class LyingLocal:
    """A stand-in local channel bound at ``path``: takes one connection, reads one request,
    answers it with ``reply``, then (``hang_up`` False) reads until the client drops the
    connection (``dropped`` set), or closes it at once."""

    def __init__(self, path: str, reply: bytes, *, hang_up: bool = False) -> None:
        self._reply, self._hang_up = reply, hang_up
        os.unlink(path)  # the daemon's listener stays open, unreachable by its path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self.dropped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            (size,) = wire_local.SIZE.unpack(recv_exactly(conn, wire_local.SIZE.size))
            recv_exactly(conn, size)
            conn.sendall(self._reply)
            if self._hang_up:
                return
            while conn.recv(1 << 16):
                pass
            self.dropped.set()

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=30)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "16MiB",
                     env={"KVSERVER_MAX_MESSAGE_BYTES": str(MAX_MESSAGE)})  # fmt: skip
    yield d
    d.terminate()


def local_path(daemon: DaemonProc, max_message: int = MAX_MESSAGE) -> str:
    with KVClient(daemon.zmq_address, colocated=True) as kv:
        info = kv.hello()
        assert kv.stats() and kv.is_local
    assert info["max_message_bytes"] == max_message
    return str(info["local_path"])


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param([1 << 60], id="one-frame-of-an-exbibyte"),
        pytest.param([MAX_MESSAGE + 1], id="one-frame-a-byte-over"),
        pytest.param([16] + [1 << 40] * 3, id="terabyte-frames"),
    ],
)
def test_a_reply_announcing_frames_over_max_message_bytes_is_refused_unreceived(
    daemon: DaemonProc, lengths: list[int]
) -> None:
    """InvalidArgument naming the bound, nothing large allocated (before: a bytearray of the
    announced size, 2**60: MemoryError; 1 TiB: MemoryError), and the link closed: the
    stand-in sees the client hang up."""
    fake = LyingLocal(local_path(daemon), framing(lengths))
    try:
        with KVClient(daemon.zmq_address, colocated=True) as kv:
            tracemalloc.start()
            try:
                with pytest.raises(InvalidArgument, match="max_message_bytes") as info:
                    kv.stats()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert info.value.context["max_frame_bytes"] == MAX_MESSAGE
            assert peak < 4 << 20, f"the client allocated {peak >> 20} MiB"
            assert fake.dropped.wait(30)
            assert not kv.is_local
    finally:
        fake.close()


def test_a_frame_over_max_message_bytes_beside_a_small_one_is_refused(
    daemon: DaemonProc,
) -> None:
    """Two frames within twice the bound, the second over it: received (the framing allows
    the sum), then refused with InvalidArgument as ZMQ's MAXMSGSIZE refuses such a frame."""
    lengths = [16, MAX_MESSAGE + 16]
    fake = LyingLocal(local_path(daemon), framing(lengths) + bytes(sum(lengths)))
    try:
        with KVClient(daemon.zmq_address, colocated=True) as kv:
            with pytest.raises(InvalidArgument, match="frame larger") as info:
                kv.stats()
            assert info.value.context["size"] == MAX_MESSAGE + 16
            assert fake.dropped.wait(30)
    finally:
        fake.close()


@pytest.fixture
def big_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "16MiB")  # 1 GiB messages
    yield d
    d.terminate()


def test_a_reply_announcing_more_than_arrives_costs_what_arrives_plus_a_step(
    big_daemon: DaemonProc,
) -> None:
    """A reply of one frame just under 1 GiB (the daemon's default max_message_bytes) of
    which 1 MiB comes before the daemon hangs up: Unavailable, and the client allocated at
    most about one 64 MiB step (twice that while the buffer grows), not 1 GiB (before: a
    zero-filled bytearray of the announced size)."""
    length = (1 << 30) - 64
    reply = framing([length]) + bytes(1 << 20)
    fake = LyingLocal(local_path(big_daemon, 1 << 30), reply, hang_up=True)
    try:
        with KVClient(big_daemon.zmq_address, colocated=True) as kv:
            tracemalloc.start()
            try:
                with pytest.raises(Unavailable, match="local channel"):
                    kv.stats()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 160 << 20, f"the client allocated {peak >> 20} MiB"
            assert not kv.is_local
    finally:
        fake.close()


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param([1 << 60], id="one-frame-of-an-exbibyte"),
        pytest.param([16] + [1 << 40] * 3, id="terabyte-frames"),
        pytest.param([16, MAX_MESSAGE + 16], id="a-frame-over-beside-a-small-one"),
    ],
)
async def test_the_async_client_refuses_them_unreceived_too(
    daemon: DaemonProc, lengths: list[int]
) -> None:
    """``AsyncKVClient``'s local link (``aio_transport.AioLocalLink.recv``) checks the same
    bound at the framing: InvalidArgument for the request, nothing large taken (before: its
    ``readexactly`` of the announced size buffered whatever came, up to it), the link closed
    and the client back on ZMQ for the next request."""
    from kvserver.client import AsyncKVClient

    fake = LyingLocal(local_path(daemon), framing(lengths))  # refused before the frames
    try:
        async with AsyncKVClient(daemon.zmq_address, colocated=True) as kv:
            tracemalloc.start()
            try:
                with pytest.raises(InvalidArgument, match="max_message_bytes") as info:
                    await kv.stats()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert info.value.context["max_frame_bytes"] == MAX_MESSAGE
            assert peak < 4 << 20, f"the client allocated {peak >> 20} MiB"
            assert fake.dropped.wait(30)
            assert not kv.is_local
    finally:
        fake.close()
