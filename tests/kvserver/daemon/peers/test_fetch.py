"""Daemon-to-daemon fetch: a real peer daemon process, this daemon's side in process.

The peer ("A") is a real ``kvserver start`` on loopback with ephemeral ports; chunks are stored
into it with the real client. The fetching side is the network tier's own classes over a real
storage engine ("B"), so the tests can look at B's DRAM directly. The fetch tests run over both
transports (``transport``): A's peer stream (learnt from its ``hello``) and ZMQ
(``PeerSettings(stream=False)``, as a daemon with CURVE fetches); ``test_stream.py`` has
the stream's own cases.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserver.client import KVClient
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import WINDOW_BYTES, PeerFetches, windows_of
from kvserver.daemon.peers.link import PeerFailed, PeerLink, check_rows
from kvserver.daemon.peers.place import FETCH_CLIENT
from kvserver.engine import StorageEngine
from kvserver.engine.types import EntryState
from kvserver.wire_stream import MAX_KEYS
from tests.kvserver.builders import make_engine, make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(tp_world_size=2)  # two parts per chunk, 4 KiB each


@pytest.fixture
def peer_a(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "a", "--dram", "8MiB")
    try:
        yield d
    finally:
        d.kill()


def store(daemon: DaemonProc, keys: list[bytes]) -> None:
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        kv.register_namespace(SPEC)
        parts = [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in keys]
        assert kv.put(SPEC.ns_id, keys, parts).stored == keys


@pytest.fixture(params=["stream", "zmq"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def settings(transport: str, **kw: Any) -> PeerSettings:
    return PeerSettings(stream=transport == "stream", **kw)


def engine_b() -> StorageEngine:
    engine = make_engine(num_pages=64)
    engine.register_namespace(SPEC)
    return engine


def held_bytes(engine: StorageEngine, keys: list[bytes]) -> list[list[bytes]]:
    grant = engine.prepare_load(SPEC.ns_id, keys)
    try:
        return [[b"".join(engine.read_part(grant.lease_id, k, r)) for r in range(2)] for k in keys]
    finally:
        engine.complete_load(grant.lease_id)


def expected(keys: list[bytes]) -> list[list[bytes]]:
    return [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in keys]


def peer_of(d: DaemonProc, host_id: str = "A") -> Peer:
    return Peer(host_id, "", d.zmq_address)


async def test_a_fetch_places_the_peers_chunks_in_dram_byte_for_byte(
    peer_a: DaemonProc, transport: str
) -> None:
    keys = make_keys(5)
    store(peer_a, keys)
    with engine_b() as engine:
        book = PeerBook(settings(transport, timeout_s=5))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        holders = frozenset({"A"})
        direct = await fetches.fetch(SPEC, [(k, holders) for k in keys], {"A": peer_of(peer_a)})
        assert direct == {}
        assert engine.lookup(SPEC.ns_id, keys) == 5
        assert held_bytes(engine, keys) == expected(keys)
        c = book.counters
        assert (c.fetches, c.fetched_chunks, c.placed_chunks) == (1, 5, 5)
        assert c.fetched_bytes == 5 * 2 * SPEC.part_bytes
        await book.close()


async def test_keys_the_peer_no_longer_holds_are_a_miss_and_the_rest_is_placed(
    peer_a: DaemonProc, transport: str
) -> None:
    keys = make_keys(5)
    store(peer_a, keys[:3])  # the directory says A holds all five: it lags
    with engine_b() as engine:
        book = PeerBook(settings(transport, timeout_s=5))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer_of(peer_a)})
        assert engine.lookup(SPEC.ns_id, keys) == 3
        assert held_bytes(engine, keys[:3]) == expected(keys[:3])
        assert book.counters.missed_chunks == 2
        assert not book.is_suspect("A")  # it answered correctly: not its fault
        # over the stream the window's pages were reserved for all five before the reply
        # came: the two it did not bring are given back (no WRITING entry, no lease left)
        engine.check_invariants()
        assert not [e for e in engine.entries().values() if e.state is EntryState.WRITING]
        assert not [lease for lease in engine.leases if lease.client == FETCH_CLIENT]
        await book.close()


async def test_a_dead_peer_is_a_bounded_miss_and_becomes_suspect(
    peer_a: DaemonProc, transport: str
) -> None:
    keys = make_keys(3)
    store(peer_a, keys)
    peer_a.kill()
    with engine_b() as engine:
        book = PeerBook(settings(transport, timeout_s=1.0, suspect_s=60))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        start = time.monotonic()
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer_of(peer_a)})
        assert time.monotonic() - start < 5.0  # one timeout, bounded
        assert engine.lookup(SPEC.ns_id, keys) == 0
        assert book.is_suspect("A")
        assert book.counters.timeouts == 1
        # a suspect peer is not asked again: no second timeout (asked, it would wait 1 s)
        start = time.monotonic()
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer_of(peer_a)})
        assert time.monotonic() - start < 1.0
        assert book.counters.fetches == 1 and book.counters.timeouts == 1
        await book.close()


async def test_concurrent_loads_of_the_same_keys_fetch_them_once(
    peer_a: DaemonProc, transport: str
) -> None:
    keys = make_keys(4)
    store(peer_a, keys)
    with engine_b() as engine:
        book = PeerBook(settings(transport, timeout_s=5))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        wanted = [(k, frozenset({"A"})) for k in keys]
        peers = {"A": peer_of(peer_a)}
        await asyncio.gather(*(fetches.fetch(SPEC, wanted, peers) for _ in range(3)))
        assert book.counters.fetches == 1
        assert book.counters.joined_chunks == 8
        assert held_bytes(engine, keys) == expected(keys)
        assert fetches.num_in_flight == 0
        await book.close()


async def test_a_second_holder_is_asked_for_what_the_first_did_not_send(
    tmp_path: Path, peer_a: DaemonProc, transport: str
) -> None:
    keys = make_keys(4)
    store(peer_a, keys[:2])
    c = start_daemon(tmp_path / "c", "--dram", "8MiB")
    try:
        store(c, keys)
        with engine_b() as engine:
            book = PeerBook(settings(transport, timeout_s=5))
            fetches = PeerFetches(engine, book, publish=lambda: None)
            both = frozenset({"A", "C"})
            only_a = {"A": peer_of(peer_a), "C": peer_of(c, "C")}
            # A is preferred for every key (sorted first among equals): it sends two
            await fetches.fetch(SPEC, [(k, both) for k in keys], only_a)
            assert held_bytes(engine, keys) == expected(keys)
            assert book.counters.fetches == 2
            assert book.counters.missed_chunks == 0
            await book.close()
    finally:
        c.kill()


async def test_dram_that_cannot_take_the_chunks_hands_them_back_for_a_direct_send(
    peer_a: DaemonProc, transport: str
) -> None:
    keys = make_keys(2)
    store(peer_a, keys)
    with make_engine(num_pages=2) as engine:  # room for one chunk (2 parts of one page)
        engine.register_namespace(SPEC)
        filler = make_keys(1, tag="filler")
        grant = engine.prepare_store(SPEC.ns_id, filler)
        assert grant is not None  # reserved, never completed: DRAM is full and unevictable
        book = PeerBook(settings(transport, timeout_s=5))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        wanted = [(k, frozenset({"A"})) for k in keys]
        direct = await fetches.fetch(SPEC, wanted, {"A": peer_of(peer_a)}, direct=True)
        assert sorted(direct) == sorted(keys)
        assert [[bytes(p) for p in direct[k]] for k in keys] == expected(keys)
        assert engine.lookup(SPEC.ns_id, keys) == 0
        await book.close()


async def test_leading_get_and_local_lookup_answer_the_run_the_peer_holds(
    peer_a: DaemonProc,
) -> None:
    keys = make_keys(4)
    store(peer_a, keys[:2] + keys[3:])  # a hole at key 2
    link = PeerLink(peer_of(peer_a), timeout_s=5)
    try:
        rows = await link.fetch(SPEC, keys)
        assert [[bytes(p) for p in row] for row in rows] == expected(keys[:2])
        assert await link.lookup(SPEC.ns_id, keys) == 2
        other = make_spec(model="never/registered")
        assert await link.fetch(other, keys) == []
        assert await link.lookup(other.ns_id, keys) == 0
    finally:
        await link.close()


def test_rows_of_the_wrong_number_or_size_are_refused() -> None:
    keys = make_keys(2)
    peer = Peer("A", "", "tcp://127.0.0.1:1")
    good = [memoryview(b"x" * SPEC.part_bytes)] * 2
    check_rows(SPEC, keys, [good, good], peer)
    bad_rows = [
        [good, good, good],  # more rows than keys
        [good[:1]],  # a rank missing
        [[good[0], memoryview(b"x" * (SPEC.part_bytes - 1))]],  # a short part
    ]
    for rows in bad_rows:
        with pytest.raises(PeerFailed) as info:
            check_rows(SPEC, keys, rows, peer)
        assert not info.value.timed_out


def test_windows_are_cut_by_bytes_and_by_the_keys_a_stream_request_may_name() -> None:
    """A window holds at most ``window_bytes`` of chunks (at least one chunk), and never more
    keys than a peer stream request may name (wire_stream.MAX_KEYS: a 1 GiB window of 4 KiB
    chunks would be 262144), each run cut on its own."""
    runs = [make_keys(10, tag="x"), make_keys(3, tag="y")]
    sizes = [len(w) for w in windows_of(runs, 1 << 10, 4 << 10)]
    assert sizes == [4, 4, 2, 3]
    assert [len(w) for w in windows_of(runs, 1 << 20, 1 << 10)] == [1] * 13  # a chunk each
    assert [len(w) for w in windows_of(runs, 1, 1 << 20, max_keys=4)] == [4, 4, 2, 3]
    many = [[i.to_bytes(4, "big") for i in range(MAX_KEYS + 5)]]
    assert [len(w) for w in windows_of(many, 4 << 10, 1 << 30)] == [MAX_KEYS, 5]
    assert [k for w in windows_of(many, 4 << 10, 1 << 30) for k in w] == many[0]


async def test_a_peers_windows_are_pipelined_on_one_connection(
    tmp_path: Path, transport: str
) -> None:
    """Twelve 1 MiB chunks are three windows of WINDOW_BYTES, asked at once on one connection
    (their replies arrive in order: over ZMQ each copied while the next is on the wire, over
    the stream each received into its pages); every byte is placed and the connection is kept
    for the next fetch."""
    spec = make_spec(model="test/windows", part_bytes_override=1 << 20)
    a = start_daemon(tmp_path / "a", "--dram", "32MiB")
    try:
        keys = make_keys(12, tag="win")
        data = [pattern(k, 0, spec.part_bytes) for k in keys]
        with KVClient(a.zmq_address, colocated=False) as kv:
            kv.register_namespace(spec)
            assert kv.put(spec.ns_id, keys, data).stored == keys
        assert 12 * spec.part_bytes == 3 * WINDOW_BYTES
        with make_engine(num_pages=16, page_size=1 << 20) as engine:  # 16 MiB
            engine.register_namespace(spec)
            book = PeerBook(settings(transport, timeout_s=10))
            # the stream's windows of WINDOW_BYTES too: three of them
            fetches = PeerFetches(engine, book, publish=lambda: None,
                                  stream_window_bytes=WINDOW_BYTES)  # fmt: skip
            peer = peer_of(a)
            await fetches.fetch(spec, [(k, frozenset({"A"})) for k in keys], {"A": peer})
            assert book.counters.fetches == 3 and book.counters.placed_chunks == 12
            link = book.link(peer)
            assert link.connections_open == 1  # ZMQ: the windows'; stream: its hello's
            stream = await link.stream()
            if transport == "stream":
                assert stream is not None and stream.connections_open == 1
                assert book.counters.stream_fetches == 3
            else:
                assert stream is None and book.counters.stream_fetches == 0
            grant = engine.prepare_load(spec.ns_id, keys)
            got = [b"".join(engine.read_part(grant.lease_id, k, 0)) for k in keys]
            engine.complete_load(grant.lease_id)
            assert got == data
            engine.check_invariants()
            await book.close()
    finally:
        a.kill()


async def test_a_fetchs_later_windows_do_not_evict_its_earlier_ones(
    tmp_path: Path, transport: str
) -> None:
    """B's DRAM (16 MiB, LRU) is full of other chunks, which other loads read between the
    fetch's windows (here: whenever a window is placed, the ``publish`` hook), so that a
    placed window is the least recently used; a fetch of twelve 1 MiB chunks comes in three
    windows, each of which must evict to be placed: the evictions take the other chunks,
    never a window the same fetch placed before (the load needs them all), so all twelve are
    held after it, byte for byte."""
    spec = make_spec(model="test/keep", part_bytes_override=1 << 20)
    a = start_daemon(tmp_path / "a", "--dram", "32MiB")
    try:
        keys = make_keys(12, tag="keep")
        data = [pattern(k, 0, spec.part_bytes) for k in keys]
        with KVClient(a.zmq_address, colocated=False) as kv:
            kv.register_namespace(spec)
            assert kv.put(spec.ns_id, keys, data).stored == keys
        with make_engine(num_pages=16, page_size=1 << 20) as engine:
            engine.register_namespace(spec)
            others = make_keys(16, tag="other")
            grant = engine.prepare_store(spec.ns_id, others)
            assert grant is not None and len(grant.keys) == 16  # DRAM full
            engine.complete_store(grant.lease_id)

            def read_others() -> None:  # another request's load, between two windows
                held = [k for k in others if engine.contains(spec.ns_id, k)]
                if held:
                    engine.complete_load(engine.prepare_load(spec.ns_id, held).lease_id)

            book = PeerBook(settings(transport, timeout_s=10))
            fetches = PeerFetches(engine, book, publish=read_others,
                                  stream_window_bytes=WINDOW_BYTES)  # fmt: skip
            await fetches.fetch(spec, [(k, frozenset({"A"})) for k in keys], {"A": peer_of(a)})
            assert book.counters.fetches == 3 and book.counters.placed_chunks == 12
            assert engine.lookup(spec.ns_id, keys) == 12
            loaded = engine.prepare_load(spec.ns_id, keys)
            got = [b"".join(engine.read_part(loaded.lease_id, k, 0)) for k in keys]
            engine.complete_load(loaded.lease_id)
            assert got == data
            engine.check_invariants()
            await book.close()
    finally:
        a.kill()


async def test_a_long_fetchs_placement_work_is_linear_in_its_keys(
    peer_a: DaemonProc, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch of 48 chunks in 48 windows of one chunk: the keys the engine is handed to place
    them (``prepare_store``'s keys, ``missing``'s) stay within a few per chunk fetched. Before,
    each window's placement handed the engine every key placed before it in the fetch (its
    protection from the eviction), then filtered them with ``missing``: 48 windows cost
    ~48 * 48 = 2,300 keys, a fetch of n windows ~n * n; now each window names its own keys and
    the fetch's protected keys go as one set the eviction consults (48 + 48 here)."""
    import kvserver.daemon.peers.fetch as fetch_module

    keys = make_keys(48, tag="linear")
    store(peer_a, keys)
    chunk = SPEC.part_bytes * SPEC.tp_world_size
    monkeypatch.setattr(fetch_module, "WINDOW_BYTES", chunk)  # ZMQ: one chunk a window
    with make_engine(num_pages=128) as engine:
        engine.register_namespace(SPEC)
        handed = 0
        real_prepare, real_missing = engine.prepare_store, engine.missing

        def prepare_store(ns_id: str, ks: list[bytes], **kw: Any) -> Any:
            nonlocal handed
            handed += len(ks)
            return real_prepare(ns_id, ks, **kw)

        def missing(ns_id: str, ks: Any) -> list[bytes]:
            nonlocal handed
            ks = list(ks)
            handed += len(ks)
            return real_missing(ns_id, ks)

        monkeypatch.setattr(engine, "prepare_store", prepare_store)
        monkeypatch.setattr(engine, "missing", missing)
        book = PeerBook(settings(transport, timeout_s=10))
        fetches = PeerFetches(engine, book, publish=lambda: None, stream_window_bytes=chunk)
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer_of(peer_a)})
        assert book.counters.fetches == 48 and book.counters.placed_chunks == 48
        assert held_bytes(engine, keys) == expected(keys)
        assert handed <= 3 * len(keys), handed
        engine.check_invariants()
        await book.close()
