"""The fleet's Redis under memory pressure (real redis-server with ``maxmemory``):

- an eviction policy (``allkeys-*``, ``volatile-*``) lets Redis evict one of a member's index
  sets while its record and write fence stay: no write fails, so nothing else notices; the
  member's heartbeat counts its sets and resyncs;
- ``noeviction``: Redis refuses the index's adds (OOM) and nothing else the member sends: it
  stays in the fleet, reports it (``degraded``, the error in ``condition_detail``,
  ``redis_full``), defers the refused adds and writes them once Redis has room.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from kvserver.cluster import FleetReader, schema
from kvserver.cluster.config import connect
from kvserver.cluster.full import OOM_HINT
from tests.kvserver.cluster.builders import NS, Member, cluster_config, eventually, keys
from tests.support.redis import FLEET_SERVERS, RedisServer, require_redis, server_binary


async def used_memory(redis: Any) -> int:
    """The server's ``used_memory``, read through the test's own client (each INFO bounded by
    its timeout, asked again while one times out). Was parsed from ``redis-cli INFO memory``,
    which under load once printed nothing: KeyError 'used_memory'."""
    used: list[int] = []

    async def answered() -> bool:
        try:
            info = await redis.info("memory")
        except (TimeoutError, ConnectionError, RedisTimeout, RedisConnectionError):
            return False
        used.append(int(info["used_memory"]))
        return True

    await eventually(answered, timeout=60.0)
    return used[-1]


@pytest.mark.parametrize("policy", ["allkeys-lfu", "volatile-lfu"])
async def test_an_index_set_redis_evicts_is_found_by_the_heartbeat_and_resynced(
    tmp_path: Path, policy: str
) -> None:
    """LFU with ``lfu-log-factor 0`` (every access counts) makes the eviction deterministic:
    the record, the fence, the hosts set and the specs are touched more often than the
    member's DRAM set, which Redis evicts to make room for another client's value. Before,
    the member kept heartbeating and writing (a later store even re-created the set, with
    its one new member): the fleet saw host-a holding 1 chunk of 20,000, for ever."""
    require_redis()
    server = RedisServer.start(
        tmp_path / "redis", "--maxmemory-policy", policy, "--lfu-log-factor", "0",
        "--maxmemory-samples", "64",
    )  # fmt: skip
    config = cluster_config(server.url, ttl_s=30.0, heartbeat_s=0.5)
    a = Member("host-a", config)
    node = await a.start()
    reader = FleetReader(connect(config), config)
    try:
        ks = keys(20_001)
        a.store(ks[:20_000])
        await a.settled()
        dram = node.writer.index_keys()[0]
        others = [schema.host_key("host-a"), schema.hosts_key(), schema.namespaces_key(),
                  node.writer.fence_key]  # fmt: skip
        other_client = reader.redis
        for _ in range(300):  # their LFU counters to 255, above the set's
            await other_client.execute_command("TOUCH", *others)
        server.cli("CONFIG", "SET", "maxmemory", str(await used_memory(other_client) + 50_000))
        ttl = 600_000 if policy.startswith("volatile") else None
        assert await other_client.set("other-client", b"x" * 500_000, px=ttl)
        server.cli("CONFIG", "SET", "maxmemory", "0")
        assert server.cli("EXISTS", dram) == "0"  # evicted: the set alone
        assert server.cli("EXISTS", *others) == str(len(others))
        a.store(ks[20_000:])  # re-creates the set, with this one chunk

        async def whole_again() -> bool:
            runs = await reader.lookup(NS, ks)
            return [r.hit_chunks for r in runs] == [20_001]

        await eventually(whole_again, timeout=10.0)
        assert node.stats()["index_losses"] == 1 and node.condition == "ok"
    finally:
        await reader.redis.aclose()
        await node.stop()
        server.stop()


@pytest.mark.parametrize("kind", FLEET_SERVERS)
async def test_a_full_redis_under_noeviction_keeps_the_members_and_defers_the_adds(
    tmp_path: Path, kind: str
) -> None:
    """Redis full (``noeviction``): the member's heartbeat needs no room (the record's
    renewal, the hosts entry, the specs and the fence are ``allow-oom`` scripts that change
    nothing, or a few bytes), so it stays in the fleet for many TTLs, seen by another member
    at every poll, never registering again; it reports ``degraded`` with the error and the
    adds deferred; its removes still reach the index (they free memory) and its refused adds
    are not sent again with every batch; with room again they go in, and it is ``ok``.
    Before: the heartbeat's first command (the record's ``SET``) was refused, the member went
    ``unavailable``, its record expired (the other member saw it leave), its sets with it,
    and it registered again once that freed memory: it left and rejoined over and over."""
    server = RedisServer.start(tmp_path / kind, "--maxmemory-policy", "noeviction",
                               binary=server_binary(kind))  # fmt: skip
    ttl_s, heartbeat_s = 3.0, 0.3
    config = cluster_config(server.url, ttl_s=ttl_s, heartbeat_s=heartbeat_s)
    a, b = Member("host-a", config), Member("host-b", config)
    node = await a.start()
    other = await b.start()
    reader = FleetReader(connect(config), config)
    try:
        ks = keys(5_002)
        a.store(ks[:5_000])
        await a.settled()
        server.cli("CONFIG", "SET", "maxmemory", str(await used_memory(reader.redis) // 2))
        a.evict(ks[:1])  # a remove: done while full
        a.store(ks[5_000:])  # two adds: refused, deferred

        async def degraded() -> bool:
            return node.condition == "degraded"

        await eventually(degraded, timeout=10.0)
        assert "OutOfMemoryError" in node.condition_detail and OOM_HINT in node.condition_detail
        assert node.stats()["redis_full"] == 1 and node.stats()["deferred_keys"] == 2
        beats, sent = node.counters.heartbeats, node.counters.indexed_keys
        registrations = node.counters.registrations
        seen: list[bool] = []

        async def three_ttls_later() -> bool:  # b's view of the fleet, polled all along
            hosts = await other.reader.hosts(refresh=True)
            seen.append("host-a" in {h.host_id for h in hosts})
            return node.counters.heartbeats >= beats + 3 * ttl_s / heartbeat_s

        await eventually(three_ttls_later, timeout=60.0)
        assert all(seen) and len(seen) > 10, seen.count(False)
        assert node.condition == "degraded"
        assert node.counters.registrations == registrations and node.counters.errors == 0
        assert int(server.cli("EXISTS", schema.host_key("host-a"))) == 1
        # the 2 refused adds, retried at most every 0.5 s (the backoff, capped at 1 s here):
        # never the index again (5,000 keys a resync)
        assert node.counters.indexed_keys - sent < 100, node.counters.indexed_keys - sent
        run = await reader.lookup(NS, ks[1:5_000])
        assert [r.hit_chunks for r in run] == [4_999]  # the remove went in
        assert await reader.lookup(NS, ks[:1]) == [] and await reader.lookup(NS, ks[5_000:]) == []
        server.cli("CONFIG", "SET", "maxmemory", "0")

        async def whole() -> bool:
            runs = await reader.lookup(NS, ks[1:])
            return node.condition == "ok" and [r.hit_chunks for r in runs] == [5_001]

        await eventually(whole, timeout=20.0)
        assert node.stats()["redis_full"] == 0 and node.stats()["deferred_keys"] == 0
        assert node.counters.registrations == registrations  # no resync: the adds went in
    finally:
        await reader.redis.aclose()
        await other.stop()
        await node.stop()
        server.stop()
