"""The peer stream's server end: peers fetch chunks from this daemon over TCP, plain or TLS.

Runs in the daemon process, on its event loop (loop only, not thread-safe; the bytes of a
connection are moved by ``stream_io.py``). The format is :mod:`kvserver.wire_stream`
(``docs/wire.md``, "Peer stream"); the fetching end is ``kvserver/daemon/peers/stream.py``.

Call order: ``StreamServer(service, auth, ..., tls=context or None)`` → ``await start()``
(binds; the port is announced in ``hello`` as ``peer_stream_port``, or as
``peer_stream_tls_port`` with TLS, and in the fleet record as ``stream_address``,
``tcp://HOST:PORT`` or ``tls://HOST:PORT``) → ... → ``await stop()`` (closes the listener and
every connection; their pins end).

With ``tls`` (an ``ssl.SSLContext`` from the daemon's gRPC TLS files,
``TlsServer.ssl_context``) every connection starts with the TLS handshake, within
``timeout_s``; one that fails (a plain client, a client certificate missing or untrusted under
mutual TLS) is closed before a byte of the stream is read (``refused_handshakes``). A TLS
daemon never opens a plain stream port. Then, inside TLS when it is on:
each connection is served by one task. Its hello comes first: the token, at most 255 bytes,
read and checked before anything else of the connection is read (a wrong one: error,
connection closed; the principal it names is the connection's). Then its requests, one at a
time, in order (a peer pipelines its windows on one connection: their replies go back in the
order asked), each checked as a ZMQ ``get`` with ``leading=true`` is: the principal's access
to the namespace (``access.authorize``, as for the ZMQ ``get``), then
``KVService.get(leading=True)``: the leading run of the keys held in this daemon's own tiers,
promoted from SSD when needed, pinned by a load lease while its pages are sent straight from
the arena (``sendmsg`` of arena views, the kernel's copy the only one; with TLS,
``SSL_write`` of them in a worker thread: ``stream_io.py``), then unpinned. Its time goes to
``service.op_seconds`` as ``peer_fetch`` (``op_labels.py``), as a peer's fetch over ZMQ does.

A client's ``put`` or ``get`` (an op request: ``stream_ops.py``) is served on the same
connections, after the same hello, in the same order as its other requests.

Bounds: at most ``max_connections`` connections (more are closed at once), of which at most
:data:`MAX_HELLO_WAITS_PER_ADDRESS` from one address that have not yet passed their hello (more
are closed at once: an unauthenticated peer opening a connection every few milliseconds and
sending nothing held all 256 for the hello timeout each, and every other peer's new connection
was refused meanwhile); a request's header
at most ``wire_stream.MAX_REQUEST_BYTES``; the hello within ``timeout_s`` of connecting;
every read of a request after its first byte and every reply's send within ``timeout_s``
(past it the connection is closed and the pins end); an authenticated connection may stay idle
``idle_s`` between requests. Bad framing (magic, version, size) is answered
with an error and the connection closed (a stream cannot skip it); a bad header inside good
framing is answered and the stream goes on. Nothing a peer sends can stop the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvserver import wire, wire_stream
from kvserver.daemon.access import authorize
from kvserver.daemon.auth import Authenticator, Principal
from kvserver.daemon.listening import bind_hint
from kvserver.daemon.op_labels import PEER_FETCH
from kvserver.daemon.owners import STREAM_CLIENT as STREAM_CLIENT
from kvserver.daemon.results import Fetched, Pending
from kvserver.daemon.service import KVService
from kvserver.daemon.stream_io import Closed, PlainIO, TlsIO
from kvserver.daemon.stream_ops import StreamOps, refuse, send_fetched
from kvserver.errors import KVServerError
from kvserver.netaddr import host_port

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
#: connections from one address that may wait for their TLS handshake and hello at once.
MAX_HELLO_WAITS_PER_ADDRESS = 16
IDLE_S = 300.0

StreamIO = PlainIO | TlsIO


@dataclass(slots=True)
class StreamCounters:
    """Counters of the peer stream's server end (``stats()["peer_stream"]``; never reset).
    ``requests``, ``errors``, ``sent_*``: peers' fetches (errors: refused hellos and unframed
    requests too); clients' ops count in ``StreamOps.counters`` (``client_*``)."""

    connections: int = 0
    refused_connections: int = 0
    #: connections whose hello was malformed or whose token was refused.
    refused_hellos: int = 0
    #: TLS connections whose handshake failed (a plain client, an untrusted certificate).
    refused_handshakes: int = 0
    requests: int = 0
    errors: int = 0
    sent_chunks: int = 0
    sent_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class StreamServer:
    """The peer stream listener and its connections; see the module docstring."""

    def __init__(
        self,
        service: KVService,
        auth: Authenticator,
        *,
        host: str,
        port: int,
        timeout_s: float,
        max_connections: int = MAX_CONNECTIONS,
        idle_s: float = IDLE_S,
        tls: ssl.SSLContext | None = None,
        max_payload_bytes: int = 1 << 30,
        max_reserved_bytes: int = 1 << 30,
    ) -> None:
        self._service = service
        self._auth = auth
        self._host = host
        self._port = port
        self._timeout_s = timeout_s
        self._idle_s = idle_s
        self._max = max_connections
        self.tls = tls
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: address -> its connections still before their hello (bounded per address)
        self._hello_waits: dict[str, int] = {}
        self.counters = StreamCounters()
        self._ops = StreamOps(
            service, max_payload_bytes=max_payload_bytes, max_reserved_bytes=max_reserved_bytes
        )
        self.port = -1

    @property
    def num_connections(self) -> int:
        return len(self._tasks)

    def stats(self) -> dict[str, Any]:
        clients = {f"client_{k}": v for k, v in self._ops.counters.to_dict().items()}
        return {"port": self.port, "tls": self.tls is not None,
                "open_connections": self.num_connections, **self.counters.to_dict(),
                **clients}  # fmt: skip

    async def start(self) -> int:
        """Bind and listen; returns the port (ephemeral when configured 0). Raises
        KVServerError when the address cannot be bound (in use, not this host's)."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._host, self._port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            hint = bind_hint("--peer-stream-port", exc.errno)
            raise KVServerError(
                f"cannot bind the peer stream to {host_port(self._host, self._port)}: "
                f"{exc.strerror}{hint}"
            ) from None
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.get_running_loop().create_task(self._accept_forever())
        return self.port

    async def stop(self) -> None:
        """Stop accepting, close every connection (their pins end). Idempotent."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ connections

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, peer = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. EMFILE: keep serving the connections we have
                logger.warning("peer stream: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            waits = self._hello_waits.get(address, 0)
            if len(self._tasks) >= self._max or waits >= MAX_HELLO_WAITS_PER_ADDRESS:
                self.counters.refused_connections += 1
                sock.close()
                continue
            self._hello_waits[address] = waits + 1
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.counters.connections += 1
            task = loop.create_task(self._serve(sock, address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket, address: str) -> None:
        io: StreamIO | None = None
        waiting = True  # counted in _hello_waits until its hello is read
        try:
            if self.tls is not None:
                try:
                    io = await TlsIO.accept(sock, self.tls, self._timeout_s)
                except Closed:
                    self.counters.refused_handshakes += 1
                    return
            else:
                io = PlainIO(sock, self._timeout_s)
            who = await self._hello(io)
            waiting = self._hello_done(address)
            if who is None:
                return
            while True:
                head = await io.read(wire_stream.REQUEST_HEAD.size, self._idle_s,
                                     at_boundary=True)  # fmt: skip
                if head is None:
                    return
                try:
                    is_op, length = wire_stream.decode_any_head(head)
                except KVServerError as exc:
                    await self._refuse(io, 0, exc)
                    await io.linger()
                    return  # a stream cannot skip what it cannot frame
                if is_op:  # a client's put or get
                    await self._ops.serve(io, length, who)
                    continue
                header = await io.read(length, self._timeout_s)
                assert header is not None
                self.counters.requests += 1
                try:
                    request = wire_stream.decode_request(header)
                except KVServerError as exc:
                    await self._refuse(io, 0, exc)
                    continue
                await self._answer(io, request, who)
        except Closed:
            return
        except Exception:  # a bug must not take the daemon down: log, close this connection
            logger.exception("peer stream: connection failed")
        finally:
            if waiting:
                self._hello_done(address)
            if io is not None:
                io.close()
            sock.close()

    def _hello_done(self, address: str) -> bool:
        """A connection from ``address`` is past its hello (or gone before it); returns False."""
        left = self._hello_waits.get(address, 0) - 1
        if left > 0:
            self._hello_waits[address] = left
        else:
            self._hello_waits.pop(address, None)
        return False

    async def _hello(self, io: StreamIO) -> Principal | None:
        """Read the connection's hello (at most 261 bytes, within the timeout) and check its
        token; None (an error sent, the connection to be closed) when it is refused."""
        head = await io.read(wire_stream.HELLO_HEAD.size, self._timeout_s, at_boundary=True)
        if head is None:
            return None
        try:
            length = wire_stream.decode_hello_head(head)
            raw = await io.read(length, self._timeout_s) if length else bytearray()
            assert raw is not None
            return self._auth.check(wire_stream.decode_token(raw) or None)
        except KVServerError as exc:  # a bad hello, or Unauthenticated
            self.counters.refused_hellos += 1
            await self._refuse(io, 0, exc)
            await io.linger()
            return None

    async def _answer(
        self, io: StreamIO, request: wire_stream.FetchRequest, who: Principal
    ) -> None:
        """Answer a peer's fetch; its time, until its reply is sent or refused, goes to
        ``service.op_seconds`` as ``peer_fetch`` (as the same ``get`` over ZMQ does)."""
        start = time.perf_counter()
        try:
            await self._fetch(io, request, who)
        finally:
            self._service.op_seconds.labels(PEER_FETCH).observe(time.perf_counter() - start)

    async def _fetch(self, io: StreamIO, request: wire_stream.FetchRequest, who: Principal) -> None:
        service = self._service
        try:
            authorize(who, service, wire.GET, {"ns_id": request.ns_id, "keys": request.keys})
            spec = service.namespace(request.ns_id)
            got: Fetched | Pending[Fetched] = service.get(
                request.ns_id, request.keys, None, client=STREAM_CLIENT, leading=True
            )
            if isinstance(got, Pending):
                got = await got.run()
        except KVServerError as exc:
            await self._refuse(io, request.request_id, exc)
            return
        await send_fetched(io, service, self.counters, request.request_id, got, spec.part_bytes)

    async def _refuse(self, io: StreamIO, request_id: int, exc: KVServerError) -> None:
        await refuse(io, self.counters, request_id, exc)
