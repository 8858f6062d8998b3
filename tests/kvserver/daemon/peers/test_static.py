"""The directory of a configured peer list: real peer daemons asked with a local lookup."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.static import StaticDirectory
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import SPEC, store
from tests.support.daemon import start_daemon

pytestmark = pytest.mark.multiprocess


async def test_holders_are_the_peers_whose_leading_run_covers_each_key(tmp_path: Path) -> None:
    keys = make_keys(5)
    a = start_daemon(tmp_path / "a", "--dram", "8MiB")
    c = start_daemon(tmp_path / "c", "--dram", "8MiB")
    try:
        store(a, keys[:2])
        store(c, keys[:4])
        book = PeerBook(PeerSettings(timeout_s=0.5, suspect_s=60))
        directory = StaticDirectory([a.zmq_address, c.zmq_address], book)
        assert set(directory.peers()) == {a.zmq_address, c.zmq_address}
        both, only_c = frozenset({a.zmq_address, c.zmq_address}), frozenset({c.zmq_address})

        assert await directory.holders(SPEC.ns_id, keys) == [both, both, only_c, only_c]
        a.kill()
        start = time.monotonic()
        assert await directory.holders(SPEC.ns_id, keys) == [only_c] * 4
        assert time.monotonic() - start < 2.0
        assert book.is_suspect(a.zmq_address) and book.counters.timeouts == 1
        await book.close()
    finally:
        a.kill()
        c.kill()
