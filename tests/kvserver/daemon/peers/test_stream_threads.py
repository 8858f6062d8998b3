"""The peer stream's threads are its own: whatever keeps the event loop's default executor
busy (the daemon's other off-loop work: a long prompt hashed, a large header decoded, TLS
replies to a slow peer, each up to its own timeout) cannot hold a fetch from a healthy peer
past its deadline, fail it, and make that peer suspect. A real peer daemon; this daemon's
side in process (as in ``test_fetch.py``), its default executor filled with blocked jobs
(the fault: a real daemon cannot be made to fill it on demand)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, expected, held_bytes, store
from tests.support.daemon import start_daemon

pytestmark = pytest.mark.multiprocess


async def test_a_fetch_over_the_stream_does_not_wait_for_the_default_executor(
    tmp_path: Path,
) -> None:
    keys = make_keys(4, tag="threads")
    a = start_daemon(tmp_path / "a", "--dram", "8MiB")
    release = threading.Event()
    loop = asyncio.get_running_loop()
    # more jobs than asyncio's default executor has threads (at most 32): all blocked
    busy = [loop.run_in_executor(None, release.wait, 10.0) for _ in range(40)]
    try:
        store(a, keys)
        peer = Peer("A", "", a.zmq_address, f"tcp://127.0.0.1:{a.info['peer_stream_port']}")
        with engine_b() as engine:
            book = PeerBook(PeerSettings(timeout_s=1.0))
            fetches = PeerFetches(engine, book, publish=lambda: None)
            await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
            assert not any(f.done() for f in busy)  # the executor was full the whole time
            assert held_bytes(engine, keys) == expected(keys)
            assert book.counters.stream_fetches == 1 and not book.is_suspect("A")
            await book.close()
    finally:
        release.set()
        await asyncio.gather(*busy)
        a.kill()
