"""The asyncio kvserver client (workers and schedulers that run an event loop).

Runs in any client process, on the loop where it is first used (zmq.asyncio; uvloop works).
Calls may be awaited concurrently from several tasks of that loop: exchanges on the one DEALER
socket are serialised by a lock (use several clients for parallel transfers). Same operations,
timeouts and session renewal as :class:`~kvserver.client.sync.KVClient`; the arena helpers
(``write``/``read``/``readinto``) are plain memcpy and stay synchronous.

Usage::

    async with AsyncKVClient("tcp://127.0.0.1:9471") as kv:
        ns = await kv.register_namespace(spec)
        await kv.store(ns.ns_id, keys, parts)
        parts = await kv.load(ns.ns_id, keys)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

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
    Proc,
    PutResult,
    Session,
    T,
)
from kvserver.client.parts import Parts, readinto_part, write_part
from kvserver.crypto import CurveClient
from kvserver.errors import KVServerError, Unauthenticated, UnknownNamespace
from kvserver.grants import LoadGrant, StoreGrant
from kvserver.namespace import NamespaceSpec


class AsyncKVClient:
    """Asyncio client; see the module docstring. ``colocated``: None = auto, False = never
    use shared memory, True = require it."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        client_id: str | None = None,
        auth_token: str = "",
        colocated: bool | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        self.timeout = timeout
        self._s = Session(
            address, client_id=client_id, auth_token=auth_token, colocated=colocated, curve=curve
        )
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        self._renew_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifetime

    @property
    def client_id(self) -> str:
        return self._s.client_id

    @property
    def is_colocated(self) -> bool:
        """True once a hello mapped the daemon's arena (shared-memory data path)."""
        return self._s.arena is not None

    async def close(self) -> None:
        """Close the socket and unmap the arena. Leases are not released (see release())."""
        async with self._lock:
            self._drop_socket()
            self._s.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ driver

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            if self._s.curve is not None:
                self._s.curve.apply(sock)
            sock.connect(self._s.address)
            self._sock = sock
        return self._sock

    async def _exchange(self, call: Call) -> Answer:
        async with self._lock:
            sock = self._socket()
            req_id, frames = self._s.encode(call)
            deadline = time.monotonic() + self.timeout
            try:
                await sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._drop_socket()
                raise self._s.timed_out(call, self.timeout) from None
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await sock.poll(max(1, int(remaining * 1000))):
                    self._drop_socket()
                    raise self._s.timed_out(call, self.timeout)
                answer = self._s.accept(await sock.recv_multipart(copy=False), req_id)
                if answer is not None:
                    return answer

    async def _exchange_renewing(self, call: Call) -> Answer:
        """Exchange; after a daemon restart renew the session, retrying a namespace miss."""
        try:
            answer = await self._exchange(call)
        except UnknownNamespace:
            spec = self._s.specs.get(call.args.get("ns_id", ""))
            if spec is None:
                raise
            if self._s.needs_hello:
                await self._renew()  # the daemon restarted: re-registers every namespace
            else:
                await self._drive(self._s.register_namespace(spec))
            answer = await self._exchange(call)
        except Unauthenticated:
            if not self._s.token_changed():
                raise
            await self._renew()  # a restarted daemon with a new token: retry once with it
            answer = await self._exchange(call)
        await self._renew()
        return answer

    async def _renew(self) -> None:
        async with self._renew_lock:
            if self._s.needs_hello:
                await self._drive(self._s.hello())
                for spec in list(self._s.specs.values()):
                    await self._drive(self._s.register_namespace(spec))

    async def _drive(self, proc: Proc[T], *, renewing: bool = False) -> T:
        exchange = self._exchange_renewing if renewing else self._exchange
        try:
            call = next(proc)
            while True:
                try:
                    answer = await exchange(call)
                except KVServerError as exc:
                    call = proc.throw(exc)
                else:
                    call = proc.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _run(self, proc: Proc[T]) -> T:
        await self._renew()
        return await self._drive(proc, renewing=True)

    # ------------------------------------------------------------------ session

    async def hello(self) -> dict[str, Any]:
        """Handshake (also done implicitly): daemon version, host_id, arena, sid, client id."""
        self._s.needs_hello = True
        await self._renew()
        return dict(self._s.server)

    async def register_namespace(self, spec: NamespaceSpec) -> NamespaceInfo:
        """Register ``spec`` (idempotent); re-registered automatically after a restart."""
        return await self._run(self._s.register_namespace(spec))

    async def namespaces(self) -> list[NamespaceSpec]:
        return await self._run(self._s.namespaces())

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._run(self._s.simple(wire.STATS, {}))
        return result

    async def release(self) -> int:
        """Roll back every reservation and release every pin held by this client id."""
        return int(await self._run(self._s.simple(wire.RELEASE, {}, "released")))

    # ------------------------------------------------------------------ queries

    async def lookup(
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
        return await self._run(self._s.lookup(ns_id, keys, record, touch, local))

    async def lookup_tokens(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> LookupResult:
        """Lookup by token ids; the daemon hashes them as a vLLM replica would."""
        return await self._run(self._s.lookup_tokens(ns_id, token_ids, cache_salt, lora))

    async def touch(self, ns_id: str, keys: Sequence[bytes]) -> None:
        await self._run(self._s.simple(wire.TOUCH, {"ns_id": ns_id, "keys": list(keys)}))

    async def pin(self, ns_id: str, keys: Sequence[bytes], ttl_s: float) -> int:
        """Keep ready ``keys`` from eviction for ``ttl_s``; returns how many were pinned."""
        args = {"ns_id": ns_id, "keys": list(keys), "ttl_s": ttl_s}
        return int(await self._run(self._s.simple(wire.PIN, args, "count")))

    async def unpin(self, ns_id: str, keys: Sequence[bytes]) -> int:
        args = {"ns_id": ns_id, "keys": list(keys)}
        return int(await self._run(self._s.simple(wire.UNPIN, args, "count")))

    # ------------------------------------------------------------------ leases (co-located)

    async def prepare_store(
        self, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
    ) -> StoreGrant | None:
        """Reserve the new keys; None if the cache cannot make room. Complete before
        ``grant.deadline`` (this process's monotonic clock) or it is rolled back."""
        return await self._run(self._s.prepare_store(ns_id, keys, lease_s))

    async def complete_store(
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
        return list(await self._run(self._s.simple(wire.COMPLETE_STORE, args, "ready")))

    async def prepare_load(
        self, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
    ) -> LoadGrant:
        """Pin ``keys`` (all must be ready); pinned until complete_load or the deadline."""
        return await self._run(self._s.prepare_load(ns_id, keys, lease_s))

    async def complete_load(self, lease_id: int) -> None:
        await self._run(self._s.simple(wire.COMPLETE_LOAD, {"lease_id": lease_id}))

    def write(self, extents: Extents, data: Any) -> None:
        """Copy one part into the mapped arena. REQUIRES: a live store grant's extents."""
        write_part(self._s.mapped(), extents, data)

    def read(self, extents: Extents) -> bytes:
        """Copy one part out of the mapped arena. REQUIRES: a live load grant's extents."""
        return self._s.mapped().read(extents)

    def readinto(self, extents: Extents, out: bytearray | memoryview) -> None:
        readinto_part(self._s.mapped(), extents, out)

    # ------------------------------------------------------------------ payload frames

    async def put(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
    ) -> PutResult:
        """Store whole entries in one round trip (``parts[i]``: a buffer, or one per rank)."""
        return await self._run(self._s.put(ns_id, keys, parts, lease_s))

    async def get(
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
        return await self._run(self._s.get(ns_id, keys, ranks, leading))

    async def write_parts(
        self,
        lease_id: int,
        keys: Sequence[bytes],
        rank: int,
        parts: Sequence[Any],
        *,
        complete: bool = True,
    ) -> list[bytes]:
        """Write one rank's parts into a store lease (TP by rank); returns keys made ready."""
        return await self._run(self._s.write_parts(lease_id, keys, rank, parts, complete))

    async def read_parts(
        self, ns_id: str, lease_id: int, keys: Sequence[bytes], rank: int
    ) -> list[memoryview]:
        """One rank's parts of keys pinned by load lease ``lease_id`` (TP by rank)."""
        return await self._run(self._s.read_parts(ns_id, lease_id, keys, rank))

    # ------------------------------------------------------------------ either path

    async def store(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
    ) -> list[bytes]:
        """Store whole entries through shared memory when co-located, else as frames."""
        return await self._run(self._s.store(ns_id, keys, parts, lease_s))

    async def load(
        self, ns_id: str, keys: Sequence[bytes], *, ranks: Sequence[int] | None = None
    ) -> list[list[memoryview]]:
        """Load ready entries through shared memory when co-located, else as frames."""
        return await self._run(self._s.load(ns_id, keys, ranks))
