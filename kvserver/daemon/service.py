"""The daemon's operations, independent of transport.

Runs on the daemon's one event loop; the ZMQ front end (``zmq_server.py``) and the gRPC front
end (``grpc_server.py``) both call it, so the two APIs cannot drift apart. It owns the storage
engine and the event log; after every mutating call it moves the engine's new events into the
log (which wakes WatchEvents streams and the ZMQ PUB publisher).

Inputs are typed Python values; each front end decodes and type-checks its wire format first.
Errors are :class:`~kvserver.errors.KVServerError` subclasses, mapped to error replies / gRPC
status codes by the front ends only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserver import __version__
from kvserver.daemon.eventlog import EventLog
from kvserver.engine import StorageEngine
from kvserver.engine_types import EngineConfig, LoadGrant, StoreGrant
from kvserver.errors import InvalidArgument
from kvserver.hashing import BlockHasher
from kvserver.namespace import NamespaceSpec
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

    def __init__(self, engine_config: EngineConfig, *, event_capacity: int = 100_000) -> None:
        self.engine = StorageEngine(engine_config)
        self.events = EventLog(event_capacity)
        self.host_id = host_id()
        self._hashers: dict[str, BlockHasher] = {}

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
        return LookupResult(ns_id, hits, hits * spec.chunk_tokens, len(keys), {"dram": hits})

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

    def _publish(self) -> None:
        events = self.engine.take_events()
        if events:
            self.events.extend(events)
