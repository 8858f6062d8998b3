"""FleetReader's member list against a real redis-server (Redis and Valkey, either client)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvserver.cluster import FleetReader, schema
from kvserver.cluster.config import connect
from kvserver.cluster.schema import HostInfo
from tests.kvserver.cluster.builders import cluster_config
from tests.support.redis import RedisServer


class AfterMget:
    """The reader's own client, with ``hook`` run once right after its first ``MGET`` returns
    (the only way to put another client's writes between two of the reader's commands)."""

    def __init__(self, redis: Any, hook: Callable[[], Awaitable[None] | None]) -> None:
        self._redis, self._hook = redis, hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)

    async def mget(self, *args: Any, **kw: Any) -> Any:
        out = await self._redis.mget(*args, **kw)
        hook, self._hook = self._hook, lambda: None
        hook()
        return out


def record(host_id: str) -> bytes:
    return HostInfo(host_id, "inc2", "tcp://127.0.0.1:1", "127.0.0.1:2").encode()


async def test_a_member_registering_again_between_the_read_and_the_cleanup_stays_listed(
    fleet_server: RedisServer, fleet_url: str
) -> None:
    """host-a's record expired (it stalled past its TTL, or Redis lost it); the reader reads
    its id in the hosts set and no record, then host-a registers again (its record written,
    its SADD a no-op since the id is still there) before the reader cleans the set up: the
    reader must not forget it (it would be hidden from every reader until its next
    heartbeat)."""
    config = cluster_config(fleet_url)
    fleet_server.cli("SADD", schema.hosts_key(), "host-a", "host-b")
    fleet_server.cli("SET", schema.host_key("host-b"), record("host-b"), "PX", "60000")

    def registers_again() -> None:  # what ClusterNode's registration writes
        fleet_server.cli("SET", schema.host_key("host-a"), record("host-a"), "PX", "60000")
        fleet_server.cli("SADD", schema.hosts_key(), "host-a")

    redis = connect(config)
    try:
        reader = FleetReader(AfterMget(redis, registers_again), config)
        assert [h.host_id for h in await reader.hosts(refresh=True)] == ["host-b"]
        assert fleet_server.cli("SISMEMBER", schema.hosts_key(), "host-a") == "1"
        assert [h.host_id for h in await reader.hosts(refresh=True)] == ["host-a", "host-b"]
    finally:
        await redis.aclose()


async def test_a_member_whose_record_expired_is_forgotten(
    fleet_server: RedisServer, fleet_url: str
) -> None:
    config = cluster_config(fleet_url)
    fleet_server.cli("SADD", schema.hosts_key(), "host-a", "host-b")
    fleet_server.cli("SET", schema.host_key("host-b"), record("host-b"), "PX", "60000")
    redis = connect(config)
    try:
        reader = FleetReader(redis, config)
        assert [h.host_id for h in await reader.hosts(refresh=True)] == ["host-b"]
        assert fleet_server.cli("SMEMBERS", schema.hosts_key()).split() == ["host-b"]
    finally:
        await redis.aclose()


async def test_a_lookup_goes_on_while_the_server_pauses_writes_with_a_member_to_forget(
    fleet_server: RedisServer, fleet_url: str
) -> None:
    """A failover pauses writes (CLIENT PAUSE WRITE) while a dead member's id is still in
    the hosts set (its record expired): a lookup's refresh of the members reads them and
    answers; forgetting the dead id (a script that writes) is left to a member's heartbeat
    (the lookup waited for the pause behind it and timed out: the network tier found no
    holder and ScoreHosts answered UNAVAILABLE all through the failover)."""
    config = cluster_config(fleet_url, timeout_s=1.0)
    inc = "inc2"
    info = HostInfo("host-b", inc, "tcp://127.0.0.1:1", "127.0.0.1:2", namespaces=("ns1",))
    fleet_server.cli("SADD", schema.hosts_key(), "host-a", "host-b")
    fleet_server.cli("SET", schema.host_key("host-b"), info.encode(), "PX", "60000")
    ks = [bytes([i]) * 32 for i in range(3)]
    dram = schema.index_key("host-b", inc, "ns1", schema.TIER_DRAM)
    redis = connect(config)
    try:
        await redis.sadd(dram, *map(schema.fingerprint, ks))
        reader = FleetReader(redis, config)
        with fleet_server.paused(3000, "WRITE"):
            runs = await reader.lookup("ns1", ks)
            assert [(r.host.host_id, r.hit_chunks) for r in runs] == [("host-b", 3)]
        assert [h.host_id for h in await reader.hosts(refresh=True)] == ["host-b"]
        assert fleet_server.cli("SMEMBERS", schema.hosts_key()).split() == ["host-b"]
    finally:
        await redis.aclose()
