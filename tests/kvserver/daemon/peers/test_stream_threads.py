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

from kvserver.crypto import TlsClient, TlsServer, make_tls_cert
from kvserver.daemon.auth import Authenticator
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.daemon.service import KVService
from kvserver.daemon.stream_server import StreamServer
from kvserver.engine.types import EngineConfig
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


async def test_a_tls_reply_is_sent_without_waiting_for_the_default_executor(
    tmp_path: Path,
) -> None:
    """The serving end: a TLS reply over ``SMALL_REPLY_BYTES`` is encrypted from the pages in
    a worker thread; with the default executor full (as replies to slow peers fill it, each
    up to the timeout) the send waited past its timeout, the connection was cut and a
    healthy fetcher missed and suspected this daemon. Server and fetcher in this process (the
    fault is in the serving process's executor), over real TLS sockets on loopback."""
    cert, key = make_tls_cert(str(tmp_path / "tls"), "fleet", ["127.0.0.1"])
    keys = make_keys(16, tag="tls-threads")  # 16 chunks of 2 x 4 KiB: 128 KiB, sent in a thread
    service = KVService(EngineConfig(dram_bytes=1 << 20, page_size=4096))
    service.register_namespace(SPEC)
    parts = [p for k in keys for p in expected([k])[0]]
    assert service.put(SPEC.ns_id, keys, parts, client="test").stored == keys
    server = StreamServer(service, Authenticator.single(""), host="127.0.0.1", port=0,
                          timeout_s=1.0, tls=TlsServer(cert, key).ssl_context())  # fmt: skip
    port = await server.start()
    release = threading.Event()
    loop = asyncio.get_running_loop()
    busy = [loop.run_in_executor(None, release.wait, 10.0) for _ in range(40)]
    try:
        peer = Peer("A", "", "tcp://127.0.0.1:1", f"tls://127.0.0.1:{port}")
        with engine_b() as engine:
            book = PeerBook(PeerSettings(timeout_s=1.0, stream_tls=TlsClient(cert).ssl_context()))
            fetches = PeerFetches(engine, book, publish=lambda: None)
            await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
            assert not any(f.done() for f in busy)  # the executor was full the whole time
            assert held_bytes(engine, keys) == expected(keys)
            assert not book.is_suspect("A")
            await book.close()
    finally:
        release.set()
        await asyncio.gather(*busy)
        await server.stop()
        service.close()
