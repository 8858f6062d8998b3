"""A peer whose every connection is busy with this daemon's other fetches is not suspect: the
wait for a connection of our own is this daemon's congestion, not the peer failing.

A real peer daemon ("A"), the fetching side in process (as in ``test_fetch.py``), over both
transports; the other fetches are stood in for by holding the link's one connection."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvserver.daemon.peers.book import PeerBook
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.daemon.peers.link import PeerLink
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import (
    SPEC,
    engine_b,
    expected,
    held_bytes,
    peer_of,
    settings,
    store,
)
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def peer_a(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "a", "--dram", "8MiB")
    try:
        yield d
    finally:
        d.kill()


@contextlib.asynccontextmanager
async def busy(link: PeerLink, transport: str) -> AsyncIterator[None]:
    """The link's connections all taken (by another fetch, in the daemon)."""
    if transport == "stream":
        stream = await link.stream()
        assert stream is not None
        async with stream.connection():
            yield
    else:
        async with link.connection():
            yield


@pytest.mark.parametrize("transport", ["stream", "zmq"])
async def test_a_peer_whose_connections_are_all_busy_is_not_suspect(
    peer_a: DaemonProc, transport: str
) -> None:
    """Every connection to A is in use by another fetch past the peer timeout: this fetch
    gives up (its keys miss, nothing reserved) but A stays usable, and the next fetch, once
    a connection is free, brings every chunk. (A was suspect for 10 s: every load missed
    A's chunks meanwhile, though A was answering the fetches under way.)"""
    keys = make_keys(4)
    store(peer_a, keys)
    with engine_b() as engine:
        # 2 s: the second fetch must complete on a loaded machine too
        book = PeerBook(settings(transport, timeout_s=2.0, connections=1))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peers = {"A": peer_of(peer_a)}
        wanted = [(k, frozenset({"A"})) for k in keys]
        try:
            async with busy(book.link(peers["A"]), transport):
                await fetches.fetch(SPEC, wanted, peers)
                assert engine.lookup(SPEC.ns_id, keys) == 0
                engine.check_invariants()
            assert not book.is_suspect("A")
            assert (book.counters.timeouts, book.counters.failures) == (0, 0)
            await fetches.fetch(SPEC, wanted, peers)
            assert held_bytes(engine, keys) == expected(keys)
        finally:
            await book.close()
