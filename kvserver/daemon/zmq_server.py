"""The daemon's ZMQ front end: the data-plane ROUTER and the KV-event PUB.

Runs in the daemon process, on its one event loop (uvloop in production; zmq.asyncio watches the
sockets' file descriptors with ``add_reader``, which every asyncio loop provides). Not
thread-safe: one instance per daemon, used from the loop only.

Call order: ``start()`` (bind both sockets, start the receive loop and the event publisher) →
serving → ``stop()`` (stop reading, close sockets with linger 0, release send pins).

Modules: this one reads, checks and answers requests (the receive loop, per-connection order,
replies); ``zmq_ops.py`` carries out each op; ``zmq_send.py`` sends payload replies zero-copy
under pins; ``zmq_events.py`` publishes KV events and serves vLLM's replay protocol.

One receive loop reads one message at a time and answers it before reading the next: every
handler is a synchronous call into :class:`~kvserver.daemon.service.KVService`, so requests are
applied in arrival order. The exception is a load (``prepare_load``, ``get``) naming chunks
that are only on SSD: its handler returns a ``Deferred``, and the rest of that request —
promotion (disk reads on the SSD tier's threads), then the load, then the reply — runs as a
task of its own, a *lane*, while the loop goes on reading. Order per connection (ROUTER routing
id) is kept: until the lane has answered, every later message of that connection is queued on
the lane and handled there, in order, after it (a ``complete_load`` or ``release`` never
overtakes the load before it, and replies leave in request order); other connections are
served by the loop meanwhile. The lane ends once its queue is empty; the queue holds what its
connection sends meanwhile, as the ROUTER's receive buffer would have (``stop`` drops it). How
many promotions read at once, and that a chunk is promoted once however many requests want it,
is the SSD tier's business (``promotion.Promotions``).

Every request gets exactly one reply — an error reply (request id 0 when the header is
unreadable) for anything malformed, unauthenticated, too large or refused; an unexpected
exception is logged and answered ``internal``. The loop never dies on input.

A request with an empty first frame and an 8-byte second frame is vLLM's replay request
(``[b"", start_seq]``, ``zmq_events.py``); it is ordered like any other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from kvserver import wire
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.service import KVService
from kvserver.daemon.zmq_events import REPLAY_MAX_BATCHES, EventPublisher
from kvserver.daemon.zmq_ops import Call, Deferred, Result, ZmqOps
from kvserver.daemon.zmq_send import Parts, ZeroCopySender
from kvserver.errors import InvalidArgument, KVServerError, Unauthenticated

logger = logging.getLogger(__name__)

PUB_HWM = 100_000
ROUTER_SNDHWM = REPLAY_MAX_BATCHES + 100


@dataclass(slots=True)
class _Answer:
    """What to reply to one request: ``result``, or the error ``(code, message)``."""

    req_id: int
    result: Result | None = None
    error: tuple[str, str] | None = None


#: the rest of a request that waits for promotion (run by its connection's lane).
_Later = Callable[[], Awaitable[_Answer]]


class ZmqFrontend:
    """Serves the ZMQ data plane and publishes KV events; see the module docstring."""

    def __init__(self, service: KVService, config: DaemonConfig) -> None:
        self._service = service
        self._config = config
        self._sid = secrets.token_hex(8)  # changes on every daemon start
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: routing id → messages waiting behind that connection's deferred request
        self._lanes: dict[bytes, deque[list[zmq.Frame]]] = {}
        self._sender = ZeroCopySender(service)
        self._ops = ZmqOps(service, config, self._sid, self._sender)
        self._events = EventPublisher(service)

    @property
    def num_lanes(self) -> int:
        """Connections whose requests wait for a promotion."""
        return len(self._lanes)

    # ------------------------------------------------------------------ lifetime

    async def start(self) -> tuple[int, int]:
        """Bind ROUTER (and PUB unless pub_port is -1); returns (data_port, pub_port or -1)."""
        cfg = self._config
        self._ctx = zmq.asyncio.Context()
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
            self._router.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
            data_port = _bind(self._router, cfg.host, cfg.zmq_port)
            pub_port = -1
            if cfg.pub_port >= 0:
                self._pub = self._ctx.socket(zmq.PUB)
                self._pub.setsockopt(zmq.LINGER, 0)
                self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
                pub_port = _bind(self._pub, cfg.host, cfg.pub_port)
        except BaseException:
            await self.stop()
            raise
        self._events.set_pod(data_port)
        self._spawn(self._serve(self._router))
        if self._pub is not None:
            self._spawn(self._events.publish_forever(self._pub))
        return data_port, pub_port

    async def stop(self) -> None:
        """Stop reading (and drop the requests lanes still hold), close both sockets (linger
        0), release send pins. Idempotent."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._lanes.clear()
        await self._sender.close()
        for sock in (self._router, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._pub = None
        if self._ctx is not None:
            self._ctx.term()  # every socket is closed: returns at once, frees queued frames
            self._ctx = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ receive loop

    async def _serve(self, router: zmq.asyncio.Socket) -> None:
        while True:
            try:
                msg = await router.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if router.closed or exc.errno == zmq.ETERM:
                    return
                logger.warning("ZMQ receive failed: %s", exc)
                continue
            ident = msg[0].bytes
            lane = self._lanes.get(ident)
            if lane is not None:  # this connection waits for a promotion: keep its order
                lane.append(msg)
                continue
            later = await self._serve_one(router, ident, msg)
            if later is not None:
                self._lanes[ident] = deque()
                self._spawn(self._run_lane(router, ident, later))

    async def _run_lane(self, router: zmq.asyncio.Socket, ident: bytes, later: _Later) -> None:
        """Finish ``later``, then the connection's queued messages in order; see the module
        docstring. Ends (and the loop takes the connection back) once the queue is empty."""
        queue = self._lanes[ident]
        pending: _Later | None = later
        try:
            while pending is not None:
                await self._answer(router, ident, pending)
                pending = None
                while queue and pending is None:
                    pending = await self._serve_one(router, ident, queue.popleft())
            # the queue is empty and nothing is awaited before the lane is removed below
        finally:
            if self._lanes.get(ident) is queue:
                del self._lanes[ident]

    async def _serve_one(
        self, router: zmq.asyncio.Socket, ident: bytes, msg: list[zmq.Frame]
    ) -> _Later | None:
        """Handle one message: answer it now and return None, or return the rest of it."""
        try:
            frames = msg[1:]
            if len(frames) == 2 and len(frames[0]) == 0 and len(frames[1]) == wire.SEQ_BYTES:
                await self._events.replay(router, ident, frames[1].bytes)
                return None
            answer = self._handle(ident, frames)
            if not isinstance(answer, _Answer):
                return answer
            await self._send(router, ident, answer)
        except asyncio.CancelledError:
            raise
        except Exception:  # a reply that cannot be sent must not end the loop
            logger.exception("failed to answer a ZMQ request")
        return None

    async def _answer(self, router: zmq.asyncio.Socket, ident: bytes, later: _Later) -> None:
        try:
            await self._send(router, ident, await later())
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("failed to answer a ZMQ request")

    def _handle(self, ident: bytes, frames: list[zmq.Frame]) -> _Answer | _Later:
        req_id = 0
        try:
            total = sum(len(f) for f in frames)
            limit = self._config.max_message_bytes
            if total > limit:
                raise InvalidArgument("message too large", size=total, max=limit)
            if not frames:
                raise InvalidArgument("empty message")
            obj = wire.unpack_header(frames[0].buffer)
            req_id = wire.request_id_of(obj)
            req = wire.parse_request(obj)
            self._check_auth(req)
            if req.op not in wire.OPS_WITH_PAYLOAD and len(frames) > 1:
                raise InvalidArgument(f"{req.op} takes no payload frames", frames=len(frames) - 1)
            out = self._ops.handle(req.op, Call(req.args, frames[1:], req.client or ident.hex()))
        except Exception as exc:
            return _failed(req_id, exc)
        if isinstance(out, Deferred):
            return lambda: _finish(req_id, out)
        return _Answer(req_id, out)

    async def _send(self, router: zmq.asyncio.Socket, ident: bytes, answer: _Answer) -> None:
        req_id, result = answer.req_id, answer.result
        if answer.error is not None:
            code, message = answer.error
            header = wire.encode_error(req_id, self._sid, code, message)
            await router.send_multipart([ident, header])
        elif isinstance(result, Parts):
            await self._sender.send(router, ident, req_id, self._sid, result)
        else:
            assert result is not None  # an _Answer holds a result or an error
            await router.send_multipart([ident, wire.encode_reply(req_id, self._sid, result)])

    def _check_auth(self, req: wire.Request) -> None:
        token = self._config.auth_token.encode()
        if token and not (req.auth is not None and hmac.compare_digest(req.auth.encode(), token)):
            raise Unauthenticated("missing or wrong auth token")


async def _finish(req_id: int, deferred: Deferred) -> _Answer:
    try:
        return _Answer(req_id, await deferred.run())
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return _failed(req_id, exc)


def _failed(req_id: int, exc: Exception) -> _Answer:
    """The error reply for ``exc``: its code when it is a KVServerError, else ``internal``."""
    if isinstance(exc, KVServerError):
        return _Answer(req_id, error=(exc.code, str(exc)))
    logger.error("internal error handling request %d", req_id, exc_info=exc)
    return _Answer(req_id, error=("internal", f"internal error: {exc!r}"))


def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    endpoint = f"tcp://{host}:{port}"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise KVServerError(f"cannot bind {endpoint}: {exc}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(bound.rsplit(":", 1)[1])
