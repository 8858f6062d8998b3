"""A stream window's leading chunks made ready while its last ones are still on the wire
(``StreamConnection.start_reply(early=)``, ``Placer.complete_early``,
``fetch.EARLY_TAIL_BYTES``).

The serving side is a real ``kvserver start`` on loopback, or, for a reply cut off or stalled
right after its leading chunks (which a real daemon cannot do on demand), a stand-in server
on a raw socket; the fetching side is the network tier's own classes over a real storage
engine, as in ``test_stream.py``. The tail is made small here (a few chunks of 8 KiB) so that
windows of a few dozen chunks have a leading part.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver import wire_stream
from kvserver.daemon.peers import fetch
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.stream_connection import StreamConnection
from kvserver.events import BlockStored
from tests.kvserver.builders import make_keys, pattern
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, expected, held_bytes, store
from tests.kvserver.daemon.peers.test_stream import (
    Behaviour,
    fetcher,
    no_reservations,
    recorded_peer,
    serve_standin,
)
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

CHUNK = SPEC.tp_world_size * SPEC.part_bytes
TAIL = 4  # chunks completed after a window's last byte in these tests
N = 24  # chunks fetched: 20 made ready early, then 4


@pytest.fixture(autouse=True)
def small_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "EARLY_TAIL_BYTES", TAIL * CHUNK)


@pytest.fixture
def peer_a(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "a", "--dram", "8MiB")
    try:
        yield d
    finally:
        d.kill()


def stored_batches(events: list[object]) -> list[int]:
    return [len(e.keys) for e in events if isinstance(e, BlockStored)]


async def test_a_windows_leading_chunks_are_ready_before_its_tail_and_all_read_back(
    peer_a: DaemonProc,
) -> None:
    keys = make_keys(N, tag="early")
    store(peer_a, keys)
    with engine_b() as engine:
        fetches, book = fetcher(engine)
        engine.take_events()
        peers = {"A": recorded_peer(peer_a)}
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], peers)
        assert held_bytes(engine, keys) == expected(keys)
        # two completions: the leading 20 while the last 4 were on the wire, then those 4
        assert stored_batches(engine.take_events()) == [N - TAIL, TAIL]
        c = book.counters
        assert (c.stream_fetches, c.placed_chunks, c.missed_chunks) == (1, N, 0)
        no_reservations(engine)
        await book.close()


async def test_a_window_no_longer_than_its_tail_is_completed_once(peer_a: DaemonProc) -> None:
    keys = make_keys(TAIL, tag="early-short")
    store(peer_a, keys)
    with engine_b() as engine:
        fetches, book = fetcher(engine)
        engine.take_events()
        peers = {"A": recorded_peer(peer_a)}
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], peers)
        assert held_bytes(engine, keys) == expected(keys)
        assert stored_batches(engine.take_events()) == [TAIL]
        no_reservations(engine)
        await book.close()


def leading_then(end: str) -> Behaviour:
    """A peer that announces the whole window, sends its leading chunks whole (the right
    bytes), one part of the next, then closes (``end="close"``) or stalls (``"stall"``)."""

    async def behave(writer: asyncio.StreamWriter, req: wire_stream.FetchRequest) -> None:
        writer.write(wire_stream.encode_ok(req.request_id, len(req.keys), 2, SPEC.part_bytes))
        for key in req.keys[: len(req.keys) - TAIL]:
            writer.write(pattern(key, 0, SPEC.part_bytes) + pattern(key, 1, SPEC.part_bytes))
        writer.write(b"x" * SPEC.part_bytes)
        await writer.drain()
        if end == "stall":
            await asyncio.sleep(30)  # a host gone: the timeout ends it

    return behave


@pytest.mark.parametrize("end", ["close", "stall"])
async def test_a_peer_lost_in_the_tail_leaves_the_leading_chunks_placed_and_the_rest_missed(
    end: str,
) -> None:
    """The leading chunks arrived whole and were made ready: they stay (the right bytes,
    counted as sent, not missed); the tail's chunks miss, the peer is suspect, nothing stays
    reserved."""
    server, address = await serve_standin(leading_then(end))
    async with server:
        keys = make_keys(N, tag=f"early-{end}")
        with engine_b() as engine:
            fetches, book = fetcher(engine, timeout_s=0.5, suspect_s=60)
            peer = Peer("F", "", "tcp://127.0.0.1:1", address)
            start = time.monotonic()
            await fetches.fetch(SPEC, [(k, frozenset({"F"})) for k in keys], {"F": peer})
            assert time.monotonic() - start < 2.0
            lead = keys[: N - TAIL]
            assert engine.lookup(SPEC.ns_id, keys) == N - TAIL
            assert held_bytes(engine, lead) == expected(lead)
            c = book.counters
            assert (c.placed_chunks, c.missed_chunks) == (N - TAIL, TAIL)
            assert book.is_suspect("F")
            no_reservations(engine)
            await book.close()


@pytest.mark.parametrize(("count", "calls"), [(3, [2]), (2, []), (1, [])])
async def test_on_early_runs_once_the_leading_chunks_are_in_and_before_the_result(
    count: int, calls: list[int]
) -> None:
    """A reply of ``count`` chunks, ``early=2``: ``on_early(2)`` only when it brings more than
    2, with those 2 chunks' bytes already in their views, before the job's result."""
    ours, theirs = socket.socketpair()
    try:
        conn = StreamConnection(ours, Peer("F", "", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1"))
        rows = [[memoryview(bytearray(SPEC.part_bytes))] for _ in range(3)]
        seen: list[tuple[int, list[bytes]]] = []

        def on_early(n: int) -> None:
            seen.append((n, [bytes(row[0]) for row in rows[:n]]))

        job = conn.start_reply(1, rows, 1, SPEC.part_bytes, time.monotonic() + 5,
                               lambda head: None, early=2, on_early=on_early)  # fmt: skip
        theirs.sendall(wire_stream.encode_ok(1, count, 1, SPEC.part_bytes))
        for i in range(count):
            theirs.sendall(bytes([i + 1]) * SPEC.part_bytes)
        head, error = await job.result()
        assert error is None and head.count == count
        assert [n for n, _ in seen] == calls
        for n, got in seen:
            assert got == [bytes([i + 1]) * SPEC.part_bytes for i in range(n)]
        assert [bytes(row[0]) for row in rows[:count]] == [
            bytes([i + 1]) * SPEC.part_bytes for i in range(count)
        ]
    finally:
        ours.close()
        theirs.close()
