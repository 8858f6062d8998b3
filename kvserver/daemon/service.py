"""The daemon's operations, independent of transport.

Runs on the daemon's one event loop; the ZMQ front end (``zmq_server.py``) and the gRPC front
end (``grpc_server.py``) both call it, so the two APIs cannot drift apart. It owns the storage
engine and the event log; after every mutating call it moves the engine's new events into the
log (which wakes WatchEvents streams and the ZMQ PUB publisher).

Below the DRAM engine the service composes an ordered stack of tiers (``add_tier``; the seam
and its contracts are in ``tiers.py``): lookups report the leading run over all tiers with the
per-tier split (and may need I/O: then :meth:`KVService.lookup` returns a
:class:`PendingLookup` for the front end to await), loads first ``await promote()`` the keys
that are only below DRAM (``needs_promotion`` tells the front end whether it must), namespace
registrations are passed on, and ``stats()`` carries one section per tier under its name.
The composite operations (``put``, ``get`` with promotion) are here too, so the front ends
never reach into the engine.

Inputs are typed Python values; each front end decodes and type-checks its wire format first.
Errors are :class:`~kvserver.errors.KVServerError` subclasses, mapped to error replies / gRPC
status codes by the front ends only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvserver import __version__
from kvserver.daemon.eventlog import EventLog
from kvserver.daemon.tiers import DirectParts, Tier
from kvserver.engine import StorageEngine
from kvserver.engine_types import EngineConfig, Entry
from kvserver.errors import InvalidArgument
from kvserver.grants import LoadGrant, StoreGrant
from kvserver.hashing import BlockHasher
from kvserver.namespace import NamespaceSpec
from kvserver.prometheus import latency_histogram
from kvserver.wire import host_id

logger = logging.getLogger(__name__)

MAX_LOOKUP_TOKENS = 1 << 21  # 2M tokens: far beyond any context window

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Pending(Generic[T]):
    """The rest of an operation that must wait for a lower tier's I/O: ``await run()``.
    Returned instead of the result when the answer is not known without I/O; the ZMQ front end
    runs it as a ``zmq_ops.Deferred``, the gRPC front end awaits it."""

    run: Callable[[], Awaitable[T]]


@dataclass(frozen=True, slots=True)
class LookupHits:
    ns_id: str
    hit_chunks: int
    hit_tokens: int
    num_chunks: int
    #: chunks found per tier, e.g. {"dram": 3, "ssd": 0}
    tiers: dict[str, int]


@dataclass(frozen=True, slots=True)
class PutResult:
    """What :meth:`KVService.put` did: the keys it stored, those already present, those the
    reuse gate filtered; ``rejected`` when the cache could not take them (nothing stored)."""

    stored: list[bytes]
    present: list[bytes]
    filtered: list[bytes]
    rejected: bool


@dataclass(frozen=True, slots=True)
class Fetched:
    """What :meth:`KVService.get` read: key-major parts (one list of views per key and rank of
    ``ranks``) and ``lease_id``, a load lease of the caller's ``client`` that keeps the arena
    views valid (0 when nothing is pinned): the caller ends it (``complete_load``) once the
    views are no longer used."""

    keys: list[bytes]
    ranks: list[int]
    parts: list[list[memoryview]]
    lease_id: int


class KVService:
    """Transport-independent operations over one storage engine and the tiers below it.

    ``engine`` is the DRAM tier, for the daemon's wiring (``process.py``) and the tiers it
    builds; the front ends use the methods below only.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        event_capacity: int = 100_000,
        prefault_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine = StorageEngine(engine_config, prefault_progress=prefault_progress)
        self.events = EventLog(event_capacity)
        self.host_id = host_id()
        #: the tiers below DRAM, fastest first (``tiers.py``).
        self.tiers: list[Tier] = []
        #: the fleet membership (``kvserver.cluster.ClusterNode``) when ``--cluster`` is set.
        self.cluster: Any = None
        self._hashers: dict[str, BlockHasher] = {}
        #: seconds per data-plane op (ZMQ and local channel), label ``op``; see daemon/metrics.py
        self.op_seconds = latency_histogram(
            "kvserver_op_duration_seconds", "Time to carry out one data-plane request.", ["op"]
        )

    def add_tier(self, tier: Tier) -> None:
        """Put ``tier`` below the tiers already added: DRAM evictions are offered to it
        (after the tiers above it), lookups and loads consult it. REQUIRES: a unique name."""
        if tier.name == "dram" or any(t.name == tier.name for t in self.tiers):
            raise ValueError(f"a tier named {tier.name!r} is already in the stack")
        self.tiers.append(tier)
        offers = [t.on_evict for t in self.tiers]
        if len(offers) == 1:
            self.engine.on_evict = offers[0]
        else:

            def on_evict(spec: NamespaceSpec, victims: list[Entry]) -> None:
                for offer in offers:
                    offer(spec, victims)

            self.engine.on_evict = on_evict

    async def open_tiers(self) -> None:
        """Open the tiers, fastest first (a tier never raises for an I/O problem)."""
        for tier in self.tiers:
            await tier.open()

    async def close_tiers(self) -> None:
        """Close the tiers, slowest first; evictions are no longer offered to them."""
        self.engine.on_evict = None
        for tier in reversed(self.tiers):
            await tier.close()

    # ------------------------------------------------------------------ session

    def hello(self) -> dict[str, Any]:
        cfg = self.engine.config
        return {
            "server_version": __version__,
            "host_id": self.host_id,
            "pid": os.getpid(),
            "arena_path": self.engine.arena.path,
            "arena_size": self.engine.arena.size,
            "page_size": cfg.page_size,
            "default_lease_s": cfg.default_lease_s,
        }

    def register_namespace(self, spec: NamespaceSpec) -> dict[str, Any]:
        ns_id = self.engine.register_namespace(spec)
        for tier in self.tiers:
            tier.namespaces_changed()
        return {
            "ns_id": ns_id,
            "part_bytes": spec.part_bytes,
            "key_size": spec.key_size,
            "tp_world_size": spec.tp_world_size,
            "chunk_tokens": spec.chunk_tokens,
        }

    def list_namespaces(self) -> list[NamespaceSpec]:
        return list(self.engine.namespaces.values())

    def namespace(self, ns_id: str) -> NamespaceSpec:
        """The spec of a registered namespace (``UnknownNamespace`` otherwise)."""
        return self.engine.namespace(ns_id)

    def find_namespace(self, ns_id: str) -> NamespaceSpec | None:
        """The spec of ``ns_id`` if registered here, else None."""
        return self.engine.namespaces.get(ns_id)

    @property
    def arena_path(self) -> str:
        """The shared-memory arena's path (the local channel's socket lives beside it)."""
        return self.engine.arena.path

    @property
    def dram_bytes(self) -> int:
        """The DRAM tier's capacity in bytes."""
        return self.engine.allocator.num_pages * self.engine.allocator.page_size

    # ------------------------------------------------------------------ queries

    def _stack(self, local: bool) -> list[Tier]:
        """The tiers below DRAM to consult: all, or (``local``) this host's own only."""
        return [t for t in self.tiers if t.local] if local else self.tiers

    def lookup(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        record: bool = False,
        touch: bool = False,
        local: bool = False,
    ) -> LookupHits | Pending[LookupHits]:
        """The leading run of ``keys`` held by some tier, split per tier (a key counts for the
        fastest tier holding it); ``Pending`` when a tier cannot tell without I/O (then the
        rest is ``await pending.run()``). ``record``/``touch`` as ``StorageEngine.lookup``;
        ``local``: this daemon's own tiers only (a peer's question)."""
        hits = self.engine.lookup(ns_id, keys, record=record, touch=touch)
        spec = self.engine.namespace(ns_id)
        tiers = self._stack(local)
        if not tiers:
            return LookupHits(ns_id, hits, hits * spec.chunk_tokens, len(keys), {"dram": hits})
        found = self._walk(ns_id, keys, hits, tiers, None)
        if found is None:
            return Pending(
                lambda: self._lookup_io(ns_id, keys, hits, tiers, touch, spec.chunk_tokens)
            )
        return self._lookup_result(ns_id, keys, hits, tiers, found, touch, spec.chunk_tokens)

    async def _lookup_io(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        hits: int,
        tiers: list[Tier],
        touch: bool,
        chunk_tokens: int,
    ) -> LookupHits:
        rest = keys[hits:]
        masks = await asyncio.gather(*(tier.query(ns_id, rest) for tier in tiers))
        found = self._walk(ns_id, keys, hits, tiers, masks)
        assert found is not None  # masks answer every key
        return self._lookup_result(ns_id, keys, hits, tiers, found, touch, chunk_tokens)

    def _walk(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        hits: int,
        tiers: list[Tier],
        masks: Sequence[Sequence[bool]] | None,
    ) -> list[int] | None:
        """Continue the run after the ``hits`` leading DRAM keys: for each key of the run, the
        index of the tier holding it (-1: DRAM); None if a tier needs I/O (``masks`` absent).
        ``masks[t][i]``: whether tier ``t`` holds ``keys[hits + i]``."""
        contains = self.engine.contains
        found: list[int] = []
        for i in range(len(keys) - hits):
            key = keys[hits + i]
            if contains(ns_id, key):
                found.append(-1)
                continue
            for t, tier in enumerate(tiers):
                held = masks[t][i] if masks is not None else tier.holds(ns_id, key)
                if held is None:
                    return None
                if held:
                    found.append(t)
                    break
            else:
                break
        return found

    def _lookup_result(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        hits: int,
        tiers: list[Tier],
        found: list[int],
        touch: bool,
        chunk_tokens: int,
    ) -> LookupHits:
        total = hits + len(found)
        misses = len(keys) - total
        counts = {"dram": hits + found.count(-1)}
        for t, tier in enumerate(tiers):
            mine = [keys[hits + i] for i, owner in enumerate(found) if owner == t]
            counts[tier.name] = len(mine)
            tier.record_lookup(ns_id, mine, misses, touch=touch)
        if touch and counts["dram"] > hits:
            self.engine.touch(ns_id, keys[:total])
        return LookupHits(ns_id, total, total * chunk_tokens, len(keys), counts)

    def chunk_keys_for_tokens(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[bytes]:
        """The chunk keys of a prompt, hashed as a vLLM replica of this namespace would."""
        if len(token_ids) > MAX_LOOKUP_TOKENS:
            raise InvalidArgument("too many tokens", count=len(token_ids))
        spec = self.engine.namespace(ns_id)
        max_keys = self.engine.config.max_keys_per_request
        if len(token_ids) // spec.chunk_tokens > max_keys:
            # Refuse before hashing: hashing runs on the event loop.
            raise InvalidArgument(
                "prompt has more chunks than one request may carry",
                tokens=len(token_ids),
                max_chunks=max_keys,
            )
        hasher = self._hashers.get(ns_id)
        if hasher is None:
            hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
            self._hashers[ns_id] = hasher
        blocks = hasher.hash_blocks(token_ids, cache_salt=cache_salt, lora=lora)
        return [bytes(k) for k in hasher.chunk_keys(blocks, spec.chunk_blocks)]

    def lookup_tokens(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> LookupHits | Pending[LookupHits]:
        keys = self.chunk_keys_for_tokens(ns_id, token_ids, cache_salt=cache_salt, lora=lora)
        return self.lookup(ns_id, keys)

    def touch(self, ns_id: str, keys: Sequence[bytes]) -> None:
        self.engine.touch(ns_id, keys)

    def stats(self) -> dict[str, Any]:
        out = self.engine.stats().to_dict()
        out["events_last_seq"] = self.events.last_seq
        out["server_version"] = __version__
        out["ssd"] = None  # docs/wire.md: nil without an SSD tier
        for tier in self.tiers:
            out[tier.name] = tier.stats()
        out["cluster"] = self.cluster.stats() if self.cluster is not None else None
        return out

    def held_chunks(self) -> dict[tuple[str, str], list[bytes]]:
        """Visible chunk keys per (namespace id, tier name): the fleet index's resync."""
        out = {(ns, "dram"): keys for ns, keys in self.engine.held_keys().items()}
        for tier in self.tiers:
            out.update({(ns, tier.name): keys for ns, keys in tier.held_keys().items()})
        return out

    def tier_stats(self) -> list[tuple[Tier, dict[str, Any]]]:
        """Each tier below DRAM with its ``stats()``, fastest first."""
        return [(tier, tier.stats()) for tier in self.tiers]

    # ------------------------------------------------------------------ store / load

    def prepare_store(
        self, ns_id: str, keys: Sequence[bytes], *, client: str, lease_s: float | None = None
    ) -> StoreGrant | None:
        try:
            return self.engine.prepare_store(ns_id, keys, client=client, lease_s=lease_s)
        finally:
            self._publish()

    def write_part(self, lease_id: int, key: bytes, rank: int, data: memoryview | bytes) -> None:
        self.engine.write_part(lease_id, key, rank, data)

    def complete_store(
        self,
        lease_id: int,
        *,
        success: bool = True,
        ranks: Sequence[int] | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> list[bytes]:
        try:
            return self.engine.complete_store(lease_id, success=success, ranks=ranks, keys=keys)
        finally:
            self._publish()

    def needs_promotion(
        self, ns_id: str, keys: Sequence[bytes], *, local: bool = False
    ) -> bool:
        """True if some of ``keys`` must be promoted from a lower tier (``local``: of this
        host's own) before a load can pin them."""
        return any(tier.needs_promotion(ns_id, keys) for tier in self._stack(local))

    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False, local: bool = False
    ) -> DirectParts:
        """Promote the keys that are only in lower tiers into DRAM, asking each tier in order
        (``local``: this host's own only) for the keys not yet served (``Tier.promote``);
        returns, when ``direct``, the parts of keys DRAM could not take."""
        out: DirectParts = {}
        try:
            for tier in self._stack(local):
                rest = [k for k in keys if k not in out] if out else keys
                if tier.needs_promotion(ns_id, rest):
                    out.update(await tier.promote(ns_id, rest, direct=direct))
            return out
        finally:
            self._publish()

    def load(
        self, ns_id: str, keys: Sequence[bytes], *, client: str, lease_s: float | None = None
    ) -> LoadGrant | Pending[LoadGrant]:
        """``prepare_load``, after promoting keys that are only in lower tiers: ``Pending``
        when a promotion must run first."""
        if not self.needs_promotion(ns_id, keys):
            return self.prepare_load(ns_id, keys, client=client, lease_s=lease_s)

        async def promote_then_load() -> LoadGrant:
            await self.promote(ns_id, keys)
            return self.prepare_load(ns_id, keys, client=client, lease_s=lease_s)

        return Pending(promote_then_load)

    def put(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        parts: Sequence[memoryview | bytes],
        *,
        client: str,
        lease_s: float | None = None,
    ) -> PutResult:
        """Store whole entries at once: ``parts`` holds ``len(keys) x tp`` parts, key-major.
        Raises ``InvalidArgument`` (nothing changed) for duplicate keys or parts of the wrong
        number or size."""
        spec = self.engine.namespace(ns_id)
        tp = spec.tp_world_size
        if len(set(keys)) != len(keys):
            raise InvalidArgument("put: duplicate keys")
        check_parts(parts, len(keys) * tp, spec.part_bytes)
        grant = self.prepare_store(ns_id, keys, client=client, lease_s=lease_s)
        if grant is None:
            return PutResult([], [], [], rejected=True)
        stored: list[bytes] = []
        if grant.keys:
            index = {key: i for i, key in enumerate(keys)}
            try:
                for key in grant.keys:
                    for rank in range(tp):
                        self.write_part(grant.lease_id, key, rank, parts[index[key] * tp + rank])
            except BaseException:
                self.complete_store(grant.lease_id, success=False)
                raise
            stored = self.complete_store(grant.lease_id, success=True)
        return PutResult(stored, grant.present, grant.filtered, rejected=False)

    def get(
        self,
        ns_id: str,
        keys: list[bytes],
        ranks: list[int] | None,
        *,
        client: str,
        leading: bool = False,
    ) -> Fetched | Pending[Fetched]:
        """Pin ``keys`` (every one must be READY, after promotion from lower tiers) for
        ``client`` and read the parts of ``ranks`` (None: every rank); ``Pending`` when a
        promotion must run first. Keys DRAM could not take are served from the lower tier's
        bytes. ``leading`` (a peer's request): only the leading run of ``keys`` held in this
        daemon's own tiers, promoted from those only. Raises ``InvalidArgument`` for a rank
        out of range, what ``prepare_load`` raises for a missing key (nothing held then)."""
        tp = self.engine.namespace(ns_id).tp_world_size
        ranks = ranks if ranks is not None else list(range(tp))
        for rank in ranks:
            if not rank < tp:
                raise InvalidArgument("rank out of range", rank=rank, tp_world_size=tp)
        if not self.needs_promotion(ns_id, keys, local=leading):
            if leading:
                keys = keys[: self.engine.lookup(ns_id, keys)]
            return self._fetch(ns_id, keys, ranks, {}, client)

        async def promote_then_fetch() -> Fetched:
            got = keys
            direct = await self.promote(ns_id, got, direct=True, local=leading)
            if leading:
                lookup = self.engine.lookup
                n = 0
                while n < len(got) and (got[n] in direct or lookup(ns_id, got[n : n + 1])):
                    n += 1
                got = got[:n]
            return self._fetch(ns_id, got, ranks, direct, client)

        return Pending(promote_then_fetch)

    def _fetch(
        self, ns_id: str, keys: list[bytes], ranks: list[int], direct: DirectParts, client: str
    ) -> Fetched:
        in_dram = [k for k in keys if k not in direct] if direct else keys
        lease = self.hold(ns_id, in_dram, client=client) if in_dram or not direct else 0
        try:
            parts = [
                [direct[k][r]] if k in direct else self.engine.read_part(lease, k, r)
                for k in keys
                for r in ranks
            ]
        except BaseException:
            if lease:
                self.engine.complete_load(lease)
            raise
        return Fetched(keys, ranks, parts, lease)

    def hold(self, ns_id: str, keys: Sequence[bytes], *, client: str) -> int:
        """Pin ``keys`` with a load lease of ``client`` of the longest duration allowed
        (guards arena views being sent); returns its id, to end with ``complete_load``."""
        lease_s = self.engine.config.max_lease_s
        return self.engine.prepare_load(ns_id, keys, client=client, lease_s=lease_s).lease_id

    def prepare_load(
        self, ns_id: str, keys: Sequence[bytes], *, client: str, lease_s: float | None = None
    ) -> LoadGrant:
        return self.engine.prepare_load(ns_id, keys, client=client, lease_s=lease_s)

    def read_part(self, lease_id: int, key: bytes, rank: int) -> list[memoryview]:
        return self.engine.read_part(lease_id, key, rank)

    def complete_load(self, lease_id: int) -> None:
        self.engine.complete_load(lease_id)

    def pin(self, ns_id: str, keys: Sequence[bytes], ttl_s: float) -> int:
        return self.engine.pin(ns_id, keys, ttl_s)

    def unpin(self, ns_id: str, keys: Sequence[bytes]) -> int:
        return self.engine.unpin(ns_id, keys)

    def release_client(self, client: str) -> int:
        try:
            return self.engine.release_client(client)
        finally:
            self._publish()

    # ------------------------------------------------------------------ housekeeping

    def expire(self) -> int:
        """Reclaim expired leases and pins (the daemon calls this periodically)."""
        try:
            reclaimed = self.engine.expire()
        finally:
            self._publish()
        if reclaimed:
            logger.info("reclaimed %d expired lease(s)", reclaimed)
        return reclaimed

    def close(self) -> None:
        """Roll back in-flight work, stop event followers, remove the arena."""
        for lease in list(self.engine.leases):
            self.engine.release_client(lease.client)
        self._publish()
        self.events.close()
        self.engine.close()

    def publish(self) -> None:
        """Move the engine's new events into the event log (other tiers call this too)."""
        self._publish()

    def _publish(self) -> None:
        events = self.engine.take_events()
        if events:
            self.events.extend(events)


def check_parts(parts: Sequence[Any], expected: int, part_bytes: int | None) -> None:
    """Refuse a payload with the wrong number of parts or (when given) of the wrong size."""
    if len(parts) != expected:
        raise InvalidArgument(
            "wrong number of payload frames", frames=len(parts), expected=expected
        )
    if part_bytes is not None:
        for i, part in enumerate(parts):
            size = part.nbytes if isinstance(part, memoryview) else len(part)
            if size != part_bytes:
                raise InvalidArgument(
                    "payload size does not match the slot",
                    frame=i,
                    size=size,
                    part_bytes=part_bytes,
                )
