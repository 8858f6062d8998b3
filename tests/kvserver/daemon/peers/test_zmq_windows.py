"""A fetch's windows over ZMQ under the peer's cap on unsent replies (``zmq_windows.py``).

The peer ("A") is a real daemon on loopback; the fetching side is the network tier's own
classes over a real storage engine ("B"), over ZMQ (``PeerSettings(stream=False)``, as a
daemon with CURVE fetches). A's refusals are read from its own ``stats`` (``zmq_sends``).
Where a refusal must happen on cue (a real one depends on when A's loop hears that a reply
was sent), the link's ``fetch`` is wrapped to answer ``capacity`` instead of asking A.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserver.client import KVClient
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import WINDOW_BYTES, PeerFetches
from kvserver.daemon.peers.link import PeerLink
from kvserver.engine import StorageEngine
from kvserver.errors import CapacityError
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_engine, make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20
SPEC = make_spec(model="test/zmq-windows", part_bytes_override=MiB)  # a 1 MiB chunk
PER_WINDOW = WINDOW_BYTES // MiB


@pytest.fixture
def peer_a(tmp_path: Path) -> Iterator[DaemonProc]:
    """128 MiB of DRAM: its cap on a connection's unsent replies is 32 MiB (a quarter)."""
    d = start_daemon(tmp_path / "a", "--dram", "128MiB")
    try:
        yield d
    finally:
        d.kill()


def store(daemon: DaemonProc, keys: list[bytes]) -> None:
    with KVClient(daemon.zmq_address, colocated=False, timeout=30) as kv:
        kv.register_namespace(SPEC)
        for i in range(0, len(keys), 8):
            run = keys[i : i + 8]
            assert kv.put(SPEC.ns_id, run, [pattern(k, 0, MiB) for k in run]).stored == run


def refused_by(daemon: DaemonProc) -> int:
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        return int(kv.stats()["zmq_sends"]["refused"])


def held(engine: StorageEngine, keys: list[bytes]) -> list[bytes]:
    grant = engine.prepare_load(SPEC.ns_id, keys)
    try:
        return [b"".join(engine.read_part(grant.lease_id, k, 0)) for k in keys]
    finally:
        engine.complete_load(grant.lease_id)


def engine_b() -> StorageEngine:
    engine = make_engine(num_pages=64, page_size=MiB)  # 64 MiB
    engine.register_namespace(SPEC)
    return engine


class Watched:
    """Wraps ``link.fetch``: records each window's first key and the windows in flight as it
    starts (``starts``; ``most`` of them) and answers ``capacity`` (as ``zmq_send.py`` words
    it) to the windows ``refuse`` names (by first key) without asking the peer, as often as
    listed."""

    def __init__(self, link: PeerLink, refuse: list[bytes] | None = None) -> None:
        self.in_flight = self.most = self.refused = 0
        self.starts: list[tuple[bytes, int]] = []
        self._refuse = list(refuse or [])
        self._fetch: Callable[..., Awaitable[Any]] = link.fetch
        link.fetch = self  # type: ignore[method-assign,assignment]

    async def __call__(self, spec: NamespaceSpec, keys: list[bytes], **kw: Any) -> Any:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.starts.append((keys[0], self.in_flight))
        try:
            if keys[0] in self._refuse:
                self._refuse.remove(keys[0])
                self.refused += 1
                raise CapacityError(
                    "too many reply bytes to this connection not sent yet", zmq_send_max_unsent=MiB
                )  # as zmq_send.py words it
            return await self._fetch(spec, keys, **kw)
        finally:
            self.in_flight -= 1


async def test_a_fetch_larger_than_the_peers_cap_is_never_refused(peer_a: DaemonProc) -> None:
    """48 MiB from a peer whose cap on one connection's unsent replies is 32 MiB (its
    hello says so): twelve windows of 4 MiB, four in flight at once (half the cap), none
    refused by A (all twelve asked at once, A refused the ones past its cap every time:
    4, 4, 5 of 12 in 3 runs before), every byte placed."""
    keys = make_keys(48, tag="cap")
    store(peer_a, keys)
    refused = refused_by(peer_a)
    with engine_b() as engine:
        book = PeerBook(PeerSettings(stream=False, timeout_s=10))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("A", "", peer_a.zmq_address)
        watched = Watched(book.link(peer))
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
        assert refused_by(peer_a) - refused == 0
        assert book.counters.refused_windows == 0
        assert watched.most == 4 == 32 * MiB // (2 * WINDOW_BYTES)
        assert book.counters.fetches == 48 // PER_WINDOW
        assert book.counters.placed_chunks == 48
        assert held(engine, keys) == [pattern(k, 0, MiB) for k in keys]
        engine.check_invariants()
        await book.close()


async def test_a_refused_window_is_asked_again_and_then_one_window_at_a_time(
    peer_a: DaemonProc,
) -> None:
    """A peer refuses the second window all the same (its releases lagging more than the
    slack): it is counted, asked again once the windows in flight have arrived, the rest of
    the fetch asks one window at a time and the link's later fetches one fewer than the four
    it had in flight; the peer is not suspect and every byte is placed."""
    keys = make_keys(24, tag="again")
    store(peer_a, keys)
    with engine_b() as engine:
        book = PeerBook(PeerSettings(stream=False, timeout_s=10))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("A", "", peer_a.zmq_address)
        link = book.link(peer)
        watched = Watched(link, refuse=[keys[PER_WINDOW]])
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
        assert watched.refused == book.counters.refused_windows == 1
        assert await link.windows_in_flight(WINDOW_BYTES) == 3
        firsts = [k for k, _ in watched.starts]
        again = firsts.index(keys[PER_WINDOW], firsts.index(keys[PER_WINDOW]) + 1)
        assert [n for _, n in watched.starts[again:]] == [1] * (len(firsts) - again)
        assert not book.is_suspect("A")
        assert book.counters.fetches == 24 // PER_WINDOW  # a refused window is not a fetch
        assert book.counters.placed_chunks == 24 and book.counters.missed_chunks == 0
        assert held(engine, keys) == [pattern(k, 0, MiB) for k in keys]
        assert link.connections_open == 1  # kept: a refusal is a clean answer
        engine.check_invariants()
        await book.close()


async def test_a_window_refused_twice_is_a_miss_and_the_rest_is_placed(
    peer_a: DaemonProc,
) -> None:
    """Refused again when asked again, a window is not sent (another holder, else a miss):
    its keys are missed, the other windows' placed byte for byte, nothing left reserved."""
    keys = make_keys(12, tag="twice")
    store(peer_a, keys)
    with engine_b() as engine:
        book = PeerBook(PeerSettings(stream=False, timeout_s=10))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("A", "", peer_a.zmq_address)
        watched = Watched(book.link(peer), refuse=[keys[PER_WINDOW]] * 2)
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
        assert watched.refused == book.counters.refused_windows == 2
        refused = keys[PER_WINDOW : 2 * PER_WINDOW]
        assert book.counters.missed_chunks == len(refused)
        rest = [k for k in keys if k not in refused]
        assert engine.lookup(SPEC.ns_id, refused) == 0
        assert held(engine, rest) == [pattern(k, 0, MiB) for k in rest]
        assert fetches.num_in_flight == 0
        engine.check_invariants()
        await book.close()


async def test_a_peer_stopped_mid_fetch_costs_one_timeout_not_one_per_window(
    peer_a: DaemonProc,
) -> None:
    """A peer that stops answering (SIGSTOP: its sockets stay open) in a twelve-window fetch:
    the four windows in flight time out (four timeouts counted; twelve before, every window
    asked at once), the windows after them are not asked (the peer is suspect: their keys
    miss), and the fetch ends within about one peer timeout (2 s: three rounds of windows,
    each waiting for its timeout, would take 6 s)."""
    keys = make_keys(48, tag="stop")
    store(peer_a, keys)
    with engine_b() as engine:
        book = PeerBook(PeerSettings(stream=False, timeout_s=2.0, suspect_s=60))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("A", "", peer_a.zmq_address)
        assert await book.link(peer).windows_in_flight(WINDOW_BYTES) == 4  # A up, cap known
        peer_a.proc.send_signal(19)  # SIGSTOP
        try:
            start = time.monotonic()
            await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
            took = time.monotonic() - start
        finally:
            peer_a.proc.send_signal(18)  # SIGCONT
        assert took < 5.0  # a loaded machine's slack, short of a second round of timeouts
        assert book.is_suspect("A")
        assert book.counters.timeouts == 4  # the windows in flight
        assert book.counters.missed_chunks == 48
        assert engine.lookup(SPEC.ns_id, keys) == 0 and fetches.num_in_flight == 0
        engine.check_invariants()
        await book.close()


async def test_an_older_peer_that_announces_no_cap_gets_two_windows_in_flight(
    tmp_path: Path,
) -> None:
    """A peer whose ``hello`` does not announce ``zmq_send_max_unsent`` (before session 11;
    here the real daemon with that field dropped) is asked two windows at a time: it refuses
    none (its cap, 32 MiB, is well over two windows) and every byte is placed."""
    a = start_daemon(tmp_path / "a", "--dram", "128MiB", module="tests.support.older_peer")
    try:
        with KVClient(a.zmq_address, colocated=False) as kv:
            assert "zmq_send_max_unsent" not in kv.hello()
        keys = make_keys(24, tag="older")
        store(a, keys)
        refused = refused_by(a)
        with engine_b() as engine:
            book = PeerBook(PeerSettings(stream=False, timeout_s=10))
            fetches = PeerFetches(engine, book, publish=lambda: None)
            peer = Peer("A", "", a.zmq_address)
            watched = Watched(book.link(peer))
            await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
            assert await book.link(peer).windows_in_flight(WINDOW_BYTES) == 2 == watched.most
            assert refused_by(a) == refused and book.counters.refused_windows == 0
            assert held(engine, keys) == [pattern(k, 0, MiB) for k in keys]
            await book.close()
    finally:
        a.kill()


async def test_a_fetch_cancelled_with_windows_in_flight_leaves_nothing_running(
    peer_a: DaemonProc,
) -> None:
    """A fetch cancelled once its first window is placed (the next ones in flight): no call
    of it is left running, its connection is closed, not kept (a late reply must not be taken
    for another call's), no key stays claimed, and the next fetch brings every byte."""
    keys = make_keys(48, tag="cancel")
    store(peer_a, keys)
    with engine_b() as engine:
        book = PeerBook(PeerSettings(stream=False, timeout_s=10))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("A", "", peer_a.zmq_address)
        link = book.link(peer)
        watched = Watched(link)
        wanted = [(k, frozenset({"A"})) for k in keys]
        task = asyncio.ensure_future(fetches.fetch(SPEC, wanted, {"A": peer}))
        # a window placed and another's call on the connection: cancelled with no call on it
        # (between a window's end and the next one's first step, a narrow moment that a
        # loaded host hits) the connection is rightly kept for reuse
        while book.counters.placed_chunks == 0 or watched.in_flight == 0:
            assert not task.done()
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert watched.in_flight == 0 and fetches.num_in_flight == 0
        assert link.connections_open == 0  # the windows' one (the hello's, reused): closed
        engine.check_invariants()
        await fetches.fetch(SPEC, wanted, {"A": peer})
        assert held(engine, keys) == [pattern(k, 0, MiB) for k in keys]
        await book.close()
