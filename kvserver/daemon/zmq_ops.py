"""The data-plane operations of the ZMQ front end: one handler per wire op (``docs/wire.md`` §2).

Runs in the daemon process, on its event loop; called by :mod:`kvserver.daemon.zmq_server` with
a request already read, size-checked, authenticated and validated by ``wire.parse_request``.
Not thread-safe: loop only.

Every handler is a synchronous call into :class:`~kvserver.daemon.service.KVService` that
returns the reply's result map, or a :class:`~kvserver.daemon.zmq_send.Parts` for replies with
payload. The exception is an operation that needs a lower tier's I/O (the service returns a
:class:`~kvserver.daemon.service.Pending`: a load — ``prepare_load``, ``get`` — naming chunks
that are only below DRAM, or a lookup a tier cannot answer without I/O): its handler returns a
:class:`Deferred` instead — the rest of the work, to run in a task of the front end's — so the
front end can serve other connections meanwhile; so does a ``lookup_tokens`` of more than
``HASH_OFF_LOOP_TOKENS`` tokens, hashed on a thread (``prompt_hashing.py``). A ``get`` whose
chunks DRAM cannot take is answered from the lower tier's verified bytes directly. Handlers
raise ``KVServerError`` for refused requests (nothing changed then).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserver import wire, wire_local
from kvserver.daemon.access import authorize, visible_namespaces, visible_stats
from kvserver.daemon.auth import ADMIN, Principal
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.op_labels import op_label
from kvserver.daemon.request_checks import check_parts, check_unique
from kvserver.daemon.results import Fetched, LookupHits, Pending
from kvserver.daemon.service import KVService
from kvserver.daemon.zmq_send import ZMQ_SEND_CLIENT, Parts, ZeroCopySender
from kvserver.engine.types import HashedKeys
from kvserver.errors import KVServerError
from kvserver.grants import (
    LoadGrant,
    grant_to_wire,
    packed_load_grant_to_wire,
    packed_store_grant_to_wire,
)
from kvserver.namespace import NamespaceSpec
from kvserver.prompts import unpack_token_ids

logger = logging.getLogger(__name__)


class PayloadFrame(Protocol):
    """A received frame: a ``zmq.Frame``, or a frame of the local channel."""

    @property
    def buffer(self) -> memoryview: ...

    def __len__(self) -> int: ...


@dataclass(slots=True)
class OpCall:
    """One validated request as a handler sees it."""

    args: dict[str, Any]
    frames: Sequence[PayloadFrame]  # payload frames (after the header)
    client: str  # lease owner: the header's "client", else the ROUTER routing id
    who: Principal = ADMIN  # the caller (kvserver/daemon/access.py decides what it may do)


Result = dict[str, Any] | Parts


@dataclass(slots=True)
class Deferred:
    """A request that must wait for a lower tier's I/O: ``run()`` waits, then answers."""

    run: Callable[[], Awaitable[Result]]


@dataclass(slots=True)
class Answer:
    """What the front end replies to one request: ``result``, or the error ``(code, message)``."""

    req_id: int
    result: Result | None = None
    error: tuple[str, str] | None = None


class DataOps:
    """The handlers of the data plane (ZMQ and the local channel alike); see the module
    docstring."""

    def __init__(
        self, service: KVService, config: DaemonConfig, sid: str, sender: ZeroCopySender
    ) -> None:
        self._service = service
        self._config = config
        self._sid = sid
        self._sender = sender
        #: the local channel's socket, announced by ``hello`` (set by the front end).
        self.local_path: str | None = None
        #: the peer stream's port, announced by ``hello`` (set by ``process.py``):
        #: ``peer_stream_port`` when plain, ``peer_stream_tls_port`` when TLS.
        self.peer_stream_port: int | None = None
        self.peer_stream_tls_port: int | None = None
        svc = service
        self._handlers: dict[str, Callable[[OpCall], Result | Deferred]] = {
            wire.HELLO: self._hello,
            wire.REGISTER_NAMESPACE: lambda c: svc.register_namespace(
                NamespaceSpec.from_dict(c.args["spec"])
            ),
            wire.NAMESPACES: lambda c: {
                "namespaces": [s.to_dict() for s in visible_namespaces(c.who, svc)]
            },
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
            wire.STATS: lambda c: visible_stats(c.who, svc, svc.stats()),
            wire.RELEASE: lambda c: {"released": svc.release_client(c.client)},
        }

    def handle(self, op: str, call: OpCall) -> Result | Deferred:
        """Carry out ``op`` (a valid op name) now, or return the rest of it as a Deferred.
        Its time (a Deferred's until its answer) goes to ``service.op_seconds`` under its
        ``op_labels.op_label`` (a peer's fetch: ``peer_fetch``). Raises
        PermissionDenied (nothing done) when ``call.who`` may not make it (``access.py``)."""
        authorize(call.who, self._service, op, call.args)
        timer = self._service.op_seconds.labels(op_label(op, call.args))
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

    def _hello(self, c: OpCall) -> Result:
        extra = {
            "client": c.client,
            "sid": self._sid,
            "protocol_version": wire.PROTOCOL_VERSION,
            "capabilities": list(wire.CAPABILITIES),
            "max_message_bytes": self._config.max_message_bytes,
            "local_path": self.local_path,
            "local_version": wire_local.LOCAL_VERSION if self.local_path else None,
            "peer_stream_port": self.peer_stream_port,
            "peer_stream_tls_port": self.peer_stream_tls_port,
            # a fetching daemon's windows in flight stay under it (peers/zmq_windows.py)
            "zmq_send_max_unsent": self._config.send_max_unsent,
            # a client's stream put larger than a share of it goes in windows (stream_put.py)
            "stream_put_max_reserved": self._config.stream_put_max_reserved,
        }
        return self._service.hello() | extra

    def _lookup(self, c: OpCall) -> Result | Deferred:
        a = c.args
        record, touch, local = a["record"] is True, a["touch"] is True, a["local"] is True
        return _lookup_reply(
            self._service.lookup(a["ns_id"], a["keys"], record=record, touch=touch, local=local)
        )

    def _lookup_tokens(self, c: OpCall) -> Result | Deferred:
        a = c.args
        lora = (a["lora"][0], a["lora"][1]) if a["lora"] is not None else None
        ns_id = a["ns_id"]
        token_ids = unpack_token_ids(a["token_ids"])  # a list, or packed: one copy
        keys = self._service.prompts.prompt_keys(
            ns_id, token_ids, cache_salt=a["cache_salt"], lora=lora, caller=c.who.name
        )
        if isinstance(keys, HashedKeys):
            return _lookup_reply(self._service.lookup(ns_id, keys))
        hashing = keys

        async def hash_then_lookup() -> Result:  # hashed on a thread, looked up on the loop
            r = self._service.lookup(ns_id, await hashing)
            return _lookup_fields(await r.run() if isinstance(r, Pending) else r)

        return Deferred(hash_then_lookup)

    def _prepare_store(self, c: OpCall) -> Result:
        """The reservation; with ``completions``, each applied first exactly as its own
        ``complete_store`` would be (authorized, its own result or error, never failing the
        reservation), after the namespace is checked (an unknown namespace applies nothing);
        with ``packed``, the grant in the packed form (no key echoed)."""
        a = c.args
        completed: list[dict[str, Any]] | None = None
        if a["completions"] is not None:
            self._service.namespace(a["ns_id"])
            completed = [self._complete_one(c, *done) for done in a["completions"]]
        grant = self._service.prepare_store(
            a["ns_id"], a["keys"], client=c.client, lease_s=a["lease_s"]
        )
        out: dict[str, Any] = {"grant": None}
        if grant is not None and a["packed"] is True:
            out["grant"] = packed_store_grant_to_wire(grant, a["keys"], time.monotonic())
        elif grant is not None:
            out["grant"] = grant_to_wire(grant, time.monotonic())
        if completed is not None:
            out["completions"] = completed
        return out

    def _complete_one(
        self, c: OpCall, lease_id: int, success: bool, ranks: Any, keys: Any
    ) -> dict[str, Any]:
        """One completion carried by a prepare_store: ``{ready}`` or ``{error}``."""
        try:
            authorize(c.who, self._service, wire.COMPLETE_STORE, {"lease_id": lease_id})
            ready = self._service.complete_store(lease_id, success=success, ranks=ranks, keys=keys)
        except KVServerError as exc:
            return {"error": {"code": exc.code, "message": str(exc)}}
        return {"ready": ready}

    def _complete_store(self, c: OpCall) -> Result:
        a = c.args
        ready = self._service.complete_store(
            a["lease_id"], success=a["success"] is not False, ranks=a["ranks"], keys=a["keys"]
        )
        return {"ready": ready}

    def _prepare_load(self, c: OpCall) -> Result | Deferred:
        """The pins; with ``packed``, the grant in the packed form (no key echoed)."""
        a = c.args
        check_unique("prepare_load", a["keys"])  # a grant's extents per key named
        packed = a["packed"] is True
        got = self._service.load(a["ns_id"], a["keys"], client=c.client, lease_s=a["lease_s"])
        if isinstance(got, Pending):
            pending = got

            async def finish() -> Result:
                return _load_reply(await pending.run(), packed)

            return Deferred(finish)
        return _load_reply(got, packed)

    def _put(self, c: OpCall) -> Result:
        """Store whole entries in one round trip: len(keys) x tp frames, key-major."""
        a = c.args
        r = self._service.put(
            a["ns_id"],
            a["keys"],
            [frame.buffer for frame in c.frames],
            client=c.client,
            lease_s=a["lease_s"],
        )
        return {
            "stored": r.stored,
            "present": r.present,
            "filtered": r.filtered,
            "rejected": r.rejected,
        }

    def _write_parts(self, c: OpCall) -> Result:
        """One rank's parts into an existing store lease (TP by rank over the network)."""
        lease_id, keys, rank = c.args["lease_id"], c.args["keys"], c.args["rank"]
        check_parts(c.frames, len(keys), None)
        self._service.write_parts(lease_id, keys, [rank], [frame.buffer for frame in c.frames])
        ready: list[bytes] = []
        if c.args["complete"] is not False:
            ready = self._service.complete_store(lease_id, ranks=[rank], keys=keys)
        return {"ready": ready}

    def _get(self, c: OpCall) -> Result | Deferred:
        """Pin ``keys`` (every one must be ready, unless ``leading``: then the leading run of
        those held in this daemon's own tiers) and send the parts of ``ranks``."""
        a = c.args
        got = self._service.get(
            a["ns_id"], a["keys"], a["ranks"], client=ZMQ_SEND_CLIENT, leading=a["leading"] is True
        )
        if isinstance(got, Pending):
            pending = got

            async def finish() -> Result:
                return self._get_reply(await pending.run())

            return Deferred(finish)
        return self._get_reply(got)

    def _get_reply(self, got: Fetched) -> Result:
        """The parts under a send pin (the lease ``get`` took; none for parts read from a
        lower tier's buffers)."""
        return Parts(
            {"keys": got.keys, "ranks": got.ranks}, got.parts, self._sender.adopt(got.lease_id)
        )

    def _read_parts(self, c: OpCall) -> Result:
        """One rank's parts of a load lease the caller holds (it must cover ``keys``)."""
        lease_id, keys, rank = c.args["lease_id"], c.args["keys"], c.args["rank"]
        check_unique("read_parts", keys)
        parts = [self._service.read_part(lease_id, key, rank) for key in keys]
        guard = self._sender.pin(c.args["ns_id"], keys)  # the lease may end before the send
        return Parts({"keys": keys, "ranks": [rank]}, parts, guard)


def _done(fn: Callable[..., None], *args: Any) -> dict[str, Any]:
    fn(*args)
    return {}


def _lookup_reply(r: LookupHits | Pending[LookupHits]) -> Result | Deferred:
    if isinstance(r, Pending):
        pending = r

        async def finish() -> Result:
            return _lookup_fields(await pending.run())

        return Deferred(finish)
    return _lookup_fields(r)


def _lookup_fields(r: LookupHits) -> Result:
    return {name: getattr(r, name) for name in wire.LOOKUP_FIELDS}


def _load_reply(grant: LoadGrant, packed: bool) -> Result:
    if packed:
        return {"grant": packed_load_grant_to_wire(grant, time.monotonic())}
    return {"grant": grant_to_wire(grant, time.monotonic())}


async def finish(req_id: int, deferred: Deferred) -> Answer:
    """The answer once ``deferred`` has run."""
    try:
        return Answer(req_id, await deferred.run())
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return failed(req_id, exc)


def failed(req_id: int, exc: Exception) -> Answer:
    """The error reply for ``exc``: its code when it is a KVServerError, else ``internal``."""
    if isinstance(exc, KVServerError):
        return Answer(req_id, error=(exc.code, str(exc)))
    logger.error("internal error handling request %d", req_id, exc_info=exc)
    return Answer(req_id, error=("internal", f"internal error: {exc!r}"))
