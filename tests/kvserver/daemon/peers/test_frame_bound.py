"""What a peer can make the fetching daemon receive over ZMQ is bounded: a reply frame
announced larger than ``PeerSettings.max_frame_bytes`` (the daemon's ``max_message_bytes``)
is refused at its length prefix, before its bytes are received; the fetch fails at once, the
peer is suspect, nothing is placed or left reserved.

A real daemon never sends such a frame, so the peer is a stand-in speaking ZMTP 3.0 on a raw
socket: it can announce a frame of any length and send only its first bytes. Fetches from a
real daemon under a tight bound still work.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, expected, held_bytes, store
from tests.kvserver.daemon.peers.test_stream import no_reservations
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

BOUND = 1 << 20
#: the frame the stand-in announces: past BOUND, small enough for ZMQ to allocate at once.
ANNOUNCED = 64 << 20


def greeting() -> bytes:
    """ZMTP 3.0, NULL mechanism, as the server."""
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)


def ready(socket_type: bytes) -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes([0x04, len(body)]) + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One ZMTP frame: (flags, body)."""
    flags = (await reader.readexactly(1))[0]
    if flags & 0x02:
        (size,) = struct.unpack(">Q", await reader.readexactly(8))
    else:
        size = (await reader.readexactly(1))[0]
    return flags, await reader.readexactly(size)


class OversizedPeer:
    """A ROUTER stand-in: answers the first request with a frame announced ANNOUNCED bytes
    long, sends 4 KiB of it and waits; records how long after the announcement the fetching
    side closed the connection."""

    def __init__(self) -> None:
        self.closed_after: float | None = None
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(greeting() + ready(b"ROUTER"))
            await reader.readexactly(64)  # its greeting
            flags, _ = await read_frame(reader)  # its READY
            assert flags & 0x04
            while (await read_frame(reader))[0] & 0x01:  # a request, to its last frame
                pass
            writer.write(b"\x02" + struct.pack(">Q", ANNOUNCED) + bytes(4096))
            await writer.drain()
            announced = time.monotonic()
            while await reader.read(65536):
                pass
            self.closed_after = time.monotonic() - announced
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def test_a_reply_frame_over_the_bound_is_refused_before_its_bytes_come() -> None:
    fake = OversizedPeer()
    address = await fake.start()
    assert fake.server is not None
    async with fake.server:
        keys = make_keys(4, tag="oversized")
        with engine_b() as engine:
            settings = PeerSettings(timeout_s=10.0, suspect_s=60, max_frame_bytes=BOUND)
            book = PeerBook(settings)
            fetches = PeerFetches(engine, book, publish=lambda: None)
            start = time.monotonic()
            peer = Peer("F", "", address)  # no record: its hello is asked over ZMQ
            await fetches.fetch(SPEC, [(k, frozenset({"F"})) for k in keys], {"F": peer})
            # at once, not at the peer timeout (10 s) that a frame still coming would take
            assert time.monotonic() - start < 5.0
            assert fake.closed_after is not None and fake.closed_after < 5.0
            assert engine.lookup(SPEC.ns_id, keys) == 0
            assert book.counters.missed_chunks == 4 and book.is_suspect("F")
            no_reservations(engine)
            assert book.link(peer).connections_open == 0  # its socket closed, none leaked
            await book.close()


@pytest.fixture
def peer_a(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "a", "--dram", "8MiB", "--peer-stream-port", "-1")
    try:
        yield d
    finally:
        d.kill()


async def test_a_fetch_over_zmq_under_a_bound_above_its_frames_places_the_chunks(
    peer_a: DaemonProc,
) -> None:
    keys = make_keys(5, tag="bounded")
    store(peer_a, keys)
    with engine_b() as engine:
        book = PeerBook(PeerSettings(timeout_s=5, max_frame_bytes=SPEC.part_bytes + 4096))
        # the bound is per frame (libzmq's MAXMSGSIZE): the reply's frames together exceed it
        assert len(keys) * SPEC.part_bytes > book.settings.max_frame_bytes
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("A", "", peer_a.zmq_address)
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
        assert held_bytes(engine, keys) == expected(keys)
        assert book.counters.stream_fetches == 0 and not book.is_suspect("A")
        await book.close()
