"""Builders for the storage-engine tests: small specs, small engines, a fake clock, keys and
deterministic payloads. Plain functions, no fixtures: every test says what it builds."""

from __future__ import annotations

import hashlib
from typing import Any

from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig
from kvserver.grants import StoreGrant
from kvserver.namespace import NamespaceSpec

#: the smallest page the allocator accepts; test arenas are a handful of these.
PAGE = 4096


class FakeClock:
    """An injectable engine clock that only moves when told to."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def make_spec(**overrides: Any) -> NamespaceSpec:
    """A valid spec whose part is exactly one 4 KiB page (2 layers x K,V x 2 heads x 16 dims x
    16 tokens x fp16); override any field."""
    fields: dict[str, Any] = {
        "model": "test/model",
        "dtype": "float16",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "block_size": 16,
    }
    fields.update(overrides)
    return NamespaceSpec(**fields)


def make_engine(
    policy: str = "lru",
    *,
    num_pages: int = 16,
    page_size: int = PAGE,
    clock: FakeClock | None = None,
    **config: Any,
) -> StorageEngine:
    """An engine over a ``num_pages`` arena driven by ``clock`` (a fresh FakeClock if None).
    Use it as a context manager so the shared-memory file is removed."""
    cfg = EngineConfig(
        dram_bytes=num_pages * page_size, page_size=page_size, policy=policy, **config
    )
    return StorageEngine(cfg, clock=clock or FakeClock())


def make_keys(n: int, *, start: int = 0, size: int = 32, tag: str = "k") -> list[bytes]:
    """``n`` distinct keys of ``size`` bytes (deterministic: key i is the same in every test)."""
    return [hashlib.sha256(f"{tag}{i}".encode()).digest()[:size] for i in range(start, start + n)]


def pattern(key: bytes, rank: int, nbytes: int) -> bytes:
    """A payload that differs for every (key, rank): detects a part read from the wrong slot."""
    seed = hashlib.sha256(key + rank.to_bytes(2, "little")).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def write_all(engine: StorageEngine, grant: StoreGrant) -> None:
    """Write the pattern payload of every part of every key reserved by ``grant``."""
    spec = engine.namespace(grant.ns_id)
    for key in grant.keys:
        for rank in range(spec.tp_world_size):
            engine.write_part(grant.lease_id, key, rank, pattern(key, rank, spec.part_bytes))


def store(engine: StorageEngine, ns_id: str, keys: list[bytes], **kwargs: Any) -> StoreGrant:
    """prepare_store + write every part + complete_store; the keys are READY afterwards."""
    grant = engine.prepare_store(ns_id, keys, **kwargs)
    assert grant is not None, "store did not fit"
    if grant.keys:
        write_all(engine, grant)
        engine.complete_store(grant.lease_id)
    return grant


def store_each(engine: StorageEngine, ns_id: str, keys: list[bytes]) -> None:
    """:func:`store` one key per request, in order: the first key is the oldest for every
    policy (within one request a prefix-aware policy evicts the later keys first)."""
    for key in keys:
        store(engine, ns_id, [key])


def read_back(engine: StorageEngine, lease_id: int, key: bytes, rank: int) -> bytes:
    """The bytes of one pinned part, joined from its zero-copy views."""
    return b"".join(bytes(view) for view in engine.read_part(lease_id, key, rank))
