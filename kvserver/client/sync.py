"""The blocking kvserver client (scheduler, workers, tools).

Runs in any client process. Not thread-safe: use one ``KVClient`` per thread (each has its own
DEALER socket). Every call waits at most ``timeout`` seconds and raises
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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvserver import wire
from kvserver.allocator import Extents
from kvserver.client.common import (
    DEFAULT_TIMEOUT_S,
    RECONNECT_IVL_MAX_MS,
    RECONNECT_IVL_MS,
    Answer,
    Call,
    LookupResult,
    NamespaceInfo,
    Parts,
    Proc,
    PutResult,
    Session,
    T,
)
from kvserver.engine_types import LoadGrant, StoreGrant
from kvserver.errors import KVServerError, UnknownNamespace
from kvserver.namespace import NamespaceSpec


class KVClient:
    """Blocking client; see the module docstring. ``colocated``: None = auto, False = never
    use shared memory, True = require it."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        client_id: str | None = None,
        auth_token: str = "",
        colocated: bool | None = None,
    ) -> None:
        self.timeout = timeout
        self._s = Session(address, client_id=client_id, auth_token=auth_token, colocated=colocated)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None

    # ------------------------------------------------------------------ lifetime

    @property
    def client_id(self) -> str:
        return self._s.client_id

    @property
    def is_colocated(self) -> bool:
        """True once a hello mapped the daemon's arena (shared-memory data path)."""
        return self._s.arena is not None

    def close(self) -> None:
        """Close the socket and unmap the arena. Leases are not released (see release())."""
        self._drop_socket()
        self._s.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ driver

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.connect(self._s.address)
            self._sock = sock
        return self._sock

    def _exchange(self, call: Call) -> Answer:
        sock = self._socket()
        req_id, frames = self._s.encode(call)
        deadline = time.monotonic() + self.timeout
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._drop_socket()
            raise self._s.timed_out(call, self.timeout) from None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                self._drop_socket()
                raise self._s.timed_out(call, self.timeout)
            answer = self._s.accept(sock.recv_multipart(copy=False), req_id)
            if answer is not None:
                return answer

    def _exchange_renewing(self, call: Call) -> Answer:
        """Exchange; after a daemon restart renew the session, retrying a namespace miss."""
        try:
            answer = self._exchange(call)
        except UnknownNamespace:
            spec = self._s.specs.get(call.args.get("ns_id", ""))
            if spec is None:
                raise
            if self._s.needs_hello:
                self._renew()  # the daemon restarted: re-registers every namespace
            else:
                self._drive(self._s.register_namespace(spec))
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
        self, ns_id: str, keys: Sequence[bytes], *, record: bool = False, touch: bool = False
    ) -> LookupResult:
        """Length of the leading run of ready ``keys`` (``record``: count for reuse gating)."""
        return self._run(self._s.lookup(ns_id, keys, record, touch))

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
        args = {
            "lease_id": lease_id,
            "success": success,
            "ranks": None if ranks is None else list(ranks),
            "keys": None if keys is None else list(keys),
        }
        return list(self._run(self._s.simple(wire.COMPLETE_STORE, args, "ready")))

    def prepare_load(
        self, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
    ) -> LoadGrant:
        """Pin ``keys`` (all must be ready); pinned until complete_load or the deadline."""
        return self._run(self._s.prepare_load(ns_id, keys, lease_s))

    def complete_load(self, lease_id: int) -> None:
        self._run(self._s.simple(wire.COMPLETE_LOAD, {"lease_id": lease_id}))

    def write(self, extents: Extents, data: Any) -> None:
        """Copy one part into the mapped arena. REQUIRES: a live store grant's extents."""
        self._s.mapped().write(extents, data)

    def read(self, extents: Extents) -> bytes:
        """Copy one part out of the mapped arena. REQUIRES: a live load grant's extents."""
        return self._s.mapped().read(extents)

    def readinto(self, extents: Extents, out: bytearray | memoryview) -> None:
        self._s.mapped().readinto(extents, out)

    # ------------------------------------------------------------------ payload frames

    def put(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
    ) -> PutResult:
        """Store whole entries in one round trip (``parts[i]``: a buffer, or one per rank)."""
        return self._run(self._s.put(ns_id, keys, parts, lease_s))

    def get(
        self, ns_id: str, keys: Sequence[bytes], *, ranks: Sequence[int] | None = None
    ) -> list[list[memoryview]]:
        """Parts of ready ``keys`` (all must be ready): ``result[i][j]`` is rank ``ranks[j]``."""
        return self._run(self._s.get(ns_id, keys, ranks))

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
