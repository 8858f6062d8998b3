"""The directory of a configured peer list: real peer daemons asked with a local lookup."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.static import StaticDirectory
from kvserver.daemon.peers.tier import HOLDERS_TTL_S, PeerTier
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, expected, held_bytes, store
from tests.support.daemon import start_daemon

pytestmark = pytest.mark.multiprocess


async def test_holders_are_the_peers_whose_leading_run_covers_each_key(tmp_path: Path) -> None:
    keys = make_keys(5)
    a = start_daemon(tmp_path / "a", "--dram", "8MiB")
    c = start_daemon(tmp_path / "c", "--dram", "8MiB")
    try:
        store(a, keys[:2])
        store(c, keys[:4])
        # 2 s: the lookups of the live peers must answer on a loaded machine too
        book = PeerBook(PeerSettings(timeout_s=2.0, suspect_s=60))
        directory = StaticDirectory([a.zmq_address, c.zmq_address], book)
        assert set(directory.peers()) == {a.zmq_address, c.zmq_address}
        both, only_c = frozenset({a.zmq_address, c.zmq_address}), frozenset({c.zmq_address})

        assert await directory.holders(SPEC.ns_id, keys) == [both, both, only_c, only_c]
        a.kill()
        start = time.monotonic()
        assert await directory.holders(SPEC.ns_id, keys) == [only_c] * 4
        assert time.monotonic() - start < 6.0  # one timeout, bounded
        assert book.is_suspect(a.zmq_address) and book.counters.timeouts == 1
        await book.close()
    finally:
        a.kill()
        c.kill()


async def test_a_load_after_a_lookup_reuses_its_answer_until_it_is_stale(tmp_path: Path) -> None:
    """Lookup then load through the network tier asks the directory (here: every peer) once;
    an answer older than HOLDERS_TTL_S is not reused (and with one peer, the load asks it for
    the bytes without a lookup); a reused holder that no longer sends the chunk makes it a
    miss, not an error."""
    keys = make_keys(6)
    a = start_daemon(tmp_path / "a", "--dram", "1MiB", "--page-size", "4KiB")  # 128 chunks
    now = [100.0]
    try:
        store(a, keys)
        with engine_b() as engine:
            book = PeerBook(PeerSettings(timeout_s=5))
            tier = PeerTier(engine, StaticDirectory([a.zmq_address], book), book,
                            clock=lambda: now[0])  # fmt: skip
            c = book.counters
            assert await tier.query(SPEC.ns_id, keys[:3]) == [True] * 3
            assert c.directory_lookups == 1
            await tier.promote(SPEC.ns_id, keys[:3])
            assert (c.directory_lookups, c.directory_reused, c.fetched_chunks) == (1, 3, 3)
            assert held_bytes(engine, keys[:3]) == expected(keys[:3])

            assert await tier.query(SPEC.ns_id, keys[3:]) == [True] * 3
            await tier.promote(SPEC.ns_id, keys[3:5])  # two reused, none asked
            assert (c.directory_lookups, c.directory_reused) == (2, 5)
            assert c.directory_skipped == 0
            now[0] += HOLDERS_TTL_S + 1
            # stale: not reused; and one peer: asked for the bytes straight away (its fetch
            # answers what a lookup would), the directory not asked
            await tier.promote(SPEC.ns_id, keys[5:])
            assert (c.directory_lookups, c.directory_reused, c.fetched_chunks) == (2, 5, 6)
            assert c.directory_skipped == 1
            assert held_bytes(engine, keys) == expected(keys)

            fresh = make_keys(2, tag="gone")
            store(a, fresh)
            assert await tier.query(SPEC.ns_id, fresh) == [True, True]
            store(a, make_keys(128, tag="flood"))  # A's whole DRAM: it drops them
            await tier.promote(SPEC.ns_id, fresh)
            assert engine.lookup(SPEC.ns_id, fresh) == 0 and c.missed_chunks == 2
            await book.close()
    finally:
        a.kill()


async def test_a_peer_restarted_on_its_data_port_is_fetched_from_over_its_new_stream_port(
    tmp_path: Path,
) -> None:
    """``--peers`` names a data plane; the stream port comes from the peer's ``hello`` and is
    ephemeral by default. A restarted on the same data port opens another stream port: B
    must ask again, not dial the old port on every fetch while A serves."""
    keys = make_keys(4, tag="again")
    a = start_daemon(tmp_path / "a", "--dram", "8MiB")
    try:
        store(a, keys[:2])
        with engine_b() as engine:
            book = PeerBook(PeerSettings(timeout_s=5, suspect_s=0))
            tier = PeerTier(engine, StaticDirectory([a.zmq_address], book), book)
            await tier.promote(SPEC.ns_id, keys[:2])
            assert held_bytes(engine, keys[:2]) == expected(keys[:2])
            assert book.counters.stream_fetches == 1
            old = a.info["peer_stream_port"]
            a.kill()
            a = start_daemon(tmp_path / "a2", "--dram", "8MiB", "--zmq-port",
                             str(a.info["zmq_port"]))  # fmt: skip
            assert a.info["peer_stream_port"] != old
            store(a, keys[2:])
            for _ in range(2):  # the first may find the old port closed (a failure)
                await tier.promote(SPEC.ns_id, keys[2:])
            assert held_bytes(engine, keys[2:]) == expected(keys[2:])
            assert book.counters.stream_fetches == 2
            await book.close()
    finally:
        a.kill()
