"""The fleet's Redis under memory pressure (real redis-server with ``maxmemory``):

- an eviction policy (``allkeys-*``, ``volatile-*``) lets Redis evict one of a member's index
  sets while its record and write fence stay: no write fails, so nothing else notices; the
  member's heartbeat counts its sets and resyncs;
- ``noeviction``: writes fail with OOM; the member reports it (``unavailable``, the error in
  ``condition_detail``) and retries by one small write, not by sending its whole index again,
  and registers again once Redis has room.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.cluster import FleetReader, schema
from kvserver.cluster.config import connect
from kvserver.cluster.node import OOM_HINT
from tests.kvserver.cluster.builders import NS, Member, cluster_config, eventually, keys
from tests.support.redis import RedisServer, require_redis


def used_memory(server: RedisServer) -> int:
    info = dict(
        line.split(":", 1) for line in server.cli("INFO", "memory").splitlines() if ":" in line
    )
    return int(info["used_memory"])


def net_input_bytes(server: RedisServer) -> int:
    stats = dict(
        line.split(":", 1) for line in server.cli("INFO", "stats").splitlines() if ":" in line
    )
    return int(stats["total_net_input_bytes"])


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
        server.cli("CONFIG", "SET", "maxmemory", str(used_memory(server) + 50_000))
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


async def test_a_full_redis_under_noeviction_is_reported_retried_cheaply_and_rejoined(
    tmp_path: Path,
) -> None:
    """Writes refused (OOM): the member is ``unavailable`` with the error, keeps retrying,
    and each retry sends one small write (its resync's fence), not its 20,000 fingerprints
    (~350 kB a retry before, every second); with room again it registers and resyncs."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis", "--maxmemory-policy", "noeviction")
    config = cluster_config(server.url, ttl_s=3.0, heartbeat_s=0.3)
    a = Member("host-a", config)
    node = await a.start()
    reader = FleetReader(connect(config), config)
    try:
        ks = keys(20_001)
        a.store(ks[:20_000])
        await a.settled()
        server.cli("CONFIG", "SET", "maxmemory", str(used_memory(server) - 100_000))
        a.store(ks[20_000:])

        async def unavailable() -> bool:
            return node.condition == "unavailable"

        await eventually(unavailable, timeout=5.0)
        assert "OutOfMemoryError" in node.condition_detail, node.condition_detail
        assert OOM_HINT in node.condition_detail
        errors, sent = node.counters.errors, net_input_bytes(server)

        async def retried() -> bool:
            return node.counters.errors >= errors + 3

        await eventually(retried, timeout=10.0)
        per_retry = (net_input_bytes(server) - sent) / (node.counters.errors - errors)
        assert per_retry < 20_000, per_retry  # 283 kB before (the resync of 20,000 chunks)
        server.cli("CONFIG", "SET", "maxmemory", "0")

        async def rejoined() -> bool:
            runs = await reader.lookup(NS, ks)
            return node.condition == "ok" and [r.hit_chunks for r in runs] == [20_001]

        await eventually(rejoined, timeout=10.0)
    finally:
        await reader.redis.aclose()
        await node.stop()
        server.stop()
