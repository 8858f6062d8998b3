"""The daemon's operations, independent of transport.

Runs on the daemon's one event loop; the ZMQ front end (``zmq_server.py``) and the gRPC front
end (``grpc_server.py``) both call it, so the two APIs cannot drift apart. It owns the storage
engine and the event log; after every mutating call it moves the engine's new events into the
log (which wakes WatchEvents streams and the ZMQ PUB publisher).

With an SSD tier attached (:meth:`KVService.attach_ssd`), lookups report the leading run over
DRAM and SSD with the per-tier split, loads first ``await promote()`` the keys that are only on
SSD (``needs_promotion`` tells the front end whether it must), namespace registrations are
saved with the SSD data, and ``stats()`` carries an ``ssd`` section.

Inputs are typed Python values; each front end decodes and type-checks its wire format first.
Errors are :class:`~kvserver.errors.KVServerError` subclasses, mapped to error replies / gRPC
status codes by the front ends only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserver import __version__
from kvserver.daemon.eventlog import EventLog
from kvserver.daemon.tiering import SsdTier
from kvserver.engine import StorageEngine
from kvserver.engine_types import EngineConfig, LoadGrant, StoreGrant
from kvserver.errors import InvalidArgument
from kvserver.hashing import BlockHasher
from kvserver.namespace import NamespaceSpec
from kvserver.prometheus import latency_histogram
from kvserver.wire import host_id

logger = logging.getLogger(__name__)

MAX_LOOKUP_TOKENS = 1 << 21  # 2M tokens: far beyond any context window


@dataclass(frozen=True, slots=True)
class LookupResult:
    ns_id: str
    hit_chunks: int
    hit_tokens: int
    num_chunks: int
    #: chunks found per tier, e.g. {"dram": 3, "ssd": 0}
    tiers: dict[str, int]


class KVService:
    """Transport-independent operations over one storage engine."""

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
        self.ssd: SsdTier | None = None
        #: the fleet membership (``kvserver.cluster.ClusterNode``) when ``--cluster`` is set.
        self.cluster: Any = None
        self._hashers: dict[str, BlockHasher] = {}
        #: seconds per data-plane op (ZMQ and local channel), label ``op``; see daemon/metrics.py
        self.op_seconds = latency_histogram(
            "kvserver_op_duration_seconds", "Time to carry out one data-plane request.", ["op"]
        )

    def attach_ssd(self, tier: SsdTier) -> None:
        """Put ``tier`` below the DRAM tier: evictions are offered to it for write-back."""
        self.ssd = tier
        self.engine.on_evict = tier.on_evict

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
        if self.ssd is not None:
            self.ssd.namespaces_changed()
        return {
            "ns_id": ns_id,
            "part_bytes": spec.part_bytes,
            "key_size": spec.key_size,
            "tp_world_size": spec.tp_world_size,
            "chunk_tokens": spec.chunk_tokens,
        }

    def list_namespaces(self) -> list[NamespaceSpec]:
        return list(self.engine.namespaces.values())

    # ------------------------------------------------------------------ queries

    def lookup(
        self, ns_id: str, keys: Sequence[bytes], *, record: bool = False, touch: bool = False
    ) -> LookupResult:
        hits = self.engine.lookup(ns_id, keys, record=record, touch=touch)
        spec = self.engine.namespace(ns_id)
        if self.ssd is None:
            return LookupResult(ns_id, hits, hits * spec.chunk_tokens, len(keys), {"dram": hits})
        more, ssd = self.ssd.lookup_tail(ns_id, keys, hits, touch=touch)
        total = hits + more + ssd
        if touch and more:
            self.engine.touch(ns_id, keys[:total])
        tiers = {"dram": hits + more, "ssd": ssd}
        return LookupResult(ns_id, total, total * spec.chunk_tokens, len(keys), tiers)

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
    ) -> LookupResult:
        keys = self.chunk_keys_for_tokens(ns_id, token_ids, cache_salt=cache_salt, lora=lora)
        return self.lookup(ns_id, keys)

    def touch(self, ns_id: str, keys: Sequence[bytes]) -> None:
        self.engine.touch(ns_id, keys)

    def stats(self) -> dict[str, Any]:
        out = self.engine.stats().to_dict()
        out["events_last_seq"] = self.events.last_seq
        out["server_version"] = __version__
        out["ssd"] = self.ssd.stats() if self.ssd is not None else None
        out["cluster"] = self.cluster.stats() if self.cluster is not None else None
        return out

    def held_chunks(self) -> dict[tuple[str, str], list[bytes]]:
        """Visible chunk keys per (namespace id, tier "dram"/"ssd"): the fleet index's resync."""
        out = {(ns, "dram"): keys for ns, keys in self.engine.held_keys().items()}
        if self.ssd is not None:
            out.update({(ns, "ssd"): keys for ns, keys in self.ssd.index.held_keys().items()})
        return out

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

    def needs_promotion(self, ns_id: str, keys: Sequence[bytes]) -> bool:
        """True if some of ``keys`` must be promoted from SSD before a load can pin them."""
        return self.ssd is not None and self.ssd.needs_promotion(ns_id, keys)

    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False
    ) -> dict[bytes, list[memoryview]]:
        """Promote the keys that are only on SSD into DRAM (see ``SsdTier.promote``)."""
        if self.ssd is None:
            return {}
        try:
            return await self.ssd.promote(ns_id, keys, direct=direct)
        finally:
            self._publish()

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
