"""The daemon's data-plane front end: the ZMQ ROUTER, the local channel and the KV-event PUB.

Runs in the daemon process, on its one event loop (uvloop in production; the sockets' file
descriptors are watched with ``add_reader``, which every asyncio loop provides). Not thread-safe:
one instance per daemon, used from the loop only.

Call order: ``start()`` (bind the ROUTER, the local channel's Unix socket next to the arena and the
PUB — both CURVE servers when a key is configured, with ZAP admitting only listed client keys when
a clients directory is; else, when a token is required, the ROUTER a PLAIN server whose password
ZAP checks against the tokens (``zap.py``) — start reading and the event publisher) → serving
→ ``stop()`` (stop reading, close the local channel and the sockets with linger 0, release send
pins).

Modules: this one reads and answers requests (the receive loop, per-connection order, lanes,
replies); ``zmq_requests.py`` checks each request (token, size, header) and hands it to its op;
``zmq_ops.py`` carries out each op; ``zmq_send.py`` sends payload replies zero-copy under pins,
at most ``zmq_send_max_unsent`` bytes unsent per connection; ``local_server.py`` frames the
local channel's messages (clients on this host); ``zmq_events.py`` publishes KV events and
serves vLLM's replay protocol; ``zmq_sockets.py`` makes, secures, binds and closes the ROUTER
and the PUB.

A connection of the local channel is served exactly like a ROUTER connection (same messages,
handlers, lanes and order); its messages arrive from its protocol callbacks instead of the ROUTER's
reader, and its replies (payload copied) go to its transport. When it closes and its client's
process has exited (crashed, killed: ``local_exits.py``), the reservations and pins of every
client its requests named are released at once (after its lane, if one runs), not when their
leases expire; a client that lives on (its call timed out, so it closed its links) keeps them.

The ROUTER is read by a reader callback on its file descriptor (``loop.add_reader``), not by a
coroutine awaiting ``recv``: each wake-up drains every message already queued (at most
:data:`MAX_DRAIN` before yielding to the loop) with non-blocking receives, and answers each one
before reading the next: every handler is a synchronous call into
:class:`~kvserver.daemon.service.KVService` and the reply is sent at once (a ROUTER send never
blocks: at the high-water mark ZMQ drops the message), so requests are applied in arrival order
with no task switch, future or pyzmq asyncio bookkeeping per request. The exception is a request
that needs a lower tier's I/O (a load naming chunks only below DRAM, a lookup a tier cannot answer
without I/O): its handler returns a ``Deferred``, and the rest of it (e.g. promotion, the load, the
reply) runs as a task of its own, a *lane*, while the loop goes on reading; a replay request runs
on a lane too. Order per connection (ROUTER routing id) is kept: until the lane has answered, every
later message of that connection is queued on the lane and handled there, in order, after it (a
``complete_load`` or ``release`` never overtakes the load before it, and replies leave in request
order); other connections are served meanwhile. The lane ends once its queue is empty; the queue
holds what its connection sends meanwhile, as the ROUTER's receive buffer would have (``stop``
drops it). How many promotions run at once, and that a chunk is promoted once however many requests
want it, is the tier's business. ZMQ's descriptor is edge- triggered: a send from a lane can
consume the wake-up of a message that arrived meanwhile, so lanes schedule one more drain after
they send.

Every request gets exactly one reply — an error reply (request id 0 when the header is unreadable)
for anything malformed, unauthenticated, too large or refused; an unexpected exception is logged
and answered ``internal``. The loop never dies on input. One exception: the error replies to a
ROUTER connection's unauthenticated requests are throttled (``refusals.py``: a burst at once,
then held back), and none is sent past a bound on replies held back.

A request with an empty first frame and an 8-byte second frame is vLLM's replay request (``[b"",
start_seq]``, ``zmq_events.py``); it is ordered like any other request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio

from kvserver import wire, wire_local
from kvserver.daemon.auth import Authenticator
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.local_exits import ExitWatch
from kvserver.daemon.local_server import (
    LocalConnection,
    LocalFrame,
    LocalListener,
    LocalMessage,
    Refused,
)
from kvserver.daemon.service import KVService
from kvserver.daemon.zmq_events import EventPublisher
from kvserver.daemon.zmq_ops import Answer, DataOps, PayloadFrame, failed
from kvserver.daemon.zmq_receive import FrameReceiver, Overflow, local_frames
from kvserver.daemon.zmq_requests import Peer, RequestHandler
from kvserver.daemon.zmq_send import Parts, ZeroCopySender
from kvserver.daemon.zmq_sockets import DataSockets
from kvserver.errors import InvalidArgument

logger = logging.getLogger(__name__)

#: messages one reader wake-up handles before it lets the loop run other callbacks.
MAX_DRAIN = 64


#: the rest of a request that must wait (promotion, replay), run on its connection's lane.
_Job = Callable[[], Awaitable[None]]
#: one message of a peer: ROUTER frames after the routing id, or a local message.
_Message = list[zmq.Frame] | Overflow | LocalMessage


class DataFrontend:
    """Serves the data plane (ZMQ, the local channel) and the KV-event PUB; see the module."""

    def __init__(
        self, service: KVService, config: DaemonConfig, auth: Authenticator | None = None
    ) -> None:
        self._service = service
        self._config = config
        self._auth = auth if auth is not None else Authenticator.single(config.auth_token)
        self._receiver = FrameReceiver(config.max_message_bytes, self._auth)
        self._sid = secrets.token_hex(8)  # changes on every daemon start
        self._sockets = DataSockets()
        #: the same ROUTER without the asyncio layer: non-blocking receives and sends.
        self._raw: zmq.Socket[bytes] | None = None
        self._fd: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: connection → messages waiting behind that connection's lane
        self._lanes: dict[Peer, deque[_Message]] = {}
        self._local: LocalListener | None = None
        self._exits = ExitWatch()  # closed local connections whose process may yet exit
        self._reading = False  # inside the reader callback
        self._drain_scheduled = False
        self._sender = ZeroCopySender(service, config.send_timeout_s, config.send_max_unsent)
        self._ops = DataOps(service, config, self._sid, self._sender)
        admit = self._sender.admit  # a ROUTER connection's get/read_parts, before it is served
        self._requests = RequestHandler(service, config, self._auth, self._ops, self._send, admit)
        self._events = EventPublisher(service)

    @property
    def sender(self) -> ZeroCopySender:
        """The zero-copy sends of payload replies (their pins and the connections cut)."""
        return self._sender

    @property
    def num_lanes(self) -> int:
        """Connections whose requests wait for a promotion or a replay."""
        return len(self._lanes)

    def announce_peer_stream(self, port: int | None, *, tls: bool = False) -> None:
        """Announce the peer stream's port in ``hello`` (None: none open): as
        ``peer_stream_tls_port`` when it is TLS (so older peers, which read only
        ``peer_stream_port``, never dial it in clear), else as ``peer_stream_port``."""
        self._ops.peer_stream_port = None if tls else port
        self._ops.peer_stream_tls_port = port if tls else None

    @property
    def local_path(self) -> str | None:
        """The local channel's socket path; None when it could not be bound."""
        return self._local.path if self._local is not None else None

    # ------------------------------------------------------------------ lifetime

    async def start(self) -> tuple[int, int]:
        """Bind ROUTER, the local channel (unless it cannot be bound) and PUB (unless pub_port
        is -1); returns (data_port, pub_port or -1)."""
        cfg = self._config
        service = self._service
        try:
            data_port, pub_port = self._sockets.open(
                cfg, self._auth, service.handshakes, service.subscribers
            )
        except BaseException:
            await self.stop()
            raise
        router = self._sockets.router
        assert router is not None  # open() made it
        self._events.set_pod(data_port, cfg.member_id)
        self._raw = zmq.Socket.shadow(router.underlying)
        fd = self._fd = cast(int, self._raw.getsockopt(zmq.FD))
        asyncio.get_running_loop().add_reader(fd, self._drain)
        self._schedule_drain()  # anything that arrived before the reader was added
        await self._start_local()
        if self._sockets.pub is not None:
            self._spawn(self._events.publish_forever(self._sockets.pub))
        return data_port, pub_port

    async def _start_local(self) -> None:
        """Open the local channel next to the arena (``<arena path>.sock``); without it (a
        path too long for a Unix socket, a directory we cannot write) clients use ZMQ."""
        path = f"{self._service.arena_path}.sock"
        max_size = wire_local.max_size(self._config.max_message_bytes)
        local = LocalListener(
            path,
            self._accept,
            max_size,
            max_inflight=self._config.local_inflight_bytes,
            max_connections=self._config.local_max_connections,
            closed=self._local_closed,
        )
        try:
            await local.start()
        except OSError as exc:
            logger.warning("no local channel (clients on this host use ZMQ): %s", exc)
            return
        self._local = local
        self._ops.local_path = path
        logger.info("local channel for clients on this host: %s", path)

    async def stop(self) -> None:
        """Stop reading (and drop the requests lanes still hold), close the sockets (linger
        0) and the local channel, release send pins. Idempotent."""
        local, self._local = self._local, None
        self._exits.stop()
        if local is not None:
            await local.stop()
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = None
        self._raw = None  # a shadow: the socket itself is closed below
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._lanes.clear()
        await self._sender.close()
        self._sockets.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ receive loop

    def _drain(self) -> None:
        """Reader callback: handle the messages already queued (at most MAX_DRAIN, then
        continue in a later callback so other work on the loop is not starved)."""
        self._drain_scheduled = False
        raw = self._raw
        if raw is None:
            return
        self._reading = True
        try:
            for _ in range(MAX_DRAIN):
                if not cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                received = self._receiver.receive(raw)
                if received is None:  # a message of many frames: the rest in a later call
                    break
                self._accept(*received)
            self._schedule_drain()  # more may be queued: after the loop's other callbacks
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM and not raw.closed:
                logger.warning("ZMQ receive failed: %s", exc)
                self._schedule_drain()
        finally:
            self._reading = False

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._raw is not None:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _accept(self, peer: Peer, message: _Message) -> None:
        """One message of ``peer`` (the reader, or a local connection, calls this in order)."""
        lane = self._lanes.get(peer)
        if lane is not None:  # this connection waits for a lane: keep its order
            lane.append(message)
            return
        job = self._serve_one(peer, message)
        if job is not None:
            self._lanes[peer] = deque()
            self._spawn(self._run_lane(peer, job))

    async def _run_lane(self, peer: Peer, job: _Job) -> None:
        """Run ``job``, then the connection's queued messages in order; see the module
        docstring. Ends (and the reader takes the connection back) once the queue is empty."""
        queue = self._lanes[peer]
        pending: _Job | None = job
        try:
            while pending is not None:
                try:
                    await pending()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("failed to answer a ZMQ request")
                pending = None
                while queue and pending is None:
                    pending = self._serve_one(peer, queue.popleft())
            # the queue is empty and nothing is awaited before the lane is removed below
        finally:
            if self._lanes.get(peer) is queue:
                del self._lanes[peer]
            if isinstance(peer, LocalConnection) and peer.closed:
                self._release_local(peer)
            self._schedule_drain()  # our sends may have consumed the descriptor's wake-up

    def _serve_one(self, peer: Peer, message: _Message) -> _Job | None:
        """Handle one message: answer it now and return None, or return the rest of it."""
        source: zmq.Frame | None = None  # a ROUTER message's first frame: its connection
        overflow: Overflow | None = None  # a message received past its budget
        try:
            if isinstance(peer, bytes):
                if isinstance(message, Overflow):
                    overflow, message = message, message.frames
                frames: Sequence[PayloadFrame] = cast(list[zmq.Frame], message)
                source = cast(zmq.Frame, frames[0]) if frames else None
                if len(frames) == 2 and len(frames[0]) == 0 and len(frames[1]) == wire.SEQ_BYTES:
                    router, start = self._sockets.router, frames[1].buffer.tobytes()
                    if router is None:
                        return None
                    error = self._requests.replay_refusal(peer)
                    if error is not None:
                        self._send(peer, failed(0, error))
                        return None
                    return lambda: self._events.replay(router, peer, start)
                owner = peer.hex()
            else:
                if isinstance(message, Refused):  # the stream cannot be resynchronized
                    self._send(peer, failed(0, message.error))
                    peer.close()
                    return None
                try:
                    views = local_frames(cast(memoryview, message), self._config.max_message_bytes)
                except InvalidArgument as exc:
                    self._send(peer, failed(0, exc))
                    return None
                if isinstance(views, Overflow):
                    overflow, views = views, views.frames
                frames = [LocalFrame(view) for view in views]
                owner = peer.name
            answer = self._requests.handle(peer, owner, frames, overflow)
            if answer is None:  # an error reply held back or dropped (refusals.py)
                return None
            if not isinstance(answer, Answer):
                later = answer
                return lambda: self._answer_later(peer, later, source)
            self._send(peer, answer, source)
        except Exception:  # a reply that cannot be sent must not end the loop
            logger.exception("failed to answer a ZMQ request")
        return None

    async def _answer_later(
        self, peer: Peer, later: Callable[[], Awaitable[Answer]], source: zmq.Frame | None
    ) -> None:
        self._send(peer, await later(), source)

    def _local_closed(self, conn: LocalConnection) -> None:
        """A local-channel client is gone: release its reservations and pins now, rather
        than when their leases expire (once its lane, if any, has ended)."""
        if self._local is None:  # stopping: the service rolls everything back itself
            self._requests.forget_local()
            _close(conn.take_pidfd())
        elif conn not in self._lanes:
            self._release_local(conn)

    def _release_local(self, conn: LocalConnection) -> None:
        """``conn`` closed and its lane is done: release its clients' leases once its process
        has exited; keep them while it lives (``local_exits.py``)."""
        pidfd = conn.take_pidfd()
        if self._local is None:  # stopping: everything is rolled back anyway
            _close(pidfd)
            self._released(conn)
            return
        self._exits.closed(pidfd, lambda: self._released(conn), lambda: self._kept(conn))

    def _released(self, conn: LocalConnection) -> None:
        for client, released in self._requests.release_local(conn):
            logger.info(
                "released %d lease(s) of %s: its connection closed, its process exited",
                released,
                client,
            )

    def _kept(self, conn: LocalConnection) -> None:
        for client in self._requests.forget_connection(conn):
            if held := self._service.num_leases_of(client):
                logger.info(
                    "kept %d lease(s) of %s: its connection closed, but its process is alive "
                    "(they end when completed, released, or at their deadline)",
                    held,
                    client,
                )

    def _send(self, peer: Peer, answer: Answer, source: zmq.Frame | None = None) -> None:
        """Send the reply now (neither a ROUTER nor a local send blocks); after a ROUTER send
        outside the reader callback, make sure messages that arrived meanwhile are read.
        ``source``: a frame of the request (its ``SRCFD`` names the connection a zero-copy
        reply's send timeout cuts)."""
        req_id, result = answer.req_id, answer.result
        if not isinstance(peer, bytes):
            if answer.error is not None:
                peer.send([wire.encode_error(req_id, self._sid, *answer.error)])
            elif isinstance(result, Parts):  # copied: the transport may write them later
                peer.send(self._sender.copy_out(req_id, self._sid, result))
            else:
                assert result is not None  # an Answer holds a result or an error
                peer.send([self._encoded(req_id, result)])
            return
        raw = self._raw
        if raw is None:  # stopping: the socket is gone
            return
        if answer.error is not None:
            raw.send_multipart([peer, wire.encode_error(req_id, self._sid, *answer.error)])
        elif isinstance(result, Parts):
            fd = source.get(zmq.SRCFD) if source is not None else -1
            self._sender.send(raw, peer, req_id, self._sid, result, fd)
        else:
            assert result is not None  # an Answer holds a result or an error
            raw.send_multipart([peer, self._encoded(req_id, result)])
        if not self._reading:
            self._schedule_drain()

    def _encoded(self, req_id: int, result: Mapping[str, Any]) -> bytes:
        """``result``'s reply header, or, when it cannot be encoded (a daemon bug: a value
        msgpack refuses), an ``internal`` error for ``req_id``, so that the caller is answered
        at once rather than left to its timeout."""
        try:
            return wire.encode_reply(req_id, self._sid, result)
        except Exception as exc:  # any encoder failure is answered
            logger.exception("the reply to request %d could not be encoded", req_id)
            message = f"internal error: the reply could not be encoded ({type(exc).__name__})"
            return wire.encode_error(req_id, self._sid, "internal", message)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
