"""The typed replies of :class:`kvserver.grpc_client.GrpcClient` (plain frozen dataclasses,
built from the protobuf replies of ``kvserver.v1.KVServer``), beside the client so that a router
can hold and pass them without the client's grpc channel code."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvserver.namespace import NamespaceSpec


@dataclass(frozen=True, slots=True)
class LookupReply:
    namespace_id: str
    #: leading run of cached chunks, and its tokens (hit_chunks * chunk_tokens).
    hit_chunks: int
    hit_tokens: int
    #: chunks in the query.
    num_chunks: int
    chunk_tokens: int
    #: hit chunks per tier, fastest first, e.g. {"dram": 3, "ssd": 1}.
    tiers: dict[str, int]


@dataclass(frozen=True, slots=True)
class PinReply:
    #: chunks pinned (Pin) or whose pin was dropped (Unpin), of num_chunks in the prefix.
    chunks: int
    num_chunks: int


@dataclass(frozen=True, slots=True)
class NamespaceReply:
    namespace_id: str
    spec: NamespaceSpec
    part_bytes: int
    key_size: int
    chunk_tokens: int


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    medium: str
    policy: str
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    reserved_bytes: int
    entries: int
    hit_chunks: int
    miss_chunks: int
    evicted_chunks: int
    stored_chunks: int
    loaded_chunks: int
    lookups: int
    #: "ok", "degraded" or "unavailable" (SSD); see kvserver.proto TierStats.
    condition: str = "ok"
    condition_detail: str = ""
    corrupt_chunks: int = 0
    recovered_chunks: int = 0
    promoted_chunks: int = 0
    io_errors: int = 0
    skipped_chunks: int = 0
    io_mode: str = ""


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    namespace_id: str
    model: str
    entries: int
    bytes: int
    lookups: int
    hit_chunks: int
    miss_chunks: int
    stored_chunks: int
    loaded_chunks: int
    evicted_chunks: int
    rolled_back_chunks: int
    filtered_chunks: int
    store_rejections: int
    expired_leases: int
    #: tier name → (entries, bytes), fastest first.
    tiers: dict[str, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class ServerStats:
    server_version: str
    host_id: str
    tiers: list[TierStats]
    namespaces: list[NamespaceStats]
    num_leases: int
    event_log_id: str
    events_last_seq: int
    events_oldest_seq: int
    #: the ClusterStats fields (docs/cluster.md) when the daemon is in a fleet, else None.
    cluster: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def copy_fields(cls: Any, msg: Any, **override: Any) -> Any:
    """``cls`` built from the same-named fields of ``msg`` (plus ``override``)."""
    names = [f.name for f in fields(cls) if f.name not in override]
    return cls(**{name: getattr(msg, name) for name in names}, **override)
