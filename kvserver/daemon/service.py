"""The daemon's operations, independent of transport.

Runs on the daemon's one event loop; the ZMQ front end (``zmq_server.py``) and the gRPC front
end (``grpc_server.py``) both call it, so the two APIs cannot drift apart. It owns the storage
engine and the event log; after every mutating call it moves the engine's new events into the
log (which wakes WatchEvents streams and the ZMQ PUB publisher).

Below the DRAM engine the service composes an ordered stack of tiers (``add_tier``; the seam
and its contracts are in ``tiers.py``, the stack in ``tier_stack.py``): lookups report the
leading run over all tiers with the per-tier split (and may need I/O: then
:meth:`KVService.lookup` returns a :class:`~kvserver.daemon.results.Pending` for the front
end to await), loads first ``await promote()`` the keys
that are only below DRAM (``needs_promotion`` tells the front end whether it must), namespace
registrations are passed on, and ``stats()`` carries one section per tier under its name.
The composite operations (``put``, ``get`` with promotion) are here too, so the front ends
never reach into the engine.

Inputs are typed Python values; each front end decodes and type-checks its wire format first
(a data request's shape: ``request_checks.py``; a prompt's token ids are checked and hashed by
``prompts``, a :class:`~kvserver.daemon.prompt_hashing.PromptHashing`). Errors are
:class:`~kvserver.errors.KVServerError` subclasses, mapped to error replies / gRPC status codes
by the front ends only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvserver import __version__
from kvserver.daemon.prompt_hashing import PromptHashing
from kvserver.daemon.refusals import HandshakeCounts, RefusalThrottle, SubscriberCounts
from kvserver.daemon.request_checks import check_parts, check_unique
from kvserver.daemon.results import Fetched, LookupHits, Pending, PutResult
from kvserver.daemon.tier_stack import TierStack
from kvserver.daemon.tiers import DirectParts, Tier
from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig
from kvserver.errors import InvalidArgument
from kvserver.eventlog import EventLog
from kvserver.grants import LoadGrant, StoreGrant
from kvserver.namespace import NamespaceSpec
from kvserver.prometheus import latency_histogram
from kvserver.wire import host_id

logger = logging.getLogger(__name__)


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
        #: the tiers below DRAM, fastest first (``tier_stack.py``).
        self.stack = TierStack(self.engine)
        #: the fleet membership (``kvserver.cluster.ClusterNode``) when ``--cluster`` is set.
        self.cluster: Any = None
        #: the peer stream's serving end (``stream_server.StreamServer``), set by process.py.
        self.peer_stream: Any = None
        #: the ZMQ front end's zero-copy sends (``zmq_send.ZeroCopySender``), set by process.py.
        self.zmq_sends: Any = None
        #: the token paths' prompts checked and hashed, big ones on threads
        #: (``prompt_hashing.py``): the front ends call ``prompts.prompt_keys``.
        self.prompts = PromptHashing(
            namespace=self.engine.namespace,
            max_keys_per_request=self.engine.config.max_keys_per_request,
        )
        #: seconds per data-plane op (ZMQ and local channel), label ``op``; see daemon/metrics.py
        self.op_seconds = latency_histogram(
            "kvserver_op_duration_seconds", "Time to carry out one data-plane request.", ["op"]
        )
        #: the ZMQ front end's throttle of error replies to unauthenticated requests
        #: (``refusals.py``); its counters are in ``stats()`` as ``refusals``.
        self.refusals = RefusalThrottle()
        #: the ZMQ handshakes the ZAP handler admitted and refused (``zap.py``); in
        #: ``stats()`` as ``handshakes``.
        self.handshakes = HandshakeCounts()
        #: the KV-event PUB's subscriber connections, open and refused (``pub_limit.py``); in
        #: ``stats()`` as ``pub_subscribers``.
        self.subscribers = SubscriberCounts()

    def add_tier(self, tier: Tier) -> None:
        """Put ``tier`` below the tiers already added (``TierStack.add``)."""
        self.stack.add(tier)

    async def open_tiers(self) -> None:
        await self.stack.open()

    async def close_tiers(self) -> None:
        await self.stack.close()

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
            "max_lease_s": cfg.max_lease_s,
        }

    def register_namespace(self, spec: NamespaceSpec) -> dict[str, Any]:
        ns_id = self.engine.register_namespace(spec)
        self.stack.namespaces_changed()
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

    def lease_namespace(self, lease_id: int) -> NamespaceSpec | None:
        """The namespace of live lease ``lease_id``, or None (the op then fails itself)."""
        return self.engine.lease_namespace(lease_id)

    def lease_owner(self, lease_id: int) -> str | None:
        """The client that owns live lease ``lease_id``, or None (no such lease)."""
        lease = self.engine.leases.find(lease_id)
        return None if lease is None else lease.client

    def num_leases_of(self, client: str) -> int:
        """Live leases owned by ``client``."""
        return len(self.engine.leases.by_client(client))

    def find_namespace(self, ns_id: str) -> NamespaceSpec | None:
        """The spec of ``ns_id`` if registered here, else None."""
        return self.engine.namespaces.get(ns_id)

    @property
    def arena_path(self) -> str:
        """The shared-memory arena's path (the local channel's socket lives beside it)."""
        return self.engine.arena.path

    @property
    def max_keys_per_request(self) -> int:
        """The most keys one request may carry (the engine's limit)."""
        return self.engine.config.max_keys_per_request

    @property
    def dram_bytes(self) -> int:
        """The DRAM tier's capacity in bytes."""
        return self.engine.allocator.num_pages * self.engine.allocator.page_size

    # ------------------------------------------------------------------ queries

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
        chunk_tokens = self.engine.namespace(ns_id).chunk_tokens
        return self.stack.lookup(ns_id, keys, hits, chunk_tokens, touch=touch, local=local)

    def hash_prompt(
        self,
        spec: NamespaceSpec,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        caller: str = "",
    ) -> Sequence[bytes] | Awaitable[Sequence[bytes]]:
        """``PromptHashing.keys`` of a spec that need not be registered here (ScoreHosts
        scores the fleet's; it checked the sizes)."""
        return self.prompts.keys(spec, token_ids, cache_salt=cache_salt, lora=lora, caller=caller)

    def touch(self, ns_id: str, keys: Sequence[bytes]) -> None:
        self.engine.touch(ns_id, keys)

    def stats(self) -> dict[str, Any]:
        out = self.engine.stats().to_dict()
        out["events_last_seq"] = self.events.last_seq
        out["server_version"] = __version__
        out["ssd"] = None  # docs/wire.md: nil without an SSD tier
        for tier, tier_stats in self.stack.stats():
            out[tier.name] = tier_stats
        out["cluster"] = self.cluster.stats() if self.cluster is not None else None
        out["refusals"] = self.refusals.stats()
        out["handshakes"] = self.handshakes.stats()
        out["pub_subscribers"] = self.subscribers.stats()
        out["peer_stream"] = self.peer_stream.stats() if self.peer_stream is not None else None
        out["prompt_hashing"] = self.prompts.stats()
        out["zmq_sends"] = self.zmq_sends.stats() if self.zmq_sends is not None else None
        return out

    def held_chunks(self) -> dict[tuple[str, str], list[bytes]]:
        """Visible chunk keys per (namespace id, tier name): the fleet index's resync."""
        out = {(ns, "dram"): keys for ns, keys in self.engine.held_keys().items()}
        out.update(self.stack.held_keys())
        return out

    def tier_stats(self) -> list[tuple[Tier, dict[str, Any]]]:
        """Each tier below DRAM with its ``stats()``, fastest first."""
        return self.stack.stats()

    # ------------------------------------------------------------------ store / load

    def prepare_store(
        self, ns_id: str, keys: Sequence[bytes], *, client: str, lease_s: float | None = None
    ) -> StoreGrant | None:
        try:
            return self.engine.prepare_store(ns_id, keys, client=client, lease_s=lease_s)
        finally:
            self._publish()

    def store_views(self, grant: StoreGrant) -> dict[bytes, list[memoryview]]:
        """Per key of ``grant``, the arena views of its parts' extents in rank order: where a
        transport receives a put's payload straight into its reserved pages (the stream,
        ``stream_ops.py``). The views must be dropped before the reservation ends."""
        arena, tp = self.engine.arena, len(grant.locations[0]) if grant.locations else 0
        flat = arena.views_of([extents for parts in grant.locations for extents in parts])
        return {
            key: [v for part in flat[i * tp : (i + 1) * tp] for v in part]
            for i, key in enumerate(grant.keys)
        }

    def write_part(self, lease_id: int, key: bytes, rank: int, data: memoryview | bytes) -> None:
        self.engine.write_part(lease_id, key, rank, data)

    def write_parts(
        self,
        lease_id: int,
        keys: Sequence[bytes],
        ranks: Sequence[int],
        parts: Sequence[memoryview | bytes],
    ) -> None:
        """``StorageEngine.write_parts``: all checked before any is written."""
        self.engine.write_parts(lease_id, keys, ranks, parts)

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

    def needs_promotion(self, ns_id: str, keys: Sequence[bytes], *, local: bool = False) -> bool:
        """True if some of ``keys`` must be promoted from a lower tier (``local``: of this
        host's own) before a load can pin them."""
        return self.stack.needs_promotion(ns_id, keys, local=local)

    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False, local: bool = False
    ) -> DirectParts:
        """Promote the keys that are only in lower tiers into DRAM, asking each tier in order
        (``local``: this host's own only) for the keys not yet served (``Tier.promote``);
        returns, when ``direct``, the parts of keys DRAM could not take."""
        try:
            return await self.stack.promote(ns_id, keys, direct=direct, local=local)
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
            if len(grant.keys) < len(keys):  # some present or filtered: the parts of the others
                index = {key: i for i, key in enumerate(keys)}
                parts = [parts[index[key] * tp + rank] for key in grant.keys for rank in range(tp)]
            try:
                self.engine.write_parts(grant.lease_id, grant.keys, range(tp), parts)
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
        out of range or a key or rank named twice (a reply never carries a part twice, so it
        holds no more than the tiers do: 65,536 ranks of one key were 65,536 copies of it),
        what ``prepare_load`` raises for a missing key (nothing held then)."""
        tp = self.engine.namespace(ns_id).tp_world_size
        ranks = ranks if ranks is not None else list(range(tp))
        for rank in ranks:
            if not rank < tp:
                raise InvalidArgument("rank out of range", rank=rank, tp_world_size=tp)
        check_unique("get", keys, ranks)
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
            parts = self.engine.read_parts(lease, in_dram, ranks) if in_dram else []
            if direct:  # the parts read from a lower tier's buffers, in their places
                views = iter(parts)
                parts = [
                    [direct[k][r]] if k in direct else next(views) for k in keys for r in ranks
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
        self.prompts.close()
        self.engine.close()

    def publish(self) -> None:
        """Move the engine's new events into the event log (other tiers call this too)."""
        self._publish()

    def _publish(self) -> None:
        events = self.engine.take_events()
        if events:
            self.events.extend(events)
