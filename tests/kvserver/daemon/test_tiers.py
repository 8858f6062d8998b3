"""kvserver/daemon/tiers.py and the service's tier stack, in one process, with a tier of our
own that keeps evicted chunks in memory and, like a network tier, cannot answer a lookup
without I/O (``holds`` is None; ``query`` awaits a loop turn).

A lookup through such a tier is Pending and then reports the per-tier split, DRAM keys past a
lower-tier key included; the ZMQ handlers turn it into a Deferred; a load of chunks only in the
tier promotes them first; a ``get`` when DRAM is fully pinned is served from the tier's bytes;
evictions are offered to every tier of the stack in order; names are unique.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.results import Fetched, LookupHits, Pending
from kvserver.daemon.service import KVService
from kvserver.daemon.tiers import OK, DirectParts, Tier
from kvserver.daemon.zmq_ops import DataOps, Deferred, OpCall
from kvserver.daemon.zmq_send import ZeroCopySender
from kvserver.engine.types import EngineConfig, Entry
from kvserver.events import MEDIUM_SSD
from kvserver.grants import LoadGrant
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import PAGE, make_keys, make_spec, pattern

SPEC = make_spec()  # one page per part
DRAM_PAGES = 4


@dataclass
class MemoryTier(Tier):
    """Keeps a copy of every evicted chunk; lookups need "I/O" (one loop turn)."""

    svc: KVService
    chunks: dict[tuple[str, bytes], list[bytes]] = field(default_factory=dict)
    queries: int = 0
    recorded: list[tuple[list[bytes], int]] = field(default_factory=list)
    offered: list[bytes] = field(default_factory=list)

    name = "mem"
    medium = MEDIUM_SSD

    @property
    def condition(self) -> str:
        return OK

    async def open(self) -> None:
        return

    async def close(self) -> None:
        return

    def holds(self, ns_id: str, key: bytes) -> bool | None:
        return None

    async def query(self, ns_id: str, keys: Sequence[bytes]) -> list[bool]:
        self.queries += 1
        await asyncio.sleep(0)  # the round trip
        return [(ns_id, k) in self.chunks for k in keys]

    def record_lookup(self, ns_id: str, hits: Sequence[bytes], misses: int, *, touch: bool) -> None:
        self.recorded.append((list(hits), misses))

    def _only_here(self, ns_id: str, keys: Sequence[bytes]) -> list[bytes]:
        contains = self.svc.engine.contains
        return [k for k in keys if (ns_id, k) in self.chunks and not contains(ns_id, k)]

    def needs_promotion(self, ns_id: str, keys: Sequence[bytes]) -> bool:
        return bool(self._only_here(ns_id, keys))

    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False
    ) -> DirectParts:
        await asyncio.sleep(0)
        engine = self.svc.engine
        todo = self._only_here(ns_id, keys)
        protect = [k for k in keys if engine.contains(ns_id, k)]  # not evicted for this
        grant = engine.prepare_store(ns_id, protect + todo, client="mem", gated=False)
        taken = set(grant.keys) if grant is not None else set()
        for key in taken:
            for rank, part in enumerate(self.chunks[(ns_id, key)]):
                engine.write_part(grant.lease_id, key, rank, part)  # type: ignore[union-attr]
        if grant is not None:
            engine.complete_store(grant.lease_id)
        if not direct:
            return {}
        return {k: [memoryview(p) for p in self.chunks[(ns_id, k)]] for k in todo if k not in taken}

    def on_evict(self, spec: NamespaceSpec, victims: list[Entry]) -> None:
        views = self.svc.engine.arena.views
        for victim in victims:
            self.offered.append(victim.key)
            self.chunks[(spec.ns_id, victim.key)] = [
                b"".join(bytes(v) for v in views(ext))[: spec.part_bytes] for ext in victim.extents
            ]

    def stats(self) -> dict[str, Any]:
        return {"condition": OK, "entries": len(self.chunks)}


@pytest.fixture
async def svc() -> AsyncIterator[KVService]:
    service = KVService(EngineConfig(dram_bytes=DRAM_PAGES * PAGE, page_size=PAGE))
    service.register_namespace(SPEC)
    yield service
    await service.close_tiers()
    service.engine.check_invariants()
    service.close()


def put(svc: KVService, keys: list[bytes]) -> None:
    for key in keys:  # one at a time, so DRAM evicts as it fills
        r = svc.put(SPEC.ns_id, [key], [pattern(key, 0, SPEC.part_bytes)], client="c")
        assert r.stored == [key]


async def finish(r: Any) -> Any:
    assert isinstance(r, Pending), r
    return await r.run()


async def test_a_lookup_through_a_tier_that_needs_io_is_pending_then_split_per_tier(
    svc: KVService,
) -> None:
    tier = MemoryTier(svc)
    svc.add_tier(tier)
    keys = make_keys(6, tag="t")
    put(svc, keys)  # 4 fit: keys 0, 1 evicted into the tier
    assert [k for k in keys if svc.engine.contains(SPEC.ns_id, k)] == keys[2:]
    result = await finish(svc.lookup(SPEC.ns_id, [*keys, b"x" * 32]))
    assert isinstance(result, LookupHits)
    assert result.tiers == {"dram": 4, "mem": 2}
    assert result.hit_chunks == 6 and result.num_chunks == 7
    assert tier.recorded == [(keys[:2], 1)]
    assert tier.queries == 1


async def test_a_lookup_that_all_hits_dram_asks_no_tier_for_io(svc: KVService) -> None:
    tier = MemoryTier(svc)
    svc.add_tier(tier)
    keys = make_keys(2, tag="d")
    put(svc, keys)
    result = svc.lookup(SPEC.ns_id, keys)
    assert isinstance(result, LookupHits)  # synchronous: the fast path
    assert result.tiers == {"dram": 2, "mem": 0}
    assert tier.queries == 0


async def test_zmq_lookup_and_load_defer_when_a_tier_needs_io(svc: KVService) -> None:
    tier = MemoryTier(svc)
    svc.add_tier(tier)
    keys = make_keys(6, tag="z")
    put(svc, keys)
    config = DaemonConfig()
    sender = ZeroCopySender(svc)
    ops = DataOps(svc, config, "sid", sender)
    args = {"ns_id": SPEC.ns_id, "keys": keys[:3], "record": None, "touch": None}
    args["local"] = None
    deferred = ops.handle("lookup", OpCall(args, [], "c"))
    assert isinstance(deferred, Deferred)
    reply = await deferred.run()
    assert isinstance(reply, dict)
    assert reply["tiers"] == {"dram": 1, "mem": 2}
    load = ops.handle("prepare_load", OpCall({**args, "lease_s": None, "packed": None}, [], "c"))
    assert isinstance(load, Deferred)  # keys 0, 1 must be promoted first
    grant = await load.run()
    assert isinstance(grant, dict) and grant["grant"]["lease_id"] > 0
    svc.complete_load(grant["grant"]["lease_id"])
    await sender.close()


async def test_a_load_promotes_chunks_only_in_a_lower_tier(svc: KVService) -> None:
    svc.add_tier(MemoryTier(svc))
    keys = make_keys(6, tag="l")
    put(svc, keys)
    grant = await finish(svc.load(SPEC.ns_id, keys[:2], client="c"))
    assert isinstance(grant, LoadGrant)
    try:
        for key in keys[:2]:
            got = b"".join(bytes(v) for v in svc.read_part(grant.lease_id, key, 0))
            assert got == pattern(key, 0, SPEC.part_bytes)
    finally:
        svc.complete_load(grant.lease_id)


async def test_get_is_served_from_the_tier_when_dram_is_fully_pinned(svc: KVService) -> None:
    svc.add_tier(MemoryTier(svc))
    keys = make_keys(6, tag="g")
    put(svc, keys)
    pins = svc.prepare_load(SPEC.ns_id, keys[2:], client="p")  # DRAM cannot evict
    try:
        got = await finish(svc.get(SPEC.ns_id, keys[:1], None, client="c"))
        assert isinstance(got, Fetched)
        assert got.lease_id == 0  # nothing in DRAM to pin
        assert bytes(got.parts[0][0]) == pattern(keys[0], 0, SPEC.part_bytes)
    finally:
        svc.complete_load(pins.lease_id)


async def test_evictions_are_offered_to_every_tier_in_order(svc: KVService) -> None:
    class Second(MemoryTier):
        name = "mem2"

    first, second = MemoryTier(svc), Second(svc)
    svc.add_tier(first)
    svc.add_tier(second)
    keys = make_keys(5, tag="e")
    put(svc, keys)
    assert first.offered == second.offered == keys[:1]
    assert set(svc.stats()) >= {"mem", "mem2"}
    result = await finish(svc.lookup(SPEC.ns_id, keys))
    assert result.tiers == {"dram": 4, "mem": 1, "mem2": 0}  # the fastest tier holding it


def test_tier_names_are_unique_in_a_stack() -> None:
    service = KVService(EngineConfig(dram_bytes=DRAM_PAGES * PAGE, page_size=PAGE))
    try:
        service.add_tier(MemoryTier(service))
        with pytest.raises(ValueError, match="already in the stack"):
            service.add_tier(MemoryTier(service))
    finally:
        service.close()


async def test_a_peers_question_never_reaches_a_tier_of_other_hosts(svc: KVService) -> None:
    """lookup local= and get leading= (asked by a peer) consult this host's own tiers only."""

    class Remote(MemoryTier):
        local = False

    tier = Remote(svc)
    svc.add_tier(tier)
    keys = make_keys(6, tag="p")
    put(svc, keys)  # keys 0, 1 only in the remote tier
    result = svc.lookup(SPEC.ns_id, keys, local=True)
    assert isinstance(result, LookupHits)  # no I/O: the remote tier is not asked
    assert result.tiers == {"dram": 0} and tier.queries == 0
    got = svc.get(SPEC.ns_id, keys[2:] + keys[:2], None, client="c", leading=True)
    assert isinstance(got, Fetched)  # nothing to promote from this host's tiers
    assert got.keys == keys[2:]
    svc.complete_load(got.lease_id)
