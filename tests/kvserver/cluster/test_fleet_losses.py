"""What routers see when a fleet member or its Redis loses state: real daemons (``kvserver
start --cluster``) on a real redis-server, scored through another daemon's ``ScoreHosts``.

docs/cluster.md, "Failure cases of the fleet state": a daemon SIGKILLed leaves the scores
once its record's TTL has run, its index sets expire by their own; SIGTERM leaves at once;
Redis unreachable: ``ScoreHosts`` answers UNAVAILABLE, and once Redis is back (empty) the
members resync and are scored again; a daemon stalled past its TTL leaves and comes back
whole; a key Redis loses (record, fence, hosts set, specs: as an eviction does) is written
again by the member's next heartbeat; Redis back with its data after an outage names no
chunk the member lost meanwhile; of two daemons with one host id the earlier takes it back,
with its own data only, once the later stops; a CA that did not sign Redis's certificate
leaves a daemon ``unavailable``, retrying. With an SSD tier: ``test_fleet_ssd``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserver.client import KVClient
from kvserver.cluster import schema
from kvserver.cluster.rpc import call_score_hosts
from kvserver.crypto import make_tls_cert
from kvserver.errors import Unavailable
from kvserver.grpc_client import GrpcClient
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.cluster.builders import eventually
from tests.kvserver.cluster.test_fleet_daemons import (
    TTL_S,
    cluster_stats,
    reader_for,
    start_host,
    store,
)
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.redis import RedisServer, require_redis

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/fleet-losses")
#: generous on a loaded machine: several TTLs (2 s) and heartbeats (0.67 s)
DEADLINE_S = 30.0


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServer) -> Iterator[list[DaemonProc]]:
    """Hosts a (8 chunks) and b (3 chunks) and c (none: the one asked)."""
    procs: list[DaemonProc] = []
    try:
        for name in ("a", "b", "c"):
            procs.append(start_host(tmp_path, redis_server, name))
        keys = make_keys(8, tag="losses")
        store(procs[0], keys, SPEC)
        store(procs[1], keys[:3], SPEC)
        wait_until(lambda: scores(procs[2], keys) == {"a": 8, "b": 3, "c": 0}, DEADLINE_S)
        yield procs
    finally:
        for d in procs:
            d.kill()


def scores(asked: DaemonProc, keys: list[bytes]) -> dict[str, int]:
    """Live hosts → chunks of ``keys`` held, as ``ScoreHosts`` through ``asked`` answers."""
    with GrpcClient(asked.grpc_address) as client:
        return {h.host_id: h.hit_chunks for h in call_score_hosts(client, SPEC.ns_id, keys=keys)}


def incarnation(redis: RedisServer, host_id: str) -> str:
    raw = redis.cli("GET", schema.host_key(host_id))
    found: str = json.loads(raw)["incarnation"]
    return found


def index_sets(redis: RedisServer, host_id: str, inc: str) -> list[str]:
    """The index sets of ``inc`` that exist (every tier of SPEC's namespace)."""
    keys = [schema.index_key(host_id, inc, SPEC.ns_id, t) for t in schema.TIERS]
    return [k for k in keys if redis.cli("EXISTS", k) == "1"]


def test_score_hosts_drops_a_killed_daemon_within_its_ttl_and_a_stopped_one_at_once(
    fleet: list[DaemonProc], redis_server: RedisServer
) -> None:
    """SIGKILL: the record carries at most the TTL, so the host leaves the scores by itself,
    and its index sets expire by their own TTL (nothing renews them). SIGTERM: the member
    deletes its record and sets as it stops, so it is gone before the daemon has exited."""
    a, b, c = fleet
    keys = make_keys(8, tag="losses")
    inc_a = incarnation(redis_server, "a")
    assert index_sets(redis_server, "a", inc_a)
    a.kill()
    pttl = int(redis_server.cli("PTTL", schema.host_key("a")))
    assert pttl == -2 or 0 < pttl <= TTL_S * 1000  # -1 (no TTL) would never expire
    wait_until(lambda: scores(c, keys) == {"b": 3, "c": 0}, DEADLINE_S)
    wait_until(lambda: not index_sets(redis_server, "a", inc_a), DEADLINE_S)
    inc_b = incarnation(redis_server, "b")
    assert b.terminate() == 0, b.log()
    assert redis_server.cli("EXISTS", schema.host_key("b")) == "0"  # deleted, not expired
    assert not index_sets(redis_server, "b", inc_b)
    wait_until(lambda: scores(c, keys) == {"c": 0}, DEADLINE_S)


async def test_score_hosts_is_unavailable_while_redis_is_and_whole_after_its_empty_restart(
    fleet: list[DaemonProc], redis_server: RedisServer
) -> None:
    """Redis killed: ScoreHosts answers UNAVAILABLE (never a stale or empty list of hosts)
    and the members keep serving their own tiers; Redis restarted empty: each member's
    registration and resync refill the index, every host scored as before."""
    a, _b, c = fleet
    keys = make_keys(8, tag="losses")
    redis_server.cli("SET", "test:sentinel", "1")  # no member writes it: gone = empty restart
    redis_server.kill()
    wait_until(lambda: cluster_stats(c)["condition"] == "unavailable", DEADLINE_S)
    with pytest.raises(Unavailable):
        scores(c, keys)
    with KVClient(a.zmq_address) as kv:
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 8
    redis_server.restart()  # empty: persistence is off
    # (not DBSIZE 0: a member retrying may register in the moment after the restart)
    assert redis_server.cli("EXISTS", "test:sentinel") == "0"
    wait_until(lambda: all(cluster_stats(d)["condition"] == "ok" for d in fleet), DEADLINE_S)
    wait_until(lambda: scores(c, keys) == {"a": 8, "b": 3, "c": 0}, DEADLINE_S)


def test_a_daemon_stalled_past_its_ttl_leaves_the_scores_and_comes_back_whole(
    fleet: list[DaemonProc], redis_server: RedisServer
) -> None:
    """SIGSTOP a past its TTL: its record expires (routers stop scoring it), and so do its
    index sets; SIGCONT: its heartbeat finds the record gone, it registers and resyncs from
    its own tiers (which it kept), scored with all 8 chunks again."""
    a, _b, c = fleet
    keys = make_keys(8, tag="losses")
    inc_a = incarnation(redis_server, "a")
    registrations = cluster_stats(a)["registrations"]
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: scores(c, keys) == {"b": 3, "c": 0}, DEADLINE_S)
        wait_until(lambda: not index_sets(redis_server, "a", inc_a), DEADLINE_S)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    wait_until(lambda: scores(c, keys) == {"a": 8, "b": 3, "c": 0}, DEADLINE_S)
    assert cluster_stats(a)["registrations"] > registrations


def lose_record(redis: RedisServer) -> None:
    redis.cli("DEL", schema.host_key("a"))


def lose_fence(redis: RedisServer) -> None:
    redis.cli("DEL", schema.fence_key("a", incarnation(redis, "a")))


def lose_hosts(redis: RedisServer) -> None:
    redis.cli("DEL", schema.hosts_key())


def lose_specs(redis: RedisServer) -> None:
    redis.cli("DEL", schema.namespaces_key())


def lose_dram_set(redis: RedisServer) -> None:
    redis.cli("DEL", schema.index_key("a", incarnation(redis, "a"), SPEC.ns_id, "dram"))


@pytest.mark.parametrize(
    ("lose", "counted", "resynced"),
    [
        (lose_record, False, True),  # gone, as after a stall past the TTL: registered again
        (lose_fence, True, True),
        (lose_hosts, False, False),
        (lose_specs, False, False),
        (lose_dram_set, True, True),
    ],
    ids=["record", "fence", "hosts", "specs", "index-set"],
)
def test_a_key_redis_loses_without_a_write_failing_is_written_again(
    fleet: list[DaemonProc],
    redis_server: RedisServer,
    lose: Any,
    counted: bool,
    resynced: bool,
) -> None:
    """A member's key deleted behind its back (as an eviction does; no call of the member
    fails): its next heartbeat writes it again, and the index resyncs where entries may be
    lost (record: registered again; fence, set: counted in ``index_losses``, which the
    document claimed of the record too); routers score every host as before."""
    a, _b, c = fleet
    keys = make_keys(8, tag="losses")
    before = cluster_stats(a)
    lose(redis_server)
    # two heartbeats begun after the loss: one has run whole since
    wait_until(lambda: cluster_stats(a)["heartbeats"] >= before["heartbeats"] + 2, DEADLINE_S)
    if resynced:
        wait_until(lambda: cluster_stats(a)["resyncs"] > before["resyncs"], DEADLINE_S)
    assert redis_server.cli("SISMEMBER", schema.hosts_key(), "a") == "1"
    assert redis_server.cli("HEXISTS", schema.namespaces_key(), SPEC.ns_id) == "1"
    wait_until(lambda: redis_server.cli("EXISTS", schema.host_key("a")) == "1", DEADLINE_S)
    inc = incarnation(redis_server, "a")
    wait_until(lambda: redis_server.cli("EXISTS", schema.fence_key("a", inc)) == "1", DEADLINE_S)
    wait_until(lambda: scores(c, keys) == {"a": 8, "b": 3, "c": 0}, DEADLINE_S)
    after = wait_until(lambda: (st := cluster_stats(a))["condition"] == "ok" and st, DEADLINE_S)
    losses = after["index_losses"] - before["index_losses"]
    assert losses >= 1 if counted else losses == 0, after


async def test_redis_back_with_its_data_after_an_outage_names_no_chunk_the_member_lost(
    tmp_path: Path,
) -> None:
    """Redis persists (an RDB saved while host a held 8 chunks of N2), is killed, and while it
    is down a evicts every chunk of N2 (stores of N1 fill its DRAM); Redis comes back from the
    RDB with a's old sets alive (a TTL longer than the outage): a's resync replaces every set
    of its incarnation, so N2's stale set goes and a is never scored for chunks it lost."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis", "--dbfilename", "dump.rdb")
    ttl_s = 60.0
    d = start_daemon(
        tmp_path / "a",
        "--dram", "4MiB", "--page-size", "4KiB", "--cluster", server.url, "--host-id", "a",
        "--cluster-ttl-s", str(ttl_s), "--cluster-timeout-s", "2",
        "--cluster-resync-spread-s", "1",
    )  # fmt: skip
    reader = reader_for(server)
    n1, n2 = make_spec(model="test/outage-n1"), make_spec(model="test/outage-n2")
    lost = make_keys(8, tag="outage-lost")
    try:
        wait_until(lambda: cluster_stats(d)["condition"] == "ok", DEADLINE_S)
        store(d, lost, n2)
        await eventually(lambda: holds(reader, n2.ns_id, lost, {"a": 8}), timeout=DEADLINE_S)
        assert server.cli("SAVE") == "OK"
        saved = time.monotonic()
        server.kill()
        wait_until(lambda: cluster_stats(d)["condition"] == "unavailable", DEADLINE_S)
        filler = make_keys(1500, tag="outage-filler")
        for i in range(0, len(filler), 100):
            store(d, filler[i : i + 100], n1)
        with KVClient(d.zmq_address) as kv:
            assert not [k for k in lost if kv.lookup(n2.ns_id, [k]).hit_chunks]
        resyncs = cluster_stats(d)["resyncs"]
        server.restart()  # from dump.rdb: a's sets as they were at the SAVE
        assert time.monotonic() - saved < ttl_s  # so they are alive in it
        wait_until(lambda: cluster_stats(d)["resyncs"] > resyncs, 2 * ttl_s)
        assert cluster_stats(d)["condition"] == "ok"
        assert await holds(reader, n2.ns_id, lost, {})  # a run of 0: not listed
        dram = schema.index_key("a", incarnation(server, "a"), n2.ns_id, "dram")
        assert server.cli("EXISTS", dram) == "0"
    finally:
        d.kill()
        await reader.redis.aclose()
        server.stop()


async def holds(reader: Any, ns_id: str, keys: list[bytes], expected: dict[str, int]) -> bool:
    found = {r.host.host_id: r.hit_chunks for r in await reader.lookup(ns_id, keys, exact=True)}
    return found == expected


def test_a_ca_that_did_not_sign_redis_certificate_leaves_the_daemon_unavailable_retrying(
    tmp_path: Path,
) -> None:
    """docs/cluster.md, Configuration: a CA that did not sign the server's certificate can only
    be found by connecting: the daemon starts (serving its own tiers) ``unavailable``, with
    CERTIFICATE_VERIFY_FAILED in ``condition_detail`` and in the log, and keeps retrying."""
    require_redis()
    pytest.importorskip("cryptography")
    cert, key = make_tls_cert(str(tmp_path / "tls"), "redis", ["127.0.0.1"])
    other, _ = make_tls_cert(str(tmp_path / "other"), "other", ["127.0.0.1"])
    try:
        server = RedisServer.start(tmp_path / "redis-tls", tls=(cert, key))
    except RuntimeError as exc:  # a redis-server built without TLS
        pytest.skip(f"redis-server cannot serve TLS here: {exc}")
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={other}"
    d = start_daemon(
        tmp_path / "a",
        "--dram", "4MiB", "--page-size", "4KiB", "--cluster", url, "--host-id", "a",
        "--cluster-ttl-s", "2", "--cluster-timeout-s", "2",
    )  # fmt: skip
    try:
        stats = wait_until(lambda: (s := cluster_stats(d))["errors"] >= 2 and s, DEADLINE_S)
        assert stats["condition"] == "unavailable"
        assert "CERTIFICATE_VERIFY_FAILED" in stats["condition_detail"], stats
        assert "CERTIFICATE_VERIFY_FAILED" in d.log()
        store(d, make_keys(2, tag="tls-ca"), SPEC)  # its own tiers serve
        assert server.cli("EXISTS", schema.host_key("a")) == "0"
    finally:
        d.kill()
        server.stop()


async def test_a_daemon_that_stepped_down_for_a_shared_host_id_takes_it_back_with_its_own_data(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two real daemons started with one host id: the later (b) owns it, the earlier (a)
    steps down (``unavailable``, the detail naming ``--host-id``) and is no holder of what it
    stores meanwhile; once b stops, a registers again and the id names a's chunks only: b's
    are gone with b (never a false holder), a's are back."""
    first = start_host(tmp_path / "first", redis_server, "x")
    second = None
    reader = reader_for(redis_server)
    mine, theirs = make_keys(3, tag="shared-first"), make_keys(4, tag="shared-second")
    try:
        store(first, mine, SPEC)
        await eventually(lambda: holds(reader, SPEC.ns_id, mine, {"x": 3}), timeout=DEADLINE_S)
        second = start_host(tmp_path / "second", redis_server, "x")
        store(second, theirs, SPEC)
        wait_until(lambda: cluster_stats(first)["condition"] == "unavailable", DEADLINE_S)
        assert "--host-id" in cluster_stats(first)["condition_detail"]
        await eventually(lambda: holds(reader, SPEC.ns_id, theirs, {"x": 4}), timeout=DEADLINE_S)
        assert await holds(reader, SPEC.ns_id, mine, {})
        assert second.terminate() == 0, second.log()
        wait_until(lambda: cluster_stats(first)["condition"] == "ok", DEADLINE_S)
        await eventually(lambda: holds(reader, SPEC.ns_id, mine, {"x": 3}), timeout=DEADLINE_S)
        assert await holds(reader, SPEC.ns_id, theirs, {})
    finally:
        first.kill()
        if second is not None:
            second.kill()
        await reader.redis.aclose()
