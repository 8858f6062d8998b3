"""The index write fence: a Redis that lost some of a member's index writes without the member
seeing an error (restarted from older data between two calls, the client's connection retried
at once) is found out at the member's next write or heartbeat, and the member resyncs."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from kvserver.cluster import ClusterNode, FleetReader, HostInfo, record, schema
from kvserver.cluster import node as node_module
from kvserver.cluster.config import connect
from kvserver.cluster.node import MAX_BATCH_KEYS
from kvserver.cluster.writer import RESYNC_STEP
from kvserver.errors import Unavailable
from tests.kvserver.cluster.builders import (
    NS,
    Member,
    cluster_config,
    eventually,
    keys,
    registered,
)
from tests.support.redis import RedisServer, require_redis


async def test_redis_restarted_from_an_older_snapshot_gets_the_lost_writes_again(
    tmp_path: Path,
) -> None:
    """Redis saves an RDB, the member then evicts one chunk and stores two, Redis is SIGKILLed
    and restarted from that RDB between two heartbeats (no call of the member fails: its
    record is still there, its connection retried): the evicted chunk's entry, back from the
    RDB, goes and the two stored since come back, within a few heartbeats."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis", "--dbfilename", "dump.rdb")
    heartbeat_s = 3.0  # the restart (~0.1 s) falls between two heartbeats
    config = cluster_config(server.url, ttl_s=30.0, heartbeat_s=heartbeat_s)
    a = Member("host-a", config)
    node = await a.start()
    reader = FleetReader(connect(config), config)
    try:
        ks = keys(6)
        a.store(ks[:4])
        await a.settled()
        assert server.cli("SAVE") == "OK"
        a.evict(ks[3:4])
        a.store(ks[4:6])
        await a.settled()

        async def run() -> dict[str, int]:
            return {r.host.host_id: r.hit_chunks for r in await reader.lookup(NS, ks)}

        assert await run() == {"host-a": 3}
        beats = node.counters.heartbeats

        async def beaten() -> bool:
            return node.counters.heartbeats > beats

        await eventually(beaten, timeout=heartbeat_s * 2)  # a heartbeat just went
        server.kill()
        server.restart()  # from dump.rdb: ks[3] held again, ks[4:6] not
        assert int(server.cli("EXISTS", schema.host_key("host-a"))) == 1

        async def true_again() -> bool:
            try:
                later = [r.hit_chunks for r in await reader.lookup(NS, ks[4:6])]
                return await run() == {"host-a": 3} and later == [2]
            except Unavailable:  # the reader's first call after the restart reconnects:
                return False  # 0.5 s bound, which a loaded machine overran once

        await eventually(true_again, timeout=heartbeat_s * 3)
        assert node.condition == "ok"
    finally:
        await reader.redis.aclose()
        await node.stop()
        server.stop()


class Sizes:
    """The node's client, recording the arguments of every pipeline it executes."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self.pipelines: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)

    def pipeline(self, *args: Any, **kw: Any) -> Any:
        pipe = self._redis.pipeline(*args, **kw)
        execute = pipe.execute

        async def counted(**kw: Any) -> Any:
            self.pipelines.append(sum(len(a) for a, _ in pipe.command_stack))
            return await execute(**kw)

        pipe.execute = counted
        return pipe


async def test_a_large_resync_is_written_in_pipelines_the_loop_runs_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member holding 150,000 chunks registers: its resync goes out as pipelines of at most
    MAX_BATCH_KEYS keys each, one awaited after another (a pipeline is encoded in one go on
    the event loop: one of 1 M keys held the daemon's loop ~0.2-0.4 s), its keys are
    fingerprinted at most RESYNC_STEP between two turns of the loop (all 150,000 in one
    before: 1 M took ~0.25 s), and the index then holds every chunk."""
    require_redis()
    counted = [0]
    fingerprint = schema.fingerprint

    def counting(key: bytes) -> bytes:
        counted[0] += 1
        return fingerprint(key)

    monkeypatch.setattr(schema, "fingerprint", counting)
    turns: list[int] = []  # the fingerprints made so far, at each turn of the loop
    ticking = True

    async def ticker() -> None:
        while ticking:
            turns.append(counted[0])
            await asyncio.sleep(0)

    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=30.0, timeout_s=5.0)
    a = Member("host-a", config)
    ks = keys(150_000)
    a.held[(NS, "dram")] = list(ks)
    sizes = Sizes(connect(config))
    identity = HostInfo("host-a", "", "tcp://127.0.0.1:1", "127.0.0.1:2", ("dram",))
    node = ClusterNode(config, identity, a.log, lambda: dict(a.held), lambda: {NS: "{}"},
                       redis=sizes)  # fmt: skip
    tick = asyncio.create_task(ticker())
    await node.start()
    await registered(node)  # start() waits 3 timeouts at most
    ticking = False
    await tick
    reader = FleetReader(connect(config), config)
    try:
        assert node.condition == "ok"
        assert counted[0] >= len(ks)
        steps = [b - a for a, b in itertools.pairwise(turns)]
        assert max(steps) <= RESYNC_STEP, max(steps)
        assert len(sizes.pipelines) > 1, sizes.pipelines
        assert max(sizes.pipelines) <= MAX_BATCH_KEYS + 128, sizes.pipelines  # + command words
        assert int(server.cli("SCARD", node.writer.key(NS, "dram"))) == len(ks)
        assert [r.hit_chunks for r in await reader.lookup(NS, ks[:5000])] == [5000]
    finally:
        await reader.redis.aclose()
        await node.stop()
        server.stop()


async def test_two_daemons_with_one_host_id_the_later_keeps_it_the_earlier_steps_down(
    tmp_path: Path,
) -> None:
    """Two daemons started with one host id (two daemons on one machine both default to
    hostname/boot-id): the later one's registration takes the id over, as a restart does;
    the earlier one then finds its record names the later one and steps down (unavailable,
    saying why) instead of writing its record and index back over the later one's, which
    made the two undo each other at every heartbeat and batch."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=5.0, heartbeat_s=0.2)
    first, second = Member("host-a", config), Member("host-a", config)
    reader = FleetReader(connect(config), config)
    await first.start()
    try:
        first.store(keys(3))
        await first.settled()
        node = await second.start()
        ks = keys(4, seed=1)
        second.store(ks)
        await second.settled()
        assert first.node is not None

        async def stepped_down() -> bool:
            assert first.node is not None
            return first.node.condition == "unavailable" and node.counters.heartbeats > 10

        await eventually(stepped_down, timeout=10.0)
        assert "host id" in first.node.condition_detail, first.node.condition_detail
        assert node.condition == "ok" and node.counters.registrations == 1
        (info,) = await reader.hosts(refresh=True)
        assert info.incarnation == node.incarnation
        assert [r.hit_chunks for r in await reader.lookup(NS, ks)] == [4]
    finally:
        await reader.redis.aclose()
        for m in (second, first):
            if m.node is not None:
                await m.node.stop()
        server.stop()


async def test_a_daemon_leaving_after_its_host_id_was_taken_leaves_the_later_ones_record(
    tmp_path: Path,
) -> None:
    """The earlier of two daemons with one host id stops before a heartbeat told it the id
    was taken: leaving removes the record and the id from the hosts set only while they name
    it (its DEL took the later daemon out of the fleet until that one's next heartbeat)."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=30.0, heartbeat_s=10.0)
    first, second = Member("host-a", config), Member("host-a", config)
    reader = FleetReader(connect(config), config)
    try:
        await first.start()
        node = await second.start()
        assert first.node is not None and first.node.condition == "ok"  # not told yet
        await first.node.stop()
        (info,) = await reader.hosts(refresh=True)
        assert info.incarnation == node.incarnation
    finally:
        await reader.redis.aclose()
        if second.node is not None:
            await second.node.stop()
        server.stop()


class LateTail:
    """The node's client, where the first pipeline after :meth:`arm` times out unsent and
    Redis runs it late: on another connection, just before the last pipeline of the resync
    that follows (after the resync's first pipeline rewrote the sets it writes), as a
    timed-out pipeline's tail may run when Redis interleaves two connections."""

    def __init__(self, redis: Any, late: Any, host_id: str) -> None:
        self._redis, self._late = redis, late
        self._record = schema.host_key(host_id)
        self._armed = False
        self.stashed: list[tuple[Any, ...]] | None = None
        self.ran = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)

    def arm(self) -> None:
        self._armed = True

    def pipeline(self, *args: Any, **kw: Any) -> Any:
        pipe = self._redis.pipeline(*args, **kw)
        execute = pipe.execute

        async def run(**kw: Any) -> Any:
            stack = [a for a, _ in pipe.command_stack]
            if self._armed and self.stashed is None:
                self.stashed = stack
                raise TimeoutError("injected: the pipeline timed out")
            last_of_resync = any(a[1:4] == (record.SET_SCRIPT, 1, self._record) for a in stack)
            if self.stashed is not None and not self.ran and last_of_resync:
                for command in self.stashed:  # the tail Redis runs late
                    await self._late.execute_command(*command)
                self.ran = True
            return await execute(**kw)

        pipe.execute = run
        return pipe


async def test_a_timed_out_batch_run_late_within_a_resync_leaves_no_stale_entry(
    tmp_path: Path,
) -> None:
    """A batch adding chunk X times out unsent; X is evicted; the member resyncs (three
    pipelines: 150,000 chunks) and Redis runs the timed-out batch between the resync's
    pipelines, after the resync rewrote X's set: X's add, and the batch's move of the
    fence, do nothing (the resync set a new fence number first; every write is fenced), so
    the index never names X. Before, X's add landed, the batch's fence move was overwritten
    by the resync's, and X stayed indexed (a stale holder) until the next resync."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=90.0, timeout_s=5.0, heartbeat_s=30.0)
    a = Member("host-a", config)
    a.held[(NS, "dram")] = list(keys(150_000))
    late = connect(config)
    client = LateTail(connect(config), late, "host-a")
    identity = HostInfo("host-a", "", "tcp://127.0.0.1:1", "127.0.0.1:2", ("dram",))
    node = ClusterNode(config, identity, a.log, lambda: dict(a.held), lambda: {NS: "{}"},
                       redis=client)  # fmt: skip
    await node.start()
    try:
        await registered(node)  # start() waits 3 timeouts at most
        assert node.condition == "ok" and node.counters.resyncs == 1
        (x,) = keys(1, seed=7)
        client.arm()
        a.store([x])

        async def timed_out() -> bool:
            return client.stashed is not None

        await eventually(timed_out)
        a.evict([x])  # while the member is unavailable: the resync's snapshot lacks X

        async def resynced() -> bool:
            return node.counters.resyncs == 2 and node.condition == "ok"

        await eventually(resynced, timeout=20.0)
        assert client.ran  # the late tail did run, within the resync
        dram = node.writer.key(NS, "dram")
        members = await late.sismember(dram, schema.fingerprint(x))
        assert not members, "the late tail's add of X is in the index"
        assert int(server.cli("SCARD", dram)) == 150_000
        await node._heartbeat()  # the fence still reads what the member expects
        assert node.condition == "ok" and node.counters.resyncs == 2
    finally:
        await late.aclose()
        await node.stop()
        server.stop()


async def test_which_of_two_daemons_with_one_host_id_started_later_is_redis_time_not_theirs(
    tmp_path: Path,
) -> None:
    """The later daemon's host clock is an hour behind (a copied --host-id on a host whose
    clock lags): it still owns the id, as started later by Redis's clock. Before, each
    record's ``started_at`` was its own host's ``time.time()``: the later daemon read as
    started an hour earlier and stepped down, the earlier one kept the id, and the later
    one's error said the id was taken by a daemon "started later"."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    config = cluster_config(server.url, ttl_s=5.0, heartbeat_s=0.2)
    first, second = Member("host-a", config), Member("host-a", config)
    try:
        await first.start()
        assert first.node is not None and first.node.condition == "ok"
        real = time.time
        with mock.patch.object(node_module.time, "time", lambda: real() - 3600):  # the skew
            node = await second.start()

        async def stepped_down() -> bool:
            assert first.node is not None
            return first.node.condition == "unavailable"

        await eventually(stepped_down, timeout=10.0)
        assert node.condition == "ok", node.condition_detail
        assert "host id" in first.node.condition_detail
    finally:
        for m in (second, first):
            if m.node is not None:
                await m.node.stop()
        server.stop()
