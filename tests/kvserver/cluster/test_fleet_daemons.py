"""Real daemons (``kvserver start --cluster``) joined in one fleet on a real redis-server.

Three daemons as hosts: chunks stored through each show up in the fleet index under that
host at the right tier; a SIGKILLed daemon leaves the fleet within the TTL and its entries
expire; a restarted daemon comes back under a new incarnation and its old entries are gone;
SIGTERM leaves at once; Redis killed and restarted: every daemon keeps serving, reports
``unavailable`` in its stats and metrics, then re-registers and resyncs its entries from its
own tiers (through redis-py and through the valkey client).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.cli_render import render_status
from kvserver.client import KVClient
from kvserver.cluster import FleetReader, schema
from kvserver.cluster.config import ClusterConfig, connect
from kvserver.cluster.rpc import call_score_hosts
from kvserver.grpc_client import GrpcClient
from kvserver.grpc_replies import ServerStats
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.cluster.builders import eventually
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.metrics import scrape
from tests.support.redis import RedisServer, client_url, require_redis

pytestmark = pytest.mark.multiprocess

SPEC = make_spec()
TTL_S = 2.0
#: numbers of the fleet membership's stats that /metrics does not carry, and why
NOT_IN_METRICS = {
    "resync_in_s": "a countdown to a moment, not a quantity: kvserver_cluster_resync_pending",
    "namespaces": "the daemon's own namespaces with index sets: Stats.namespaces lists them",
}


def start_host(tmp_path: Path, redis: RedisServer, host_id: str, url: str = "") -> DaemonProc:
    """A daemon in the fleet, registered (``ok``: its start waits for that at most 3 cluster
    timeouts, 1.5 s here, which a loaded host overran: its ``cluster_condition`` at start
    was ``connecting``). ``url``: the fleet URL (default ``redis.url``; a ``valkey://`` one
    picks that client)."""
    d = start_daemon(
        tmp_path / host_id,
        "--dram", "4MiB", "--page-size", "4KiB", "--cluster", url or redis.url,
        "--host-id", host_id, "--cluster-ttl-s", str(TTL_S), "--cluster-timeout-s", "2",
    )  # fmt: skip
    try:
        wait_until(lambda: cluster_stats(d)["condition"] == "ok", timeout=30.0)
    except BaseException:
        d.kill()
        raise
    return d


@pytest.fixture
def daemons() -> Iterator[list[DaemonProc]]:
    procs: list[DaemonProc] = []
    yield procs
    for d in procs:
        d.kill()


def store(d: DaemonProc, keys: list[bytes], spec: NamespaceSpec = SPEC) -> str:
    with KVClient(d.zmq_address) as kv:
        ns_id = kv.register_namespace(spec).ns_id
        parts = [[pattern(k, 0, spec.part_bytes)] for k in keys]
        assert kv.store(ns_id, keys, parts) == keys
        return ns_id


def cluster_stats(d: DaemonProc) -> dict[str, Any]:
    with KVClient(d.zmq_address) as kv:
        stats: dict[str, Any] = kv.stats()["cluster"]
        return stats


def grpc_stats(d: DaemonProc) -> ServerStats:
    """The daemon's ``Stats`` over gRPC, as ``kvserver status`` reads them."""
    with GrpcClient(d.grpc_address) as client:
        return client.stats()


def reader_for(redis: RedisServer, url: str = "") -> FleetReader:
    """Its calls are expected to answer (a loaded machine: 5 s; a killed Redis refuses)."""
    config = ClusterConfig(url or redis.url, timeout_s=5.0, members_max_age_s=0.0)
    return FleetReader(connect(config), config)


async def runs(reader: FleetReader, ns_id: str, keys: list[bytes]) -> dict[str, int]:
    return {r.host.host_id: r.hit_chunks for r in await reader.lookup(ns_id, keys)}


async def test_three_hosts_join_and_a_killed_one_leaves_within_the_ttl_and_comes_back_new(
    tmp_path: Path, redis_server: RedisServer, daemons: list[DaemonProc]
) -> None:
    for name in ("a", "b", "c"):
        daemons.append(start_host(tmp_path, redis_server, name))
    a, b, c = daemons  # registered: start_host waits for it
    keys = make_keys(12, tag="fleet")
    ns_id = store(a, keys)
    store(b, keys[:5])
    reader = reader_for(redis_server)
    try:
        hosts = {h.host_id: h for h in await reader.hosts()}
        assert sorted(hosts) == ["a", "b", "c"]
        assert hosts["a"].data_address == a.zmq_address
        assert hosts["a"].incarnation == a.info["cluster_incarnation"]

        async def indexed() -> bool:
            return await runs(reader, ns_id, keys) == {"a": 12, "b": 5}

        await eventually(indexed, timeout=20.0)
        old_sets = [k for k in redis_server.cli("KEYS", "kvs1:{h:a}*").split() if k]
        assert old_sets
        killed_at = time.monotonic()
        a.kill()

        async def a_gone() -> bool:
            return "a" not in {h.host_id for h in await reader.hosts()}

        await eventually(a_gone, timeout=TTL_S + 3.0)
        assert await runs(reader, ns_id, keys) == {"b": 5}
        wait_until(lambda: not int(redis_server.cli("EXISTS", *old_sets)), timeout=TTL_S + 3.0)
        # within the TTL, and 3 s for the polls (a redis-cli each) of a loaded machine: sets
        # without a TTL would never go
        assert time.monotonic() - killed_at <= TTL_S + 3.0

        again = start_host(tmp_path, redis_server, "a")
        daemons.append(again)
        assert again.info["cluster_incarnation"] != a.info["cluster_incarnation"]
        hosts = {h.host_id: h for h in await reader.hosts()}
        assert hosts["a"].incarnation == again.info["cluster_incarnation"]
        assert await runs(reader, ns_id, keys) == {"b": 5}  # the restarted host holds nothing

        assert c.terminate() == 0  # SIGTERM leaves at once

        async def c_left() -> bool:
            return "c" not in {h.host_id for h in await reader.hosts()}

        assert await c_left()
        assert not redis_server.cli("KEYS", "kvs1:{h:c}*")
    finally:
        await reader.redis.aclose()


async def test_redis_killed_and_restarted_daemons_serve_then_resync(
    tmp_path: Path, redis_server: RedisServer, fleet_client: str, daemons: list[DaemonProc]
) -> None:
    """Through either client (``redis://``, ``valkey://``): each library's own errors must
    read as ``unavailable``, never stop the daemon."""
    url = client_url(redis_server.url, fleet_client)
    daemons.append(start_host(tmp_path, redis_server, "a", url))
    (a,) = daemons
    assert cluster_stats(a)["url"].startswith(f"{fleet_client}://")
    keys = make_keys(8, tag="resync")
    ns_id = store(a, keys[:4])
    reader = reader_for(redis_server, url)
    try:
        await eventually(lambda: _eq(runs(reader, ns_id, keys), {"a": 4}), timeout=20.0)
        condition = "kvserver_cluster_condition"
        assert scrape(a.metrics_url).value(condition, **{condition: "ok"}) == 1
        redis_server.kill()
        wait_until(lambda: cluster_stats(a)["condition"] == "unavailable", timeout=10.0)
        assert cluster_stats(a)["condition_detail"]
        metrics = scrape(a.metrics_url)
        assert metrics.value(condition, **{condition: "unavailable"}) == 1
        assert metrics.value("kvserver_cluster_errors_total") >= 1
        assert metrics.value("kvserver_cluster_resync_pending") == 1  # it owes one
        assert cluster_stats(a)["resync_pending"] == 1
        # and so do gRPC Stats and kvserver status (before, ClusterStats had no such field:
        # the status never said it, though it has the note)
        grpc_cluster = grpc_stats(a).cluster
        assert grpc_cluster is not None and grpc_cluster["resync_pending"] == 1
        assert "index resync pending" in render_status(grpc_stats(a), a.grpc_address)
        store(a, keys[4:])  # the daemon keeps serving its own tiers
        with KVClient(a.zmq_address) as kv:
            assert kv.lookup(ns_id, keys).hit_chunks == 8
        redis_server.restart()  # empty: persistence is off
        wait_until(lambda: cluster_stats(a)["condition"] == "ok", timeout=10.0)
        await eventually(lambda: _eq(runs(reader, ns_id, keys), {"a": 8}), timeout=20.0)
        assert cluster_stats(a)["resyncs"] >= 2
        assert cluster_stats(a)["resync_pending"] == 0
        assert scrape(a.metrics_url).value("kvserver_cluster_resync_pending") == 0
        assert "resync_pending" not in (grpc_stats(a).cluster or {})  # 0: proto3 omits it
        assert "resync pending" not in render_status(grpc_stats(a), a.grpc_address)
    finally:
        await reader.redis.aclose()


async def test_a_full_redis_is_reported_in_stats_metrics_and_status(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    """Redis full under ``noeviction``: the daemon stays a member and says so: ``degraded``
    with the error, ``redis_full`` and the adds deferred, in its stats, its metrics, gRPC
    ``Stats`` and ``kvserver status``; with room again, ``ok``."""
    require_redis()
    redis = RedisServer.start(tmp_path / "redis", "--maxmemory-policy", "noeviction")
    try:
        daemons.append(start_host(tmp_path, redis, "a"))
        (a,) = daemons
        keys = make_keys(4, tag="full")
        ns_id = store(a, keys[:2])
        wait_until(lambda: cluster_stats(a)["pending_keys"] == 0, timeout=10.0)
        redis.cli("CONFIG", "SET", "maxmemory", "1")  # below anything: every add refused
        store(a, keys[2:])
        wait_until(lambda: cluster_stats(a)["condition"] == "degraded", timeout=10.0)
        stats = cluster_stats(a)
        assert stats["redis_full"] == 1 and stats["deferred_keys"] == 2, stats
        metrics = scrape(a.metrics_url)
        condition = "kvserver_cluster_condition"
        assert metrics.value(condition, **{condition: "degraded"}) == 1
        assert metrics.value("kvserver_cluster_redis_full") == 1
        assert metrics.value("kvserver_cluster_deferred_keys") == 2
        grpc_cluster = grpc_stats(a).cluster or {}
        assert grpc_cluster["redis_full"] == 1 and grpc_cluster["deferred_keys"] == 2
        text = render_status(grpc_stats(a), a.grpc_address)
        assert ": degraded" in text and "2 index entries deferred" in text, text
        assert "raise its maxmemory" in text
        redis.cli("CONFIG", "SET", "maxmemory", "0")
        wait_until(lambda: cluster_stats(a)["condition"] == "ok", timeout=10.0)
        assert scrape(a.metrics_url).value("kvserver_cluster_redis_full") == 0
        reader = reader_for(redis)
        try:
            await eventually(lambda: _eq(runs(reader, ns_id, keys), {"a": 4}), timeout=20.0)
        finally:
            await reader.redis.aclose()
    finally:
        redis.stop()


def test_entries_no_daemon_writes_are_shown_in_grpc_stats_and_status(
    tmp_path: Path, redis_server: RedisServer, daemons: list[DaemonProc]
) -> None:
    """What Redis holds that no daemon of this version writes, written there directly beside a
    live daemon: a member record that is not JSON (skipped: ``bad_records``) and, for a
    member with a valid record, an index set that is a string (a ScoreHosts meets it:
    ``unreadable_sets``). gRPC ``Stats.cluster`` carries both and ``kvserver status`` notes
    them; before, only ZMQ ``stats`` and /metrics did (ClusterStats had no such fields:
    KeyError here). While none is met, neither field is set (proto3 omits 0) nor noted."""
    daemons.append(start_host(tmp_path, redis_server, "a"))
    (a,) = daemons
    keys = make_keys(3, tag="foreign")
    ns_id = store(a, keys)
    assert not {"bad_records", "unreadable_sets"} & set(grpc_stats(a).cluster or {})
    assert "no kvserver of this version" not in render_status(grpc_stats(a), a.grpc_address)
    other = schema.HostInfo("b", "inc0000000000001", "tcp://127.0.0.1:1", "127.0.0.1:2",
                            namespaces=(ns_id,), started_at=1.7e9)  # fmt: skip
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        raw.sadd(schema.hosts_key(), "bad", "b")
        raw.set(schema.host_key("bad"), b"{not json", px=600_000)
        raw.set(schema.host_key("b"), other.encode(), px=600_000)
        index = schema.index_key("b", other.incarnation, ns_id, schema.TIER_DRAM)
        raw.set(index, b"not a set", px=600_000)
    finally:
        raw.close()
    # the next heartbeat's read of the members skips the record, and takes b as a member
    wait_until(lambda: cluster_stats(a)["live_hosts"] == 2, timeout=30.0)
    assert cluster_stats(a)["bad_records"] == 1
    with GrpcClient(a.grpc_address) as client:
        scored = call_score_hosts(client, ns_id, keys=keys)
    assert {h.host_id: h.hit_chunks for h in scored} == {"a": 3, "b": 0}  # nothing there
    cluster = grpc_stats(a).cluster or {}
    assert cluster["bad_records"] == 1 and cluster["unreadable_sets"] == 1, cluster
    text = render_status(grpc_stats(a), a.grpc_address)
    assert "Redis holds what no kvserver of this version writes" in text, text
    assert "bad_records 1 (" in text and "unreadable_sets 1 (" in text, text


def test_every_number_of_the_fleet_stats_is_in_metrics_and_grpc_stats(
    tmp_path: Path, redis_server: RedisServer, daemons: list[DaemonProc]
) -> None:
    """Each number a member's ZMQ ``stats()["cluster"]`` has is a /metrics series (parsed
    by prometheus_client's own parser), ``kvserver_cluster_<key>`` (a gauge) or ``..._total``
    (a counter), of the value the stats had (between two reads around the scrape: heartbeats
    move), and each key a ``ClusterStats`` field (``namespaces`` aside: Stats.namespaces),
    except :data:`NOT_IN_METRICS`. A key added to the stats alone fails here: before,
    ``heartbeats`` and ``pending_keys`` had no series, ``bad_records`` and ``unreadable_sets``
    no ClusterStats field (cluster_stats() drops what has none)."""
    daemons.append(start_host(tmp_path, redis_server, "a"))
    (a,) = daemons
    store(a, make_keys(3, tag="numbers"))
    wait_until(lambda: cluster_stats(a)["pending_keys"] == 0, timeout=10.0)
    before = cluster_stats(a)
    metrics = scrape(a.metrics_url)
    after = cluster_stats(a)
    numbers = [k for k, v in after.items() if isinstance(v, int | float)]
    assert {"heartbeats", "bad_records", "unreadable_sets", "pending_keys"} <= set(numbers)
    found = {}
    for key in numbers:
        series = [f"kvserver_cluster_{key}", f"kvserver_cluster_{key}_total"]
        found[key] = [name for name in series if name in metrics.names()]
    assert {k for k, names in found.items() if not names} == set(NOT_IN_METRICS)
    for key, names in found.items():
        if names:
            (name,) = names
            assert min(before[key], after[key]) <= metrics.value(name), (key, before, after)
            assert metrics.value(name) <= max(before[key], after[key]), (key, before, after)
    assert set(after) - set(pb.ClusterStats.DESCRIPTOR.fields_by_name) == {"namespaces"}


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def test_write_downs_reach_the_index_as_ssd_and_a_resync_keeps_them(
    tmp_path: Path, redis_server: RedisServer, daemons: list[DaemonProc]
) -> None:
    """DRAM holds 40 chunks; 100 stored: the evicted ones written down to SSD show in the index
    under tier ssd, exactly as the daemon's own Lookup splits them, also after Redis lost
    everything and the daemon resynced from its tiers (the SSD index included)."""
    spec = make_spec(model="test/fleet-ssd", part_bytes_override=12_000)  # 3 pages of 4 KiB
    d = start_daemon(
        tmp_path / "ssd-host",
        "--page-size", "4KiB", "--dram", "480KiB", "--ssd-dir", str(tmp_path / "ssd"),
        "--ssd", "8MiB", "--ssd-admission", "1", "--cluster", redis_server.url,
        "--host-id", "s", "--cluster-ttl-s", str(TTL_S), "--cluster-timeout-s", "2",
        env={"KVSERVER_SSD_RETRY_S": "0.2"},
    )  # fmt: skip
    daemons.append(d)
    keys = make_keys(100, tag="fleet-ssd")
    with KVClient(d.zmq_address) as kv:
        ns_id = kv.register_namespace(spec).ns_id
        wait_until(lambda: kv.stats()["ssd"]["unsaved_namespaces"] == 0)
        for i in range(0, 100, 10):
            batch = keys[i : i + 10]
            assert kv.store(ns_id, batch, [[pattern(k, 0, spec.part_bytes)] for k in batch])
        wait_until(lambda: kv.stats()["ssd"]["writes_in_flight"] == 0)
        local = kv.lookup(ns_id, keys)
    assert local.tiers["ssd"] > 0
    assert local.tiers.pop("peer") == 0  # the network tier's count: nothing the index records
    reader = reader_for(redis_server)
    try:

        async def matches() -> bool:
            found = await reader.lookup(ns_id, keys, exact=True)
            return [(r.hit_chunks, r.tiers) for r in found] == [(local.hit_chunks, local.tiers)]

        await eventually(matches, timeout=10.0)
        redis_server.kill()
        wait_until(lambda: cluster_stats(d)["condition"] == "unavailable", timeout=10.0)
        redis_server.restart()
        wait_until(lambda: cluster_stats(d)["condition"] == "ok", timeout=10.0)
        await eventually(matches, timeout=10.0)
    finally:
        await reader.redis.aclose()
