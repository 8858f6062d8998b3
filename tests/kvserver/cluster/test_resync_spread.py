"""A fleet's resyncs after Redis returns are spread, and its retries back off (real redis-server).

Each member's random draws come from a :class:`Fixed` generator (``ClusterNode(rng=)``), so the
delay each one waits is known: a resync that is not urgent waits ``draw * resync_spread_s``
once Redis answers; a retry waits min(1 s, heartbeat interval) doubled per failure in a row,
capped at ``retry_max_s``, times a draw in [0.5, 1].
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from kvserver.cli_render import render_status
from kvserver.cluster import FleetReader
from kvserver.cluster.config import ClusterConfig, connect
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument
from tests.kvserver.cluster.builders import NS, Member, cluster_config, eventually, keys
from tests.support.redis import RedisServer, require_redis


class Fixed(random.Random):
    """Every draw is ``value`` (``uniform(a, b)`` then is ``a + (b - a) * value``)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value
        #: draws of :meth:`random` (a resync's delay), not of :meth:`uniform` (a retry's pause)
        self.delays = 0

    def random(self) -> float:
        self.delays += 1
        return self.value

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.value


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    require_redis()
    return redis_server


async def test_after_redis_restarts_empty_the_members_resync_spread_over_the_window(
    server: RedisServer,
) -> None:
    """Four members drawing 0, 0.3, 0.6 and 0.9 of a 2 s window: after Redis restarts empty,
    each resyncs no sooner than its delay after Redis is back (before, each within the 1 s
    retry: all four at once), says meanwhile that a resync is pending, and once the window
    has passed the index is whole again: every member, every key."""
    spread = 2.0
    config = cluster_config(server.url, ttl_s=3.0, resync_spread_s=spread)
    draws = (0.0, 0.3, 0.6, 0.9)
    rngs = [Fixed(v) for v in draws]
    members = [Member(f"host-{i}", config, rng=rng) for i, rng in enumerate(rngs)]
    ks = keys(8)
    for m, rng in zip(members, rngs, strict=True):
        node = await m.start()  # registered (Member.start waits for it)
        assert node.condition == "ok"
        assert rng.delays == 0  # the first registration is urgent: no delay drawn
        m.store(ks)
        await m.settled()
    nodes = [m.node for m in members]
    assert all(n is not None for n in nodes)
    before = [n.counters.resyncs for n in nodes]  # type: ignore[union-attr]
    r = FleetReader(connect(config), config)
    try:
        server.kill()

        async def all_down() -> bool:
            return all(n.condition == "unavailable" for n in nodes)  # type: ignore[union-attr]

        await eventually(all_down, timeout=10.0)
        server.restart()  # empty: persistence is off
        back = time.monotonic()
        done: dict[int, float] = {}
        pending_seen: set[int] = set()

        async def all_resynced() -> bool:
            now = time.monotonic()
            for i, n in enumerate(nodes):
                st = n.stats()  # type: ignore[union-attr]
                if st["resync_in_s"] > 0:
                    assert st["resync_pending"] == 1
                    assert st["resync_in_s"] <= spread * draws[i] + 0.01
                    pending_seen.add(i)
                if i not in done and n.counters.resyncs > before[i]:  # type: ignore[union-attr]
                    done[i] = now
            return len(done) == len(nodes)

        await eventually(all_resynced, timeout=20.0)
        for i, at in done.items():
            assert at - back >= spread * draws[i], (i, at - back)
        assert max(done.values()) - min(done.values()) >= spread * (draws[-1] - draws[1])
        assert {2, 3} <= pending_seen  # the delayed ones said so while they waited
        assert all(n.stats()["resync_pending"] == 0 for n in nodes)  # type: ignore[union-attr]
        runs = await r.lookup(NS, ks)
        assert sorted((x.host.host_id, x.hit_chunks) for x in runs) == [
            (m.host_id, len(ks)) for m in members
        ]
    finally:
        await r.redis.aclose()
        for n in nodes:
            await n.stop()  # type: ignore[union-attr]


async def test_retries_of_a_failing_registration_back_off_to_the_cap(
    server: RedisServer,
) -> None:
    """Redis down: the pauses between a member's retries are 0.5 s (the heartbeat
    interval, under 1 s), then 1, 2, then the 2 s cap (draws of 1: the whole pause), so
    five failures take at least 5.5 s (before, one every 0.5 s: five in ~2 s); back up, it
    registers and its index is whole."""
    config = cluster_config(server.url, ttl_s=1.5, retry_max_s=2.0, resync_spread_s=0.0)
    m = Member("host-a", config, rng=Fixed(1.0))
    node = await m.start()
    try:
        ks = keys(3)
        m.store(ks)
        await m.settled()
        server.kill()

        async def failed_once() -> bool:
            return node.counters.errors >= 1

        await eventually(failed_once, timeout=10.0)
        first, errors = time.monotonic(), node.counters.errors

        async def failed_five() -> bool:
            return node.counters.errors >= errors + 4

        await eventually(failed_five, timeout=20.0)
        # the pauses, 5.5 s, less 1 s for how late a loaded loop saw the first failure (seen
        # late, ``first`` is late: the span shrinks); retrying every 0.5 s took ~2 s
        assert time.monotonic() - first >= 0.5 + 1 + 2 + 2 - 1.0
        assert node.stats()["resync_pending"] == 1
        server.restart()

        async def ok() -> bool:
            return node.condition == "ok"

        await eventually(ok, timeout=10.0)
        await m.settled()
        r = FleetReader(connect(config), config)
        try:
            assert [x.hit_chunks for x in await r.lookup(NS, ks)] == [3]
        finally:
            await r.redis.aclose()
    finally:
        await node.stop()


def test_the_settings_default_to_the_heartbeat_interval_and_the_ttl_and_refuse_negatives() -> None:
    config = ClusterConfig("redis://127.0.0.1:1/0", ttl_s=9.0)
    assert (config.resync_window_s, config.retry_cap_s) == (3.0, 9.0)
    config = ClusterConfig("redis://127.0.0.1:1/0", resync_spread_s=0.0, retry_max_s=1.0)
    assert (config.resync_window_s, config.retry_cap_s) == (0.0, 1.0)
    for name in ("resync_spread_s", "retry_max_s"):
        with pytest.raises(InvalidArgument, match=name):
            ClusterConfig("redis://127.0.0.1:1/0", **{name: -1.0})  # type: ignore[arg-type]


def test_the_daemon_setting_reaches_the_node() -> None:
    url = "redis://127.0.0.1:1/0"
    for given, window in ((None, 4.0), (2.5, 2.5), (0.0, 0.0)):
        overrides = {"cluster": url, "cluster_ttl_s": 12.0}
        if given is not None:
            overrides["cluster_resync_spread_s"] = given
        config = DaemonConfig.load(overrides=overrides).cluster_config()
        assert config is not None and config.resync_window_s == window
    with pytest.raises(InvalidArgument, match="resync_spread_s"):
        DaemonConfig.load(
            overrides={"cluster": url, "cluster_resync_spread_s": -2.0}
        ).cluster_config()


def test_status_says_a_resync_is_pending_and_when_it_starts() -> None:
    cluster = {"url": "redis://r:1/0", "condition": "ok", "host_id": "a", "incarnation": "i",
               "live_hosts": 2, "resync_pending": 1, "resync_in_s": 1.25}  # fmt: skip
    stats = SimpleNamespace(server_version="v", host_id="a", num_leases=0, events_oldest_seq=0,
                            events_last_seq=0, event_log_id="l", cluster=cluster, tiers=[],
                            namespaces=[])  # fmt: skip
    assert "index resync pending: starts in 1.2 s" in render_status(stats, "s")
    cluster["resync_in_s"] = 0.0
    assert "index resync pending: after the next retry" in render_status(stats, "s")
    cluster["resync_pending"] = 0
    assert "resync pending" not in render_status(stats, "s")
