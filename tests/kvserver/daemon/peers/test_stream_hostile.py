"""A faulty or hostile peer on the stream, as the fetching daemon meets it.

The fetching side is the network tier's own classes over a real storage engine (as in
``test_stream.py``); the peer is a stand-in stream server on loopback (plain TCP, or TLS with a
certificate of ``kvserver.crypto.make_tls_cert``), because a real daemon cannot be made to
send these replies.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvserver import wire_stream
from kvserver.crypto import TlsClient, make_tls_cert
from kvserver.daemon.peers.directory import Peer, PeerFailed
from kvserver.daemon.peers.stream import PeerStream
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b
from tests.kvserver.daemon.peers.test_stream import fetcher, no_reservations

Behaviour = Callable[[asyncio.StreamWriter, wire_stream.FetchRequest], Awaitable[None]]


async def serve_standin(
    behaviour: Behaviour, tls: ssl.SSLContext | None
) -> tuple[asyncio.Server, str]:
    """A stream server on loopback answering the first request with ``behaviour``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await reader.readexactly(wire_stream.HELLO_HEAD.size)
            await reader.readexactly(wire_stream.decode_hello_head(hello))
            head = await reader.readexactly(wire_stream.REQUEST_HEAD.size)
            body = await reader.readexactly(wire_stream.decode_request_head(head))
            await behaviour(writer, wire_stream.decode_request(body))
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    return server, f"{'tls' if tls else 'tcp'}://127.0.0.1:{port}"


async def trickle(writer: asyncio.StreamWriter, req: wire_stream.FetchRequest) -> None:
    """The head of a whole window, then its payload a byte at a time, one every 50 ms (a
    TLS record each): always something arriving, never the window."""
    writer.write(wire_stream.encode_ok(req.request_id, len(req.keys), 2, SPEC.part_bytes))
    for _ in range(len(req.keys) * 2 * SPEC.part_bytes):
        writer.write(b"x")
        await writer.drain()
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", ["tcp", "tls"])
async def test_a_peer_trickling_a_window_is_cut_off_at_the_timeout(
    tmp_path: Path, mode: str
) -> None:
    """A peer sends a window's head, then its bytes one at a time, each well within the
    timeout: the fetch still ends at the peer timeout (the deadline is the window's, not
    each receive's), nothing is placed or left reserved, the peer is suspect. Over TLS each
    ``recv_into`` was given the whole time left at the start of its part, and every record
    that came renewed it: the fetch went on as long as the trickle (16 KiB at 20 bytes/s here,
    14 minutes)."""
    client_tls: ssl.SSLContext | None = None
    server_tls: ssl.SSLContext | None = None
    if mode == "tls":
        cert, key = make_tls_cert(str(tmp_path / "certs"), "standin", ["127.0.0.1"])
        server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_tls.load_cert_chain(cert, key)
        client_tls = TlsClient(cert, "", "").ssl_context()
    server, address = await serve_standin(trickle, server_tls)
    async with server:
        keys = make_keys(2, tag="trickle")
        with engine_b() as engine:
            fetches, book = fetcher(engine, timeout_s=1.0, suspect_s=60, stream_tls=client_tls)
            peer = Peer("F", "", "tcp://127.0.0.1:1", address)
            start = time.monotonic()
            wanted = [(k, frozenset({"F"})) for k in keys]
            await asyncio.wait_for(fetches.fetch(SPEC, wanted, {"F": peer}), 20)
            assert time.monotonic() - start < 10  # the 1 s timeout, not the trickle's minutes
            assert engine.lookup(SPEC.ns_id, keys) == 0
            assert book.counters.timeouts == 1 and book.is_suspect("F")
            assert book.counters.missed_chunks == 2
            no_reservations(engine)
            await book.close()


async def serve_slow_reader(tls: ssl.SSLContext | None) -> tuple[asyncio.Server, str]:
    """A stream server on loopback that reads a connection's bytes 1 KiB every 10 ms (its
    receive buffer 64 KiB: no kernel autotuning takes them faster) and answers nothing."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(1024):
                await asyncio.sleep(0.01)
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the accepted ones'
    listener.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(handle, sock=listener, ssl=tls, limit=1024)
    port = listener.getsockname()[1]
    return server, f"{'tls' if tls else 'tcp'}://127.0.0.1:{port}"


@pytest.mark.parametrize("mode", ["tcp", "tls"])
async def test_requests_to_a_peer_reading_them_slowly_are_cut_off_at_the_timeout(
    tmp_path: Path, mode: str
) -> None:
    """A peer takes a fetch's requests (here 12 MiB of them: 48 windows of 4,096 keys, as a
    long prompt's fetch asks) 100 KiB/s, always making progress: sending them ends at the
    deadline (PeerFailed, timed out), the connection is not kept (a guard: the plain socket's
    SO_SNDTIMEO is set per send, and OpenSSL's one write of the whole buffer is bounded by
    the socket's timeout as a whole; about 80 s at the peer's pace otherwise)."""
    client_tls, server_tls = tls_pair(tmp_path) if mode == "tls" else (None, None)
    server, address = await serve_slow_reader(server_tls)
    async with server:
        peer = Peer("F", "", "tcp://127.0.0.1:1", address)
        stream = PeerStream(
            peer, address, timeout_s=1.0, auth_token="t", connections=1, tls=client_tls
        )
        windows = [[i.to_bytes(8, "big") * 8 for i in range(w << 12, (w + 1) << 12)]
                   for w in range(48)]  # fmt: skip
        start = time.monotonic()
        with pytest.raises(PeerFailed) as failed:
            async with stream.connection() as conn:
                send = conn.send_requests(SPEC.ns_id, windows, time.monotonic() + 1.0)
                await asyncio.wait_for(send, 20)
        assert time.monotonic() - start < 10  # the 1 s deadline, not the reader's 80 s
        assert failed.value.timed_out
        assert stream.connections_open == 0  # spoiled: closed, not kept
        await stream.close()


def tls_pair(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A client context trusting a fresh certificate for 127.0.0.1, and the server's."""
    cert, key = make_tls_cert(str(tmp_path / "certs"), "standin", ["127.0.0.1"])
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    return TlsClient(cert, "", "").ssl_context(), server_tls
