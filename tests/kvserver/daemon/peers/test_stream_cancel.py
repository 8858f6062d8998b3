"""A peer stream transfer given up (its awaiting task cancelled) leaves no "Future exception
was never retrieved" in the log: the worker thread's call fails when its socket is shut down,
and that failure is retrieved although nobody wants it.

The fetching side is the network tier's own classes; the peer is a socket pair (a reply that
never comes) or a loopback server that never answers a TLS handshake: a real daemon cannot be
made to stall at these points on demand.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from pathlib import Path

import pytest

from kvserver.crypto import TlsClient, make_tls_cert
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.daemon.peers.stream_connection import StreamConnection
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b
from tests.kvserver.daemon.peers.test_stream import no_reservations

UNRETRIEVED = "exception was never retrieved"
PEER = Peer("F", "", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1")


async def cancel_a_reply_under_way() -> None:
    """A reply job's receive is blocked (the peer sends nothing); its awaiting task is
    cancelled and the job dropped without ``stop()``."""
    ours, theirs = socket.socketpair()
    try:
        conn = StreamConnection(ours, PEER)
        rows = [[memoryview(bytearray(SPEC.part_bytes))]]
        job = conn.start_reply(1, rows, 1, SPEC.part_bytes, time.monotonic() + 5, lambda head: None)
        task = asyncio.ensure_future(job.result())
        await asyncio.sleep(0.05)  # the thread is in its receive (or about to be)
        task.cancel()
        await asyncio.wait([task])
        assert task.cancelled() and conn.spoiled
    finally:
        ours.close()
        theirs.close()


async def test_a_reply_given_up_mid_receive_logs_no_unretrieved_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    await cancel_a_reply_under_way()
    gc.collect()  # the job's future is gone: it logs then if nobody retrieved its exception
    assert UNRETRIEVED not in caplog.text


async def test_a_fetch_cancelled_in_the_tls_handshake_logs_no_unretrieved_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer accepts the connection and never answers the handshake (a worker thread
    waits in it); the fetch is cancelled: nothing placed or reserved, nothing logged."""
    cert, _ = make_tls_cert(str(tmp_path / "fleet"), "fleet", ["127.0.0.1"])
    accepted = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # until the fetcher gives up and closes
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        keys = make_keys(2, tag="tls-cancel")
        with engine_b() as engine:
            tls = TlsClient(cert).ssl_context()
            book = PeerBook(PeerSettings(timeout_s=5.0, suspect_s=60, stream_tls=tls))
            fetches = PeerFetches(engine, book, publish=lambda: None)
            peer = Peer("F", "", "tcp://127.0.0.1:1", f"tls://127.0.0.1:{port}")
            task = asyncio.ensure_future(
                fetches.fetch(SPEC, [(k, frozenset({"F"})) for k in keys], {"F": peer})
            )
            await asyncio.wait_for(accepted.wait(), 5)
            await asyncio.sleep(0.05)  # the handshake's thread waits for the server's hello
            task.cancel()
            await asyncio.wait([task])
            assert task.cancelled()
            del task
            assert engine.lookup(SPEC.ns_id, keys) == 0
            no_reservations(engine)
            await book.close()
    gc.collect()
    assert UNRETRIEVED not in caplog.text
