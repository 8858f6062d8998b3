"""The peer stream's fetching end: the connections to one peer's stream port.

Runs in the daemon process, on its event loop (``loop.sock_*`` on non-blocking sockets; loop
only, not thread-safe). The format is :mod:`kvserver.wire_stream`; the serving end is
``kvserver/daemon/stream_server.py``; :class:`~kvserver.daemon.peers.fetch.PeerFetches`
drives it (it reserves the arena pages and hands their views to :meth:`StreamConnection.
start_reply`, so the payload goes from the kernel straight into the arena).
:class:`PeerStream` owns the connections to one peer (how many are open, the idle ones, the
token, whether the port was unreachable); each :class:`~kvserver.daemon.peers.
stream_connection.StreamConnection` owns its socket and the replies received on it
(``stream_connection.py``, which says how a reply is received, within its deadline, in a
worker thread).

Call order: ``PeerStream(peer, address, ...)`` → ``async with stream.connection() as conn``
(one of at most ``connections`` sockets, connected on first use and opened with the hello that
carries the token; an idle one the peer has closed meanwhile is dropped and another opened)
→ ``await conn.send_requests(ns_id, windows, deadline)`` (pipelined: every window asked at
once) → per window, in order, ``job = conn.start_reply(request_id, rows, ...)`` (a worker
thread starts at once receiving the reply, head and payload, into the rows given: the caller
reserves the next window's pages meanwhile; with ``early``, the loop is told once the leading
rows are in, while the rest is received) then ``await job.result()`` (or ``await
job.stop()`` to give it up) → the block ends: the connection is kept unless a call on it
failed (:meth:`StreamConnection.spoil`), so a half-read reply is never taken for the next.
``await close()`` closes the idle ones.

A ``tls://`` address (a daemon with TLS certificates: ``stream_server.py``) is dialled with
TLS (an ``ssl.SSLContext`` from this daemon's files, ``TlsClient.ssl_context``): the peer's
certificate must chain to the configured CA and name the host of the address (or the
configured ``server_name``), and the handshake comes before the hello, so the token travels
encrypted. A connection that cannot be had within the timeout, or whose certificate is
refused, raises :class:`~kvserver.daemon.peers.directory.PeerFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
import time
from collections.abc import AsyncIterator

from kvserver import wire_stream
from kvserver.daemon.peers.directory import Peer, PeerFailed
from kvserver.daemon.peers.stream_connection import THREADS, StreamConnection
from kvserver.token_file import TokenFile

#: the scheme of a TLS stream port's address (a plain one's is ``tcp://``).
TLS_SCHEME = "tls://"


def split_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` or ``tls://HOST:PORT`` (HOST may be ``[v6]``) as (host, port);
    ValueError when not."""
    scheme = next((s for s in ("tcp://", TLS_SCHEME) if address.startswith(s)), "")
    if not scheme:
        raise ValueError(f"not a tcp:// or tls:// address: {address!r}")
    host, _, port = address[len(scheme) :].rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"not a {scheme}HOST:PORT address (port 1-65535): {address!r}")
    return host.strip("[]"), int(port)


class PeerStream:
    """Connections to one peer's stream port; see the module docstring."""

    def __init__(
        self,
        peer: Peer,
        address: str,
        *,
        timeout_s: float,
        auth_token: str,
        connections: int,
        tls: ssl.SSLContext | None = None,
        server_name: str = "",
    ) -> None:
        """``tls``: how a ``tls://`` address is dialled (ValueError without it, and for a
        ``tcp://`` address with it: a stream is never dialled in another mode than the one
        its address names); ``server_name``: the name the certificate must carry (default:
        the host of the address)."""
        self.peer = peer
        self.address = address
        self._host, self._port = split_address(address)
        if address.startswith(TLS_SCHEME) != (tls is not None):
            raise ValueError(f"a tls:// address and a TLS context go together: {address!r}")
        self._tls = tls
        self._server_name = server_name or self._host
        self.timeout_s = timeout_s
        self._auth = auth_token
        #: no token configured: the peer's token file for this port, as the ZMQ client does
        #: for the data port (loopback peers of the same user only; ``kvserver/token_file.py``)
        self._token_file = TokenFile(address.split("://", 1)[1]) if not auth_token else None
        self._max = connections
        self._idle: list[StreamConnection] = []
        self._opened = 0
        self._freed = asyncio.Condition()
        self._closed = False
        #: a connection to the port was refused or could not be made: the port may be gone
        #: (the peer restarted on another one; ``PeerLink.stream`` asks its ``hello`` again).
        self.unreachable = False

    @property
    def connections_open(self) -> int:
        return self._opened

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[StreamConnection]:
        """A connection for the block (module docstring); :class:`PeerFailed` when none can be
        had within the timeout."""
        waiting: list[bool] = [False]  # waited for a busy connection
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await self._acquire(waiting)
        except TimeoutError:
            msg = "no stream connection to the peer in time"
            if waiting[0]:
                msg += f" (all {self._max} busy with other fetches)"
            raise PeerFailed(msg, timed_out=True, busy=waiting[0], peer=self.peer.host_id) from None
        except OSError as exc:
            self.unreachable = True
            msg = f"cannot connect to the peer's stream port: {exc}"
            raise PeerFailed(msg, timed_out=True, peer=self.peer.host_id) from None
        except ValueError as exc:  # a name the resolver refuses (UnicodeError: a label over
            # 63 characters): that peer's failure, not the load's
            msg = f"cannot resolve the peer's stream address: {exc}"
            raise PeerFailed(msg, timed_out=False, peer=self.peer.host_id) from None
        try:
            yield conn
        except BaseException:
            conn.spoil()
            raise
        finally:
            await self._release(conn)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close()
        self._opened -= len(idle)

    async def _acquire(self, waiting: list[bool]) -> StreamConnection:
        """An idle connection, or a new one; sets ``waiting[0]`` once every connection was
        in use and this waited for one to be given back (a timeout then is not the peer's)."""
        async with self._freed:
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if conn.alive():
                        return conn
                    conn.sock.close()
                    self._opened -= 1
                if self._opened < self._max:
                    break
                waiting[0] = True
                await self._freed.wait()
            self._opened += 1
        try:
            return await self._connect()
        except BaseException:
            async with self._freed:
                self._opened -= 1
                self._freed.notify()
            raise

    async def _connect(self) -> StreamConnection:
        loop = asyncio.get_running_loop()
        resolve = functools.partial(socket.getaddrinfo, type=socket.SOCK_STREAM)
        infos = await loop.run_in_executor(THREADS, resolve, self._host, self._port)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, addr)
            hello = wire_stream.encode_hello(self._token())
            if self._tls is not None:  # the handshake first: the hello goes inside TLS
                tls = self._tls.wrap_socket(
                    sock, server_hostname=self._server_name, do_handshake_on_connect=False
                )
                sock = tls
                conn = StreamConnection(tls, self.peer)
                await conn.open(hello, time.monotonic() + self.timeout_s)
                return conn
            # the hello: the token, before anything else (a refusal comes as the first reply)
            await loop.sock_sendall(sock, hello)
            sock.setblocking(True)  # MSG_DONTWAIT on the loop, blocking calls in threads
        except BaseException:
            sock.close()
            raise
        return StreamConnection(sock, self.peer)

    def _token(self) -> str:
        return self._token_file.reload() if self._token_file is not None else self._auth

    async def _release(self, conn: StreamConnection) -> None:
        if conn.spoiled or self._closed:
            conn.sock.close()
            self._opened -= 1
        else:
            self._idle.append(conn)
        async with self._freed:
            self._freed.notify()
