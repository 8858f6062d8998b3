"""The blocking kvserver client (scheduler, workers, tools).

Runs in any client process. Not thread-safe: use one ``KVClient`` per thread (each has its own
DEALER socket, and its own connection to the daemon's local channel when co-located: see
:mod:`kvserver.client.transport`). Every call waits at most ``timeout`` seconds and raises
:class:`~kvserver.errors.Unavailable` after that; the socket is then replaced by a fresh one
(new routing id) and the next call renews the session transparently (hello, arena mapping,
namespace re-registration) — also when the daemon was restarted on the same address.

Usage::

    with KVClient("tcp://127.0.0.1:9471") as kv:
        ns = kv.register_namespace(spec)
        kv.store(ns.ns_id, keys, parts)          # shared memory when co-located, else frames
        hits = kv.lookup(ns.ns_id, keys).hit_chunks
        parts = kv.load(ns.ns_id, keys[:hits])

Low-level co-located flow: ``prepare_store`` → ``write(extents, data)`` per part →
``complete_store``; ``prepare_load`` → ``read``/``readinto`` → ``complete_load``.

Pipelining: ``submit_*`` send a request and return a :class:`~kvserver.client.pending.Pending`
at once; its ``result()`` is collected later, in any order, while other calls (blocking or
submitted) go on over the same socket. A timeout replaces the socket, failing every request
still outstanding on it with ``Unavailable`` (see :mod:`kvserver.client.pending`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvserver import wire
from kvserver.allocator import Extents
from kvserver.client.common import (
    DEFAULT_TIMEOUT_S,
    Answer,
    Call,
    LookupResult,
    NamespaceInfo,
    Proc,
    PutResult,
    Session,
    T,
)
from kvserver.client.parts import Parts, readinto_part, write_part
from kvserver.client.pending import Pending
from kvserver.client.transport import Slot, Transport
from kvserver.crypto import CurveClient
from kvserver.errors import KVServerError, Unauthenticated, UnknownNamespace
from kvserver.grants import LoadGrant, StoreGrant
from kvserver.namespace import NamespaceSpec

logger = logging.getLogger(__name__)


class KVClient:
    """Blocking client; see the module docstring. ``colocated``: None = auto, False = never
    use shared memory, True = require it. ``local``: send requests over the daemon's local
    channel (a Unix socket) when co-located and it announces one (``docs/wire.md`` §1)."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        client_id: str | None = None,
        auth_token: str = "",
        colocated: bool | None = None,
        curve: CurveClient | None = None,
        local: bool = True,
    ) -> None:
        self.timeout = timeout
        self._s = Session(
            address, client_id=client_id, auth_token=auth_token, colocated=colocated, curve=curve
        )
        self._t = Transport(self._s, local=local)

    # ------------------------------------------------------------------ lifetime

    @property
    def client_id(self) -> str:
        return self._s.client_id

    @property
    def is_colocated(self) -> bool:
        """True once a hello mapped the daemon's arena (shared-memory data path)."""
        return self._s.arena is not None

    @property
    def is_local(self) -> bool:
        """True while requests go over the daemon's local channel (a Unix socket) rather
        than ZMQ: co-located, the daemon announced one, and it could be connected."""
        return self._t.is_local

    @property
    def sent_by_op(self) -> Counter[str]:
        """Requests sent on the wire, by op (session renewals and retries included)."""
        return self._t.sent_by_op

    def close(self) -> None:
        """Close the socket and unmap the arena. Leases are not released (see release());
        outstanding submitted requests fail with Unavailable."""
        self._t.drop("the client was closed")
        self._s.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ driver

    def _exchange(self, call: Call) -> Answer:
        _, slot = self._t.send(call, self.timeout)
        return self._t.wait(slot, self.timeout)

    def _read_arrived(self) -> None:
        """Route every reply already received, without blocking (for Pending.done)."""
        self._t.read_arrived(self.timeout)

    def _forget(self, req_id: int) -> None:
        """Its reply will be dropped (kept in order until then: see the id 0 rule)."""
        self._t.forget(req_id)

    def _retry_in_namespace(self, call: Call) -> Answer | None:
        """After ``unknown_namespace`` for a namespace this client registered: register it
        again (the whole session when the daemon restarted) and send ``call`` once more.
        None when the namespace is not one of ours."""
        spec = self._s.specs.get(call.args.get("ns_id", ""))
        if spec is None:
            return None
        if self._s.needs_hello:
            self._renew()  # the daemon restarted: re-registers every namespace
        else:
            self._drive(self._s.register_namespace(spec))
        return self._exchange(call)

    def _exchange_renewing(self, call: Call) -> Answer:
        """Exchange; after a daemon restart renew the session, retrying a namespace miss."""
        try:
            answer = self._exchange(call)
        except UnknownNamespace:
            retried = self._retry_in_namespace(call)
            if retried is None:
                raise
            answer = retried
        except Unauthenticated:
            if not self._s.token_changed():
                raise
            self._renew()  # a restarted daemon with a new token: retry once with it
            answer = self._exchange(call)
        self._renew()
        return answer

    def _renew(self) -> None:
        if self._s.needs_hello:
            self._drive(self._s.hello())
            for spec in list(self._s.specs.values()):
                self._drive(self._s.register_namespace(spec))

    def _drive(self, proc: Proc[T], *, renewing: bool = False) -> T:
        exchange = self._exchange_renewing if renewing else self._exchange
        try:
            call = next(proc)
            while True:
                try:
                    answer = exchange(call)
                except KVServerError as exc:
                    call = proc.throw(exc)
                else:
                    call = proc.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _run(self, proc: Proc[T]) -> T:
        self._renew()
        return self._drive(proc, renewing=True)

    def _submit(self, proc: Proc[T]) -> Pending[T]:
        """Renew the session if needed (blocking), then send the first call of ``proc``."""
        self._renew()
        call = next(proc)
        try:
            req_id, slot = self._t.send(call, self.timeout)
        except BaseException:
            proc.close()
            raise
        return Pending(self, proc, slot, req_id)

    def _finish(self, proc: Proc[T], slot: Slot, timeout: float) -> T:
        """Wait for ``slot`` (the first call of ``proc``), then drive ``proc`` to its value;
        a later call of a multi-call proc is a blocking exchange."""
        try:
            try:
                try:
                    answer = self._t.wait(slot, timeout)
                except UnknownNamespace:
                    retried = self._retry_in_namespace(slot.call)
                    if retried is None:
                        raise
                    answer = retried
                except Unauthenticated:
                    if not self._s.token_changed():
                        raise
                    self._renew()  # a restarted daemon with a new token: retry once with it
                    answer = self._exchange(slot.call)
            except KVServerError as exc:
                call = proc.throw(exc)
            else:
                call = proc.send(answer)
            while True:
                try:
                    answer = self._exchange_renewing(call)
                except KVServerError as exc:
                    call = proc.throw(exc)
                else:
                    call = proc.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ session

    def hello(self) -> dict[str, Any]:
        """Handshake (also done implicitly): daemon version, host_id, arena, sid, client id."""
        self._s.needs_hello = True
        self._renew()
        return dict(self._s.server)

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceInfo:
        """Register ``spec`` (idempotent); re-registered automatically after a restart."""
        return self._run(self._s.register_namespace(spec))

    def namespaces(self) -> list[NamespaceSpec]:
        return self._run(self._s.namespaces())

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._run(self._s.simple(wire.STATS, {}))
        return result

    def release(self) -> int:
        """Roll back every reservation and release every pin held by this client id."""
        return int(self._run(self._s.simple(wire.RELEASE, {}, "released")))

    # ------------------------------------------------------------------ queries

    def lookup(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        record: bool = False,
        touch: bool = False,
        local: bool = False,
    ) -> LookupResult:
        """Length of the leading run of ready ``keys`` (``record``: count for reuse gating;
        ``local``: in the daemon's own tiers only, not counting what its peers hold)."""
        return self._run(self._s.lookup(ns_id, keys, record, touch, local))

    def lookup_tokens(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> LookupResult:
        """Lookup by token ids; the daemon hashes them as a vLLM replica would."""
        return self._run(self._s.lookup_tokens(ns_id, token_ids, cache_salt, lora))

    def touch(self, ns_id: str, keys: Sequence[bytes]) -> None:
        self._run(self._s.simple(wire.TOUCH, {"ns_id": ns_id, "keys": list(keys)}))

    def pin(self, ns_id: str, keys: Sequence[bytes], ttl_s: float) -> int:
        """Keep ready ``keys`` from eviction for ``ttl_s``; returns how many were pinned."""
        args = {"ns_id": ns_id, "keys": list(keys), "ttl_s": ttl_s}
        return int(self._run(self._s.simple(wire.PIN, args, "count")))

    def unpin(self, ns_id: str, keys: Sequence[bytes]) -> int:
        args = {"ns_id": ns_id, "keys": list(keys)}
        return int(self._run(self._s.simple(wire.UNPIN, args, "count")))

    # ------------------------------------------------------------------ leases (co-located)

    def prepare_store(
        self, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
    ) -> StoreGrant | None:
        """Reserve the new keys; None if the cache cannot make room. Complete before
        ``grant.deadline`` (this process's monotonic clock) or it is rolled back."""
        return self._run(self._s.prepare_store(ns_id, keys, lease_s))

    def complete_store(
        self,
        lease_id: int,
        *,
        success: bool = True,
        ranks: Sequence[int] | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> list[bytes]:
        """Mark parts written (or roll back); returns the keys that became ready."""
        return self._run(self._s.complete_store(lease_id, success, ranks, keys))

    def prepare_load(
        self, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
    ) -> LoadGrant:
        """Pin ``keys`` (all must be ready); pinned until complete_load or the deadline."""
        return self._run(self._s.prepare_load(ns_id, keys, lease_s))

    def complete_load(self, lease_id: int) -> None:
        """Release the pins of load lease ``lease_id``."""
        self._run(self._s.complete_load(lease_id))

    def write(self, extents: Extents, data: Any) -> None:
        """Copy one part into the mapped arena. REQUIRES: a live store grant's extents."""
        write_part(self._s.mapped(), extents, data)

    def read(self, extents: Extents) -> bytes:
        """Copy one part out of the mapped arena. REQUIRES: a live load grant's extents."""
        return self._s.mapped().read(extents)

    def readinto(self, extents: Extents, out: bytearray | memoryview) -> None:
        readinto_part(self._s.mapped(), extents, out)

    # ------------------------------------------------------------------ payload frames

    def put(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
    ) -> PutResult:
        """Store whole entries in one round trip (``parts[i]``: a buffer, or one per rank)."""
        return self._run(self._s.put(ns_id, keys, parts, lease_s))

    def get(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        ranks: Sequence[int] | None = None,
        leading: bool = False,
    ) -> list[list[memoryview]]:
        """Parts of ready ``keys`` (all must be ready): ``result[i][j]`` is rank ``ranks[j]``.
        ``leading``: only the leading run of ``keys`` the daemon holds in its own tiers (it
        does not ask its peers); the result may then be shorter than ``keys``."""
        return self._run(self._s.get(ns_id, keys, ranks, leading))

    def write_parts(
        self,
        lease_id: int,
        keys: Sequence[bytes],
        rank: int,
        parts: Sequence[Any],
        *,
        complete: bool = True,
    ) -> list[bytes]:
        """Write one rank's parts into a store lease (TP by rank); returns keys made ready."""
        return self._run(self._s.write_parts(lease_id, keys, rank, parts, complete))

    def read_parts(
        self, ns_id: str, lease_id: int, keys: Sequence[bytes], rank: int
    ) -> list[memoryview]:
        """One rank's parts of keys pinned by load lease ``lease_id`` (TP by rank)."""
        return self._run(self._s.read_parts(ns_id, lease_id, keys, rank))

    # ------------------------------------------------------------------ either path

    def store(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
    ) -> list[bytes]:
        """Store whole entries through shared memory when co-located, else as frames."""
        return self._run(self._s.store(ns_id, keys, parts, lease_s))

    def load(
        self, ns_id: str, keys: Sequence[bytes], *, ranks: Sequence[int] | None = None
    ) -> list[list[memoryview]]:
        """Load ready entries through shared memory when co-located, else as frames."""
        return self._run(self._s.load(ns_id, keys, ranks))

    # ------------------------------------------------------------------ pipelined (no wait)

    def submit_lookup(
        self, ns_id: str, keys: Sequence[bytes], *, record: bool = False, touch: bool = False
    ) -> Pending[LookupResult]:
        """:meth:`lookup`, sent without waiting for the reply."""
        return self._submit(self._s.lookup(ns_id, keys, record, touch))

    def submit_prepare_store(
        self, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
    ) -> Pending[StoreGrant | None]:
        """:meth:`prepare_store`, sent without waiting. The grant's deadline counts from the
        send, so a reply collected late still leaves the caller on the safe side."""
        return self._submit(self._s.prepare_store(ns_id, keys, lease_s))

    def submit_complete_store(
        self,
        lease_id: int,
        *,
        success: bool = True,
        ranks: Sequence[int] | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> Pending[list[bytes]]:
        """:meth:`complete_store`, sent without waiting. The daemon applies requests in
        arrival order, so a later call of this client already sees the chunks ready."""
        return self._submit(self._s.complete_store(lease_id, success, ranks, keys))

    def submit_prepare_load(
        self, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
    ) -> Pending[LoadGrant]:
        """:meth:`prepare_load`, sent without waiting (deadline from the send)."""
        return self._submit(self._s.prepare_load(ns_id, keys, lease_s))

    def submit_complete_load(self, lease_id: int) -> Pending[None]:
        """:meth:`complete_load`, sent without waiting."""
        return self._submit(self._s.complete_load(lease_id))
