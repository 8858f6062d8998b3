"""A Redis that stalls (``CLIENT PAUSE ... ALL``, as a slow command or a blocked server does):
lookups stay bounded, the member stays in the fleet through a stall shorter than its TTL, and
index changes it could not write (piled up behind a stuck batch, or events it missed) are made
good by a resync."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

from kvserver.cluster import FleetReader
from kvserver.cluster.config import connect
from kvserver.daemon.peers import fleet
from kvserver.daemon.peers.fleet import FleetDirectory
from kvserver.errors import Unavailable
from kvserver.eventlog import EventLog
from tests.kvserver.cluster.builders import NS, Member, cluster_config, eventually, keys
from tests.support.redis import RedisServer, require_redis


async def test_after_a_lookup_redis_did_not_answer_the_next_ones_do_not_wait(
    tmp_path: Path,
) -> None:
    """Before, each lookup that missed locally waited the whole cluster timeout while Redis
    stalled (5 lookups: 5 timeouts, 1 s each by default) until the node's own writes timed
    out; now the first waits, the next ones in the following second answer no holders at
    once, and lookups resume when Redis answers again."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=30.0, timeout_s=0.3, members_max_age_s=0.5)
    a, b = Member("host-a", config), Member("host-b", config)
    await a.start()
    node_b = await b.start()
    try:
        ks = keys(4)
        a.store(ks)
        await a.settled()
        directory = FleetDirectory(node_b)

        async def found() -> bool:
            return await directory.holders(NS, ks) == [frozenset({"host-a"})] * 4

        await eventually(found)
        with server.paused(5000, "ALL"):  # (ends when the pause does: nothing ends it early)
            assert await directory.holders(NS, ks) == []  # waited one timeout
            started = time.monotonic()
            for _ in range(4):
                assert await directory.holders(NS, ks) == []
            assert time.monotonic() - started < config.timeout_s
            assert (directory.unavailable_lookups, directory.skipped_lookups) == (1, 4)
            assert directory.error
        await eventually(found, timeout=fleet.RETRY_S + 5.0)
    finally:
        for m in (a, b):
            if m.node is not None:
                await m.node.stop()
        server.stop()


async def test_a_member_stays_in_the_fleet_through_a_stall_shorter_than_its_ttl(
    tmp_path: Path,
) -> None:
    """Redis blocks 2.5 s (``DEBUG SLEEP``: keys expire by the clock meanwhile), past the
    member's 4 x 0.3 s bound on a heartbeat (it goes ``unavailable``) but inside its 6 s TTL:
    its record never expires, readers list it after, and it registers again under the same
    incarnation."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis", "--enable-debug-command", "yes")
    config = cluster_config(server.url, ttl_s=6.0, heartbeat_s=0.5, timeout_s=0.3)
    a = Member("host-a", config)
    node = await a.start()
    reader = FleetReader(connect(config), config)
    sleeper = None
    try:
        ks = keys(4)
        a.store(ks)
        await a.settled()
        incarnation = node.incarnation
        cli = ["redis-cli", "-p", str(server.port), "DEBUG", "SLEEP", "2.5"]
        sleeper = subprocess.Popen(cli, stdout=subprocess.DEVNULL)

        async def unavailable() -> bool:
            return node.condition == "unavailable"

        await eventually(unavailable, timeout=5.0)  # the heartbeat timed out: Redis sleeps

        async def listed() -> list[tuple[str, str]] | None:  # once Redis answers again
            with contextlib.suppress(Unavailable):
                return [(h.host_id, h.incarnation) for h in await reader.hosts()]
            return None

        assert await eventually(listed, timeout=10.0) == [("host-a", incarnation)]

        async def back() -> bool:
            runs = await reader.lookup(NS, ks)
            return node.condition == "ok" and [r.hit_chunks for r in runs] == [4]

        await eventually(back, timeout=10.0)
        assert node.incarnation == incarnation
    finally:
        if sleeper is not None:
            sleeper.wait(10)
        await reader.redis.aclose()
        await node.stop()
        server.stop()


async def test_changes_piling_up_behind_a_stuck_batch_are_dropped_and_resynced(
    tmp_path: Path,
) -> None:
    """docs/cluster.md, "events dropped": Redis pauses writes with a batch in flight, and
    more index changes than ``max_pending_keys`` pile up behind it: they are dropped (counted
    in ``dropped_keys``), and once Redis writes again the member resyncs from its tiers, so
    the index names every chunk it holds, the dropped ones included."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=30.0, max_pending_keys=50)
    a = Member("host-a", config)
    node = await a.start()
    reader = FleetReader(connect(config), config)
    try:
        ks = keys(200)
        a.store(ks[:10])
        await a.settled()
        resyncs = node.counters.resyncs
        with server.paused(30_000, "WRITE"):  # unpaused as the block ends
            a.store(ks[10:11])

            async def stuck() -> bool:  # taken into a batch, not written: Redis is paused
                return node.writer.pending_keys == 0 and node.written_seq < a.seq

            await eventually(stuck)
            for i in range(11, 200, 63):
                a.store(ks[i : i + 63])

            async def dropped() -> bool:
                return node.counters.dropped_keys > 50

            await eventually(dropped)
        await a.settled()
        assert node.counters.resyncs > resyncs

        async def whole() -> bool:
            return [r.hit_chunks for r in await reader.lookup(NS, ks)] == [200]

        await eventually(whole, timeout=30.0)
    finally:
        await reader.redis.aclose()
        await node.stop()
        server.stop()


async def test_storage_events_the_member_missed_are_made_good_by_a_resync(
    tmp_path: Path,
) -> None:
    """The event log keeps 4 events and 10 arrive before the member's follower runs: it
    finds the gap (``EventGap``) and resyncs from the tiers instead of writing what it saw,
    so the index names every chunk held (before any resync: the 6 missed stores' keys)."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=30.0)
    a = Member("host-a", config, log=EventLog(capacity=4))
    node = await a.start()
    reader = FleetReader(connect(config), config)
    try:
        ks = keys(40)
        a.store(ks[:2])
        await a.settled()
        resyncs = node.counters.resyncs
        for i in range(2, 40, 4):  # no await: the follower runs after the last
            a.store(ks[i : i + 4])
        await a.settled()
        assert node.counters.resyncs > resyncs

        async def whole() -> bool:
            return [r.hit_chunks for r in await reader.lookup(NS, ks)] == [40]

        await eventually(whole, timeout=30.0)
    finally:
        await reader.redis.aclose()
        await node.stop()
        server.stop()
