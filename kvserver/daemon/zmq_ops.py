"""The data-plane operations of the ZMQ front end: one handler per wire op (``docs/wire.md`` §2).

Runs in the daemon process, on its event loop; called by :mod:`kvserver.daemon.zmq_server` with
a request already read, size-checked, authenticated and validated by ``wire.parse_request``.
Not thread-safe: loop only.

Every handler is a synchronous call into :class:`~kvserver.daemon.service.KVService` that
returns the reply's result map, or a :class:`~kvserver.daemon.zmq_send.Parts` for replies with
payload. The exception is a load (``prepare_load``, ``get``) naming chunks that are only on SSD:
its handler returns a :class:`Deferred` instead — the rest of the work, to run (in a task of
the front end's) after their promotion — so the front end can serve other connections while
the disk is read. A ``get`` whose chunks DRAM cannot take is answered from the verified SSD
bytes directly. Handlers raise ``KVServerError`` for refused requests (nothing changed then).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserver import wire, wire_local
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.service import KVService
from kvserver.daemon.zmq_send import Parts, ZeroCopySender
from kvserver.errors import InvalidArgument
from kvserver.namespace import NamespaceSpec


class PayloadFrame(Protocol):
    """A received frame: a ``zmq.Frame``, or a frame of the local channel."""

    @property
    def buffer(self) -> memoryview: ...

    def __len__(self) -> int: ...


@dataclass(slots=True)
class Call:
    """One validated request as a handler sees it."""

    args: dict[str, Any]
    frames: Sequence[PayloadFrame]  # payload frames (after the header)
    client: str  # lease owner: the header's "client", else the ROUTER routing id


Result = dict[str, Any] | Parts


@dataclass(slots=True)
class Deferred:
    """A request that must wait for SSD promotion: ``run()`` promotes, then answers."""

    run: Callable[[], Awaitable[Result]]


class ZmqOps:
    """The handlers of one front end; see the module docstring."""

    def __init__(
        self, service: KVService, config: DaemonConfig, sid: str, sender: ZeroCopySender
    ) -> None:
        self._service = service
        self._config = config
        self._sid = sid
        self._sender = sender
        #: the local channel's socket, announced by ``hello`` (set by the front end).
        self.local_path: str | None = None
        svc = service
        self._handlers: dict[str, Callable[[Call], Result | Deferred]] = {
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

    def handle(self, op: str, call: Call) -> Result | Deferred:
        """Carry out ``op`` (a valid op name) now, or return the rest of it as a Deferred.
        Its time (a Deferred's until its answer) goes to ``service.op_seconds``."""
        timer = self._service.op_seconds.labels(op)
        start = time.perf_counter()
        out = self._handlers[op](call)
        if not isinstance(out, Deferred):
            timer.observe(time.perf_counter() - start)
            return out
        run = out.run

        async def timed() -> Result:
            try:
                return await run()
            finally:
                timer.observe(time.perf_counter() - start)

        return Deferred(timed)

    def _hello(self, c: Call) -> Result:
        extra = {
            "client": c.client,
            "sid": self._sid,
            "protocol_version": wire.PROTOCOL_VERSION,
            "max_message_bytes": self._config.max_message_bytes,
            "local_path": self.local_path,
            "local_version": wire_local.LOCAL_VERSION if self.local_path else None,
        }
        return self._service.hello() | extra

    def _lookup(self, c: Call) -> Result:
        a = c.args
        record, touch = a["record"] is True, a["touch"] is True
        r = self._service.lookup(a["ns_id"], a["keys"], record=record, touch=touch)
        return {name: getattr(r, name) for name in wire.LOOKUP_FIELDS}

    def _lookup_tokens(self, c: Call) -> Result:
        a = c.args
        lora = (a["lora"][0], a["lora"][1]) if a["lora"] is not None else None
        salt = a["cache_salt"]
        r = self._service.lookup_tokens(a["ns_id"], a["token_ids"], cache_salt=salt, lora=lora)
        return {name: getattr(r, name) for name in wire.LOOKUP_FIELDS}

    def _prepare_store(self, c: Call) -> Result:
        a = c.args
        grant = self._service.prepare_store(
            a["ns_id"], a["keys"], client=c.client, lease_s=a["lease_s"]
        )
        return {"grant": None if grant is None else wire.grant_to_wire(grant, time.monotonic())}

    def _complete_store(self, c: Call) -> Result:
        a = c.args
        ready = self._service.complete_store(
            a["lease_id"], success=a["success"] is not False, ranks=a["ranks"], keys=a["keys"]
        )
        return {"ready": ready}

    def _prepare_load(self, c: Call) -> Result | Deferred:
        if self._service.needs_promotion(c.args["ns_id"], c.args["keys"]):
            return Deferred(lambda: self._promote_then_prepare_load(c))
        return self._prepare_load_now(c)

    async def _promote_then_prepare_load(self, c: Call) -> Result:
        await self._service.promote(c.args["ns_id"], c.args["keys"])
        return self._prepare_load_now(c)

    def _prepare_load_now(self, c: Call) -> Result:
        a = c.args
        grant = self._service.prepare_load(
            a["ns_id"], a["keys"], client=c.client, lease_s=a["lease_s"]
        )
        return {"grant": wire.grant_to_wire(grant, time.monotonic())}

    def _put(self, c: Call) -> Result:
        """Store whole entries in one round trip: len(keys) x tp frames, key-major."""
        ns_id, keys = c.args["ns_id"], c.args["keys"]
        spec = self._service.engine.namespace(ns_id)
        tp = spec.tp_world_size
        if len(set(keys)) != len(keys):
            raise InvalidArgument("put: duplicate keys")
        check_frames(c.frames, len(keys) * tp, spec.part_bytes)
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

    def _write_parts(self, c: Call) -> Result:
        """One rank's parts into an existing store lease (TP by rank over the network)."""
        lease_id, keys, rank = c.args["lease_id"], c.args["keys"], c.args["rank"]
        check_frames(c.frames, len(keys), None)
        for key, frame in zip(keys, c.frames, strict=True):
            self._service.write_part(lease_id, key, rank, frame.buffer)
        ready: list[bytes] = []
        if c.args["complete"] is not False:
            ready = self._service.complete_store(lease_id, ranks=[rank], keys=keys)
        return {"ready": ready}

    def _get(self, c: Call) -> Result | Deferred:
        """Pin ``keys`` (every one must be ready, unless ``leading``: then the leading run of
        those held here) and send the parts of ``ranks``."""
        ns_id, keys = c.args["ns_id"], c.args["keys"]
        tp = self._service.engine.namespace(ns_id).tp_world_size
        ranks = c.args["ranks"] if c.args["ranks"] is not None else list(range(tp))
        for rank in ranks:
            if not rank < tp:
                raise InvalidArgument("rank out of range", rank=rank, tp_world_size=tp)
        leading = c.args["leading"] is True
        if self._service.needs_promotion(ns_id, keys):
            return Deferred(lambda: self._promote_then_get(ns_id, keys, ranks, leading))
        if leading:
            keys = keys[: self._service.engine.lookup(ns_id, keys)]
        return self._get_now(ns_id, keys, ranks, {})

    async def _promote_then_get(
        self, ns_id: str, keys: list[bytes], ranks: list[int], leading: bool
    ) -> Result:
        direct = await self._service.promote(ns_id, keys, direct=True)
        if leading:
            engine = self._service.engine
            n = 0
            while n < len(keys) and (keys[n] in direct or engine.lookup(ns_id, keys[n : n + 1])):
                n += 1
            keys = keys[:n]
        return self._get_now(ns_id, keys, ranks, direct)

    def _get_now(
        self,
        ns_id: str,
        keys: list[bytes],
        ranks: list[int],
        direct: dict[bytes, list[memoryview]],
    ) -> Result:
        """Parts from the arena under a send pin, except ``direct`` ones (read from SSD)."""
        in_dram = [k for k in keys if k not in direct] if direct else keys
        guard = self._sender.pin(ns_id, in_dram) if in_dram or not direct else 0
        try:
            parts = [
                [direct[k][r]] if k in direct else self._service.read_part(guard, k, r)
                for k in keys
                for r in ranks
            ]
        except BaseException:
            self._sender.release(guard)
            raise
        return Parts({"keys": keys, "ranks": ranks}, parts, guard)

    def _read_parts(self, c: Call) -> Result:
        """One rank's parts of a load lease the caller holds (it must cover ``keys``)."""
        lease_id, keys, rank = c.args["lease_id"], c.args["keys"], c.args["rank"]
        parts = [self._service.read_part(lease_id, key, rank) for key in keys]
        guard = self._sender.pin(c.args["ns_id"], keys)  # the lease may end before the send
        return Parts({"keys": keys, "ranks": [rank]}, parts, guard)


def _done(fn: Callable[..., None], *args: Any) -> dict[str, Any]:
    fn(*args)
    return {}


def check_frames(frames: Sequence[PayloadFrame], expected: int, part_bytes: int | None) -> None:
    """Refuse a payload with the wrong number of frames or (when given) of the wrong size."""
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
