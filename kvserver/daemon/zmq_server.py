"""The daemon's ZMQ front end: the data-plane ROUTER and the KV-event PUB.

Runs in the daemon process, on its one event loop (uvloop in production; zmq.asyncio watches the
sockets' file descriptors with ``add_reader``, which every asyncio loop provides). Not
thread-safe: one instance per daemon, used from the loop only.

Call order: ``start()`` (bind both sockets, start the receive loop and the event publisher) →
serving → ``stop()`` (stop reading, close sockets with linger 0, release send pins).

One receive loop handles one message at a time; every handler is a synchronous call into
:class:`~kvserver.daemon.service.KVService`, so requests are applied in arrival order. The
exception is a load (``prepare_load``, ``get``) of chunks that are only on SSD: its handler
returns a coroutine that first awaits their promotion (disk reads run on the SSD tier's threads,
the loop keeps serving gRPC and events meanwhile), and the next request is read after it.
A ``get`` whose chunks DRAM cannot take is answered from the verified SSD bytes directly. Every
request gets exactly one reply — an error reply (request id 0 when the header is unreadable)
for anything malformed, unauthenticated, too large or refused; an unexpected exception is
logged and answered ``internal``. The loop never dies on input.

Zero-copy loads: ``get``/``read_parts`` replies reference the arena pages themselves. Large
parts (>= zmq.COPY_THRESHOLD) go out as tracked frames under a pin of our own (a load lease of
client ``ZMQ_SEND_CLIENT``) that is released only once ZMQ reports it has finished with every
frame. The tracker is a ``threading.Event`` set by pyzmq's gc thread, so it is polled with a
short exponential backoff rather than awaited.

A request with an empty first frame and an 8-byte second frame is vLLM's replay request
(``[b"", start_seq]``): it is answered with ``[b"", seq, payload]`` per retained batch and the
end marker ``[b"", -1, b""]`` — the same protocol as vLLM's replay ROUTER, on the data port.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from kvserver import wire
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.eventlog import EventGap
from kvserver.daemon.service import KVService
from kvserver.errors import InvalidArgument, KVServerError, Unauthenticated
from kvserver.events import Event
from kvserver.namespace import NamespaceSpec

logger = logging.getLogger(__name__)

#: lease owner of the pins that guard in-flight zero-copy sends.
ZMQ_SEND_CLIENT = "kvserver-zmq-send"
#: replay answers at most this many batches / bytes per request (ask again from the last seq).
REPLAY_MAX_BATCHES = 10_000
REPLAY_MAX_BYTES = 64 << 20
PUB_HWM = 100_000
ROUTER_SNDHWM = REPLAY_MAX_BATCHES + 100
_TRACKER_POLL_S = (0.0005, 0.02)  # first and largest poll interval


@dataclass(slots=True)
class _Call:
    """One validated request as a handler sees it."""

    args: dict[str, Any]
    frames: list[zmq.Frame]  # payload frames (after the header)
    client: str  # lease owner: the header's "client", else the ROUTER routing id


@dataclass(slots=True)
class _Parts:
    """A reply with payload: key-major parts (each a list of arena views) under a send pin."""

    result: dict[str, Any]
    parts: list[list[memoryview]]
    guard: int


_Result = dict[str, Any] | _Parts


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
        self._guards: set[int] = set()
        self._topics: dict[str, tuple[bytes, int]] = {}
        self._pod = socket.gethostname()
        svc = service
        self._handlers: dict[str, Callable[[_Call], _Result | Awaitable[_Result]]] = {
            wire.HELLO: self._hello,
            wire.REGISTER_NAMESPACE: lambda c: svc.register_namespace(
                NamespaceSpec.from_dict(c.args["spec"])
            ),
            wire.NAMESPACES: lambda c: {"namespaces": [s.to_dict() for s in svc.list_namespaces()]},
            wire.LOOKUP: self._lookup,
            wire.LOOKUP_TOKENS: self._lookup_tokens,
            wire.TOUCH: lambda c: _done(svc.touch, c.args["ns_id"], c.args["keys"]),
            wire.PREPARE_STORE: self._prepare_store,
            wire.COMPLETE_STORE: self._complete_store,
            wire.PREPARE_LOAD: self._prepare_load,
            wire.COMPLETE_LOAD: lambda c: _done(svc.complete_load, c.args["lease_id"]),
            wire.PUT: self._put,
            wire.GET: self._get,
            wire.WRITE_PARTS: self._write_parts,
            wire.READ_PARTS: self._read_parts,
            wire.PIN: lambda c: {
                "count": svc.pin(c.args["ns_id"], c.args["keys"], c.args["ttl_s"])
            },
            wire.UNPIN: lambda c: {"count": svc.unpin(c.args["ns_id"], c.args["keys"])},
            wire.STATS: lambda c: svc.stats(),
            wire.RELEASE: lambda c: {"released": svc.release_client(c.client)},
        }

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
        self._pod = f"{socket.gethostname()}:{data_port}"
        self._spawn(self._serve())
        if self._pub is not None:
            self._spawn(self._publish_events())
        return data_port, pub_port

    async def stop(self) -> None:
        """Stop reading, close both sockets (linger 0), release send pins. Idempotent."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._router, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._pub = None
        if self._ctx is not None:
            self._ctx.term()  # every socket is closed: returns at once, frees queued frames
            self._ctx = None
        for lease_id in list(self._guards):
            self._release_guard(lease_id)

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ receive loop

    async def _serve(self) -> None:
        router = self._router
        assert router is not None
        while True:
            try:
                msg = await router.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if router.closed or exc.errno == zmq.ETERM:
                    return
                logger.warning("ZMQ receive failed: %s", exc)
                continue
            try:
                await self._dispatch(router, msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # a reply that cannot be sent must not end the loop
                logger.exception("failed to answer a ZMQ request")

    async def _dispatch(self, router: zmq.asyncio.Socket, msg: list[zmq.Frame]) -> None:
        ident, frames = msg[0].bytes, msg[1:]
        if len(frames) == 2 and len(frames[0]) == 0 and len(frames[1]) == wire.SEQ_BYTES:
            await self._replay(router, ident, frames[1].bytes)
            return
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
            out = self._handlers[req.op](_Call(req.args, frames[1:], req.client or ident.hex()))
            if inspect.isawaitable(out):
                out = await out
        except KVServerError as exc:
            await self._send_error(router, ident, req_id, exc.code, str(exc))
            return
        except Exception as exc:
            logger.exception("internal error handling request %d", req_id)
            await self._send_error(router, ident, req_id, "internal", f"internal error: {exc!r}")
            return
        if isinstance(out, _Parts):
            await self._send_parts(router, ident, req_id, out)
        else:
            await router.send_multipart([ident, wire.encode_reply(req_id, self._sid, out)])

    async def _send_error(
        self, router: zmq.asyncio.Socket, ident: bytes, req_id: int, code: str, message: str
    ) -> None:
        await router.send_multipart([ident, wire.encode_error(req_id, self._sid, code, message)])

    def _check_auth(self, req: wire.Request) -> None:
        token = self._config.auth_token.encode()
        if token and not (req.auth is not None and hmac.compare_digest(req.auth.encode(), token)):
            raise Unauthenticated("missing or wrong auth token")

    # ------------------------------------------------------------------ handlers

    def _hello(self, c: _Call) -> _Result:
        extra = {
            "client": c.client,
            "sid": self._sid,
            "protocol_version": wire.PROTOCOL_VERSION,
            "max_message_bytes": self._config.max_message_bytes,
        }
        return self._service.hello() | extra

    def _lookup(self, c: _Call) -> _Result:
        a = c.args
        record, touch = a["record"] is True, a["touch"] is True
        r = self._service.lookup(a["ns_id"], a["keys"], record=record, touch=touch)
        return {name: getattr(r, name) for name in wire.LOOKUP_FIELDS}

    def _lookup_tokens(self, c: _Call) -> _Result:
        a = c.args
        lora = (a["lora"][0], a["lora"][1]) if a["lora"] is not None else None
        salt = a["cache_salt"]
        r = self._service.lookup_tokens(a["ns_id"], a["token_ids"], cache_salt=salt, lora=lora)
        return {name: getattr(r, name) for name in wire.LOOKUP_FIELDS}

    def _prepare_store(self, c: _Call) -> _Result:
        a = c.args
        grant = self._service.prepare_store(
            a["ns_id"], a["keys"], client=c.client, lease_s=a["lease_s"]
        )
        return {"grant": None if grant is None else wire.grant_to_wire(grant, time.monotonic())}

    def _complete_store(self, c: _Call) -> _Result:
        a = c.args
        ready = self._service.complete_store(
            a["lease_id"], success=a["success"] is not False, ranks=a["ranks"], keys=a["keys"]
        )
        return {"ready": ready}

    def _prepare_load(self, c: _Call) -> _Result | Awaitable[_Result]:
        if self._service.needs_promotion(c.args["ns_id"], c.args["keys"]):
            return self._promote_then(c, self._prepare_load_now)
        return self._prepare_load_now(c)

    async def _promote_then(self, c: _Call, then: Callable[[_Call], _Result]) -> _Result:
        await self._service.promote(c.args["ns_id"], c.args["keys"])
        return then(c)

    def _prepare_load_now(self, c: _Call) -> _Result:
        a = c.args
        grant = self._service.prepare_load(
            a["ns_id"], a["keys"], client=c.client, lease_s=a["lease_s"]
        )
        return {"grant": wire.grant_to_wire(grant, time.monotonic())}

    def _put(self, c: _Call) -> _Result:
        """Store whole entries in one round trip: len(keys) x tp frames, key-major."""
        ns_id, keys = c.args["ns_id"], c.args["keys"]
        spec = self._service.engine.namespace(ns_id)
        tp = spec.tp_world_size
        if len(set(keys)) != len(keys):
            raise InvalidArgument("put: duplicate keys")
        _check_frames(c.frames, len(keys) * tp, spec.part_bytes)
        grant = self._service.prepare_store(ns_id, keys, client=c.client, lease_s=c.args["lease_s"])
        if grant is None:
            return {"stored": [], "present": [], "filtered": [], "rejected": True}
        stored: list[bytes] = []
        if grant.keys:
            index = {key: i for i, key in enumerate(keys)}
            try:
                for key in grant.keys:
                    for rank in range(tp):
                        frame = c.frames[index[key] * tp + rank]
                        self._service.write_part(grant.lease_id, key, rank, frame.buffer)
            except BaseException:
                self._service.complete_store(grant.lease_id, success=False)
                raise
            stored = self._service.complete_store(grant.lease_id, success=True)
        return {
            "stored": stored,
            "present": grant.present,
            "filtered": grant.filtered,
            "rejected": False,
        }

    def _write_parts(self, c: _Call) -> _Result:
        """One rank's parts into an existing store lease (TP by rank over the network)."""
        lease_id, keys, rank = c.args["lease_id"], c.args["keys"], c.args["rank"]
        _check_frames(c.frames, len(keys), None)
        for key, frame in zip(keys, c.frames, strict=True):
            self._service.write_part(lease_id, key, rank, frame.buffer)
        ready: list[bytes] = []
        if c.args["complete"] is not False:
            ready = self._service.complete_store(lease_id, ranks=[rank], keys=keys)
        return {"ready": ready}

    def _get(self, c: _Call) -> _Result | Awaitable[_Result]:
        """Pin ``keys`` (every one must be ready) and send the parts of ``ranks``."""
        ns_id, keys = c.args["ns_id"], c.args["keys"]
        tp = self._service.engine.namespace(ns_id).tp_world_size
        ranks = c.args["ranks"] if c.args["ranks"] is not None else list(range(tp))
        for rank in ranks:
            if not rank < tp:
                raise InvalidArgument("rank out of range", rank=rank, tp_world_size=tp)
        if self._service.needs_promotion(ns_id, keys):
            return self._get_promoting(ns_id, keys, ranks)
        return self._get_now(ns_id, keys, ranks, {})

    async def _get_promoting(self, ns_id: str, keys: list[bytes], ranks: list[int]) -> _Result:
        direct = await self._service.promote(ns_id, keys, direct=True)
        return self._get_now(ns_id, keys, ranks, direct)

    def _get_now(
        self,
        ns_id: str,
        keys: list[bytes],
        ranks: list[int],
        direct: dict[bytes, list[memoryview]],
    ) -> _Result:
        """Parts from the arena under a send pin, except ``direct`` ones (read from SSD)."""
        in_dram = [k for k in keys if k not in direct] if direct else keys
        guard = self._pin_for_send(ns_id, in_dram) if in_dram or not direct else 0
        try:
            parts = [
                [direct[k][r]] if k in direct else self._service.read_part(guard, k, r)
                for k in keys
                for r in ranks
            ]
        except BaseException:
            self._release_guard(guard)
            raise
        return _Parts({"keys": keys, "ranks": ranks}, parts, guard)

    def _read_parts(self, c: _Call) -> _Result:
        """One rank's parts of a load lease the caller holds (it must cover ``keys``)."""
        lease_id, keys, rank = c.args["lease_id"], c.args["keys"], c.args["rank"]
        parts = [self._service.read_part(lease_id, key, rank) for key in keys]
        guard = self._pin_for_send(c.args["ns_id"], keys)  # the lease may end before the send
        return _Parts({"keys": keys, "ranks": [rank]}, parts, guard)

    # ------------------------------------------------------------------ zero-copy sends

    def _pin_for_send(self, ns_id: str, keys: list[bytes]) -> int:
        lease_s = self._service.engine.config.max_lease_s
        grant = self._service.prepare_load(ns_id, keys, client=ZMQ_SEND_CLIENT, lease_s=lease_s)
        self._guards.add(grant.lease_id)
        return grant.lease_id

    def _release_guard(self, lease_id: int) -> None:
        if lease_id in self._guards:
            self._guards.discard(lease_id)
            try:
                self._service.complete_load(lease_id)
            except KVServerError as exc:  # expired (a send stuck for max_lease_s) or closed
                logger.warning("send pin %d: %s", lease_id, exc)

    async def _send_parts(
        self, router: zmq.asyncio.Socket, ident: bytes, req_id: int, reply: _Parts
    ) -> None:
        """Send arena views: large ones zero-copy and tracked, released once ZMQ is done."""
        out: list[Any] = []
        tracked: list[zmq.Frame] = []
        result, parts, guard = reply.result, reply.parts, reply.guard
        for views in parts:
            for view in views:
                if view.nbytes >= zmq.COPY_THRESHOLD:
                    frame = zmq.Frame(view, copy=False, track=True)
                    tracked.append(frame)
                    out.append(frame)
                else:
                    out.append(bytes(view))
        if any(len(views) != 1 for views in parts):
            result["part_frames"] = [len(views) for views in parts]
        header = wire.encode_reply(req_id, self._sid, result)
        try:
            await router.send_multipart([ident, header, *out], copy=False)
        finally:
            if tracked:
                self._spawn(self._release_when_sent(zmq.MessageTracker(*tracked), guard))
            else:
                self._release_guard(guard)

    async def _release_when_sent(self, tracker: zmq.MessageTracker, guard: int) -> None:
        delay, longest = _TRACKER_POLL_S
        try:
            while not tracker.done:
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)
        finally:
            # on cancellation (stop) the sockets close with linger 0 right after: ZMQ drops
            # the frames, so releasing here is safe too.
            self._release_guard(guard)

    # ------------------------------------------------------------------ events

    async def _publish_events(self) -> None:
        events = self._service.events
        next_seq = events.last_seq + 1
        while True:
            try:
                async for event in events.follow(next_seq):
                    await self._publish(event)
                    next_seq = event.seq + 1
                return  # the event log was closed
            except EventGap as gap:
                logger.warning("event publisher fell behind: %s", gap)
                next_seq = gap.oldest

    async def _publish(self, event: Event) -> None:
        pub = self._pub
        assert pub is not None
        try:
            topic, payload = self._encode_event(event, time.time())
            await pub.send_multipart([topic, wire.seq_bytes(event.seq), payload])
        except (KVServerError, zmq.ZMQError) as exc:  # a lost event is counted by its seq gap
            logger.warning("cannot publish event %d: %s", event.seq, exc)

    def _encode_event(self, event: Event, ts: float) -> tuple[bytes, bytes]:
        meta = self._topics.get(event.ns_id)
        if meta is None:
            spec = self._service.engine.namespace(event.ns_id)
            meta = (wire.event_topic(f"{self._pod}/{event.ns_id}", spec.model), spec.chunk_tokens)
            self._topics[event.ns_id] = meta
        topic, block_size = meta
        return topic, wire.encode_event_batch(ts, [wire.event_to_vllm(event, block_size)])

    async def _replay(self, router: zmq.asyncio.Socket, ident: bytes, start: bytes) -> None:
        """vLLM's replay protocol: every retained batch with seq >= start, then the end mark."""
        events = self._service.events
        start_seq = int.from_bytes(start, "big")
        try:
            batch = events.replay(start_seq)
        except EventGap as gap:
            batch = events.replay(gap.oldest)
        sent_bytes, now = 0, time.time()  # replayed batches carry the replay time as ts
        for event in batch[:REPLAY_MAX_BATCHES]:
            _topic, payload = self._encode_event(event, now)
            await router.send_multipart([ident, b"", wire.seq_bytes(event.seq), payload])
            sent_bytes += len(payload)
            if sent_bytes > REPLAY_MAX_BYTES:
                break
        await router.send_multipart([ident, b"", wire.REPLAY_END_SEQ, b""])


def _done(fn: Callable[..., None], *args: Any) -> dict[str, Any]:
    fn(*args)
    return {}


def _check_frames(frames: list[zmq.Frame], expected: int, part_bytes: int | None) -> None:
    if len(frames) != expected:
        raise InvalidArgument(
            "wrong number of payload frames", frames=len(frames), expected=expected
        )
    if part_bytes is not None:
        for i, frame in enumerate(frames):
            if len(frame) != part_bytes:
                raise InvalidArgument(
                    "payload size does not match the slot",
                    frame=i,
                    size=len(frame),
                    part_bytes=part_bytes,
                )


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
