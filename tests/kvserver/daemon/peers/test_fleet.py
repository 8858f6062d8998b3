"""The network tier over the fleet index: three real daemons as hosts on a real redis-server.

Chunks stored through A are found through B and C by the fleet index (``--cluster``), looked
up as ``peer`` hits, fetched from A, placed in the fetching daemon's DRAM (and so indexed
under it in turn) and served byte for byte; a restarted A is a new incarnation whose old
entries are never used; a property test of random store / evict / kill / restart sequences
checks that every byte served through any host equals what was stored, and that every index
entry is true or cleaned within the TTL; a fleet secured on every hop (rediss://, CURVE between
peers and clients, TLS, a token) fetches the same way, over the TLS peer stream (and over
CURVE when the stream is off).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver.client import KVClient
from kvserver.cluster import FleetReader
from kvserver.cluster.config import ClusterConfig, connect
from kvserver.cluster.schema import host_key
from kvserver.crypto import CurveClient, make_curve_keys, make_tls_cert
from kvserver.errors import UnknownKey
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.redis import RedisServer, client_url, require_client, require_redis

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(tp_world_size=2)
TTL_S = 4.0
#: generous: Redis shares this machine with everything else the suite runs
REDIS_TIMEOUT_S = "2"


def start_host(
    tmp_path: Path, redis: RedisServer, host_id: str, *extra: str, url: str = ""
) -> DaemonProc:
    """``url``: the fleet URL (default ``redis.url``; a ``valkey://`` one picks that client)."""
    return start_daemon(
        tmp_path / host_id,
        "--dram", "4MiB", "--page-size", "4KiB", "--cluster", url or redis.url,
        "--host-id", host_id,
        "--cluster-ttl-s", str(TTL_S), "--cluster-timeout-s", REDIS_TIMEOUT_S,
        "--peer-timeout-s", "1", "--peer-suspect-s", "2", *extra,
    )  # fmt: skip


@pytest.fixture
def hosts(tmp_path: Path, fleet_server: RedisServer) -> Iterator[dict[str, DaemonProc]]:
    procs = {h: start_host(tmp_path, fleet_server, h) for h in "ABC"}
    yield procs
    for d in procs.values():
        d.kill()


def parts(key: bytes) -> list[bytes]:
    return [pattern(key, r, SPEC.part_bytes) for r in range(SPEC.tp_world_size)]


def rows(got: list[list[memoryview]]) -> list[list[bytes]]:
    return [[bytes(p) for p in row] for row in got]


def store(d: DaemonProc, keys: list[bytes]) -> list[bytes]:
    with KVClient(d.zmq_address, colocated=False) as kv:
        kv.register_namespace(SPEC)
        return kv.put(SPEC.ns_id, keys, [parts(k) for k in keys]).stored


def peer_hits(d: DaemonProc, keys: list[bytes]) -> int:
    with KVClient(d.zmq_address, colocated=False) as kv:
        kv.register_namespace(SPEC)
        return kv.lookup(SPEC.ns_id, keys).tiers.get("peer", 0)


def peer_stats(d: DaemonProc) -> dict[str, Any]:
    with KVClient(d.zmq_address, colocated=False) as kv:
        stats: dict[str, Any] = kv.stats()["peer"]
        return stats


def test_stored_through_a_loaded_through_b_and_c_byte_for_byte(
    hosts: dict[str, DaemonProc],
) -> None:
    a, b, c = hosts["A"], hosts["B"], hosts["C"]
    keys = make_keys(5)
    assert store(a, keys[:4]) == keys[:4]
    wait_until(lambda: peer_hits(b, keys) == 4)  # the index lags A's store by a batch
    for d, colocated in ((b, True), (c, False)):
        with KVClient(d.zmq_address, colocated=colocated) as kv:
            kv.register_namespace(SPEC)
            # (retried: a Redis call that times out under load answers no holders, by design)
            hit = wait_until(lambda: (h := kv.lookup(SPEC.ns_id, keys)).hit_chunks == 4 and h)
            assert hit.tiers["peer"] + hit.tiers["dram"] == 4
            assert rows(kv.load(SPEC.ns_id, keys[:4])) == [parts(k) for k in keys[:4]]
            assert kv.lookup(SPEC.ns_id, keys).tiers == {"dram": 4, "peer": 0}
            with pytest.raises(UnknownKey):
                kv.load(SPEC.ns_id, keys[4:])
    assert peer_stats(b)["fetched_chunks"] == 4
    assert peer_stats(c)["fetched_chunks"] == 4  # from A or from B: both hold them now
    for d in (b, c):  # the stream ports the fleet records advertise
        assert 0 < peer_stats(d)["stream_fetches"] == peer_stats(d)["fetches"]


def test_daemons_on_the_valkey_client_fetch_from_each_other_byte_for_byte(
    tmp_path: Path, fleet_server: RedisServer
) -> None:
    """``--cluster valkey://``: membership, index and the peer tier through the valkey client,
    on redis-server and on valkey-server (the ``fleet_server`` kinds)."""
    require_client("valkey")
    url = client_url(fleet_server.url, "valkey")
    a, b = (start_host(tmp_path, fleet_server, h, url=url) for h in "AB")
    try:
        for d in (a, b):
            with KVClient(d.zmq_address, colocated=False) as kv:
                assert kv.stats()["cluster"]["url"].startswith("valkey://")
        keys = make_keys(4)
        assert store(a, keys) == keys
        wait_until(lambda: peer_hits(b, keys) == 4)
        with KVClient(b.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
        assert peer_stats(b)["fetched_chunks"] == 4
    finally:
        for d in (a, b):
            d.kill()


def test_a_restarted_peer_is_a_new_incarnation_whose_old_entries_are_not_used(
    tmp_path: Path, fleet_server: RedisServer, hosts: dict[str, DaemonProc]
) -> None:
    a, b = hosts["A"], hosts["B"]
    keys = make_keys(3, tag="restart")
    store(a, keys)
    wait_until(lambda: peer_hits(b, keys) == 3)
    before = a.info["cluster_incarnation"]
    a.kill()
    hosts["A"] = a = start_host(tmp_path / "again", fleet_server, "A")
    assert a.info["cluster_incarnation"] != before
    # as soon as A re-registered, its old entries are no longer read: B sees nothing of A
    wait_until(lambda: peer_hits(b, keys) == 0, timeout=TTL_S * 3)
    with KVClient(b.zmq_address, colocated=False) as kv:
        kv.register_namespace(SPEC)
        with pytest.raises(UnknownKey):  # a miss, never a wrong byte
            kv.load(SPEC.ns_id, keys)
    assert peer_stats(b)["fetched_chunks"] == 0


# ----------------------------------------------------------------------------- property


def fleet_reader(redis: RedisServer) -> FleetReader:
    config = ClusterConfig(redis.url, timeout_s=2.0, members_max_age_s=0.0)
    return FleetReader(connect(config), config)


def index_is_true(redis: RedisServer, hosts: dict[str, DaemonProc], keys: list[bytes]) -> bool:
    """Every live host the index names for a key holds it (a local lookup says so)."""

    async def check() -> bool:
        reader = fleet_reader(redis)
        try:
            for key in keys:
                for run in await reader.lookup(SPEC.ns_id, [key]):
                    d = hosts.get(run.host.host_id)
                    if d is None or d.proc.poll() is not None:
                        return False  # a dead host still indexed: not yet cleaned
                    with KVClient(d.zmq_address, colocated=False) as kv:
                        kv.register_namespace(SPEC)
                        if kv.lookup(SPEC.ns_id, [key], local=True).hit_chunks != 1:
                            return False
            return True
        finally:
            await reader.redis.aclose()

    return asyncio.run(check())


KEYS = make_keys(12, tag="prop")
FILLER = make_keys(8, tag="filler")  # a host's whole DRAM: storing them evicts the rest
Op = tuple[str, str, int]
ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "load", "load", "evict", "kill", "restart"]),
        st.sampled_from("ABC"),
        st.integers(0, len(KEYS) - 3),
    ),
    min_size=4,
    max_size=10,
)


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=ops_strategy)
def test_every_byte_served_equals_what_was_stored_and_the_index_is_true_within_the_ttl(
    tmp_path: Path, redis_server: RedisServer, ops: list[Op]
) -> None:
    """Random store / evict / kill / restart / load sequences over three hosts with 8 chunks
    of DRAM each: a load through any live host either misses or returns exactly the stored
    bytes; afterwards every index entry names a live host that holds the chunk, within the
    TTL."""
    redis_server.cli("FLUSHALL")
    run_dir = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
    hosts: dict[str, DaemonProc] = {}
    extra = ("--dram", "64KiB")  # 16 pages of 4 KiB: 8 chunks of two parts
    try:
        for h in "ABC":
            hosts[h] = start_host(run_dir / "0", redis_server, h, *extra)
        for step, (op, h, i) in enumerate(ops, 1):
            d = hosts[h]
            alive = d.proc.poll() is None
            keys = KEYS[i : i + 3]
            if op == "store" and alive:
                store(d, keys)
            elif op == "evict" and alive:
                with KVClient(d.zmq_address, colocated=False) as kv:
                    kv.register_namespace(SPEC)
                    put = kv.put(SPEC.ns_id, FILLER, [parts(k) for k in FILLER])
                    assert not put.rejected  # the whole DRAM, every other chunk evicted
            elif op == "kill" and alive:
                d.kill()
            elif op == "restart" and not alive:
                hosts[h] = start_host(run_dir / str(step), redis_server, h, *extra)
            elif op == "load" and alive:
                with KVClient(d.zmq_address, colocated=False, timeout=30) as kv:
                    kv.register_namespace(SPEC)
                    n = kv.lookup(SPEC.ns_id, keys).hit_chunks
                    try:
                        got = rows(kv.load(SPEC.ns_id, keys[:n])) if n else []
                    except UnknownKey:
                        got = []  # a miss (evicted or a peer gone since the lookup)
                    assert got == [parts(k) for k in keys[: len(got)]]
        wait_until(lambda: index_is_true(redis_server, hosts, KEYS), timeout=TTL_S * 4)
    finally:
        for d in hosts.values():
            d.kill()


def test_chunks_a_fetch_placed_are_announced_under_the_fetching_host(
    hosts: dict[str, DaemonProc],
) -> None:
    """llm-d's topic ``kv@<pod>@<model>`` names the fleet host id: B's BlockStored events for
    what it fetched from A say B (as do the fleet index entries, through the same events)."""
    a, b = hosts["A"], hosts["B"]
    keys = make_keys(2, tag="events")
    store(a, keys)
    wait_until(lambda: peer_hits(b, keys) == 2)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(b.pub_address)
    try:
        with KVClient(b.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            probes = iter(make_keys(1000, tag="probe"))

            def subscribed() -> bool:  # PUB drops until the subscription has propagated
                key = next(probes)
                kv.put(SPEC.ns_id, [key], [parts(key)])
                return bool(sub.poll(50))

            wait_until(subscribed)
            while sub.poll(200):  # the probes' events
                sub.recv_multipart()
            assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
            assert sub.poll(5000)
            topic, _seq, payload = sub.recv_multipart()
            assert topic == f"kv@B/{SPEC.ns_id}@{SPEC.model}".encode()
            assert keys[0] in payload and keys[1] in payload  # the block hashes, in B's event
        wait_until(lambda: peer_hits(hosts["C"], keys) == 2)  # C sees A's and B's copies
    finally:
        sub.close()


# ----------------------------------------------------------------------------- secured


@pytest.mark.parametrize("stream", ["tls", "off"])
def test_a_secured_fleet_over_rediss_fetches_over_the_tls_stream_or_curve(
    tmp_path: Path, stream: str
) -> None:
    """Every hop secured: the fleet state over TLS (``rediss://``), two daemons beyond
    loopback with CURVE (peers admitted by the fleet's own key in the clients directory), TLS
    (one certificate for the fleet, client certificates required) and a token; a client with
    a listed key stores through A and loads A's bytes through B: over A's TLS stream port
    (advertised as tls:// in A's record), or over ZMQ with CURVE when the stream is off."""
    require_redis()
    token = "secured-fleet-token-0123456789"
    server_key, server_secret = make_curve_keys(str(tmp_path / "keys"), "server")
    clients = tmp_path / "clients"
    _, client_secret = make_curve_keys(str(clients), "client")
    (clients / "server.key").write_text(Path(server_key).read_text())  # the peers
    cert, key = make_tls_cert(str(tmp_path / "tls"), "server", ["127.0.0.1"])
    redis_cert, redis_key = make_tls_cert(str(tmp_path / "redis-tls"), "redis", ["127.0.0.1"])
    redis = RedisServer.start(tmp_path / "redis", tls=(redis_cert, redis_key))
    assert redis.url.startswith("rediss://")
    secure = ("--host", "0.0.0.0", "--advertise-addr", "127.0.0.1", "--auth-token", token,
              "--curve-secret-key-file", server_secret, "--curve-clients-dir", str(clients),
              "--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", cert,
              *(("--peer-stream-port", "-1") if stream == "off" else ()))  # fmt: skip
    hosts = {}
    try:
        hosts = {h: start_host(tmp_path, redis, h, *secure) for h in "AB"}
        curve = CurveClient.from_files(server_key, client_secret)

        def client(d: DaemonProc) -> KVClient:
            kv = KVClient(d.zmq_address, colocated=False, curve=curve, auth_token=token)
            kv.register_namespace(SPEC)
            return kv

        keys = make_keys(3, tag="secured")
        with client(hosts["A"]) as kv:
            assert kv.put(SPEC.ns_id, keys, [parts(k) for k in keys]).stored == keys
        with client(hosts["B"]) as kv:
            wait_until(lambda: kv.lookup(SPEC.ns_id, keys).tiers.get("peer", 0) == 3)
            assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
            stats = kv.stats()["peer"]
            assert stats["fetched_chunks"] == 3 and stats["failures"] == 0
            want = stats["fetches"] if stream == "tls" else 0
            assert stats["stream_fetches"] == want and stats["fetches"] > 0
        if stream == "tls":
            a = hosts["A"]
            assert a.info["peer_stream_tls"] is True
            record = redis.cli("GET", host_key("A"))
            assert f'"stream_address":"tls://127.0.0.1:{a.info["peer_stream_port"]}"' in record
        else:
            assert all(d.info["peer_stream_port"] == -1 for d in hosts.values())  # none opened
    finally:
        for d in hosts.values():
            d.kill()
        redis.stop()


def test_a_peer_restarted_between_heartbeats_is_fetched_from_at_its_new_address(
    tmp_path: Path, fleet_server: RedisServer
) -> None:
    """A restarted (new incarnation, new ports) is named by the index as soon as it
    re-registers; B's lookups then credit A's new chunks, and a load through B must fetch
    them from A's new address, not from the incarnation B's last heartbeat saw (dead: a
    timeout, A suspect, a miss). B's heartbeat is 20 s apart, so none falls in between."""
    slow = ("--cluster-ttl-s", "60")
    a, b = (start_host(tmp_path, fleet_server, h, *slow) for h in "AB")
    try:
        old = make_keys(2, tag="old")
        assert store(a, old) == old
        wait_until(lambda: peer_hits(b, old) == 2)
        a.kill()
        a = start_host(tmp_path / "again", fleet_server, "A", *slow)
        keys = make_keys(3, tag="new")
        assert store(a, keys) == keys
        wait_until(lambda: peer_hits(b, keys) == 3)
        with KVClient(b.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
        assert peer_stats(b)["peers_suspect"] == 0
    finally:
        for d in (a, b):
            d.kill()


def test_the_link_to_a_member_that_left_the_fleet_is_closed(
    tmp_path: Path, fleet_server: RedisServer
) -> None:
    """A member that leaves (SIGTERM here; a record that expired alike) is no peer any more:
    B closes its link to it (data-plane sockets, which ZMQ would otherwise keep reconnecting
    to the dead address, and stream connections) at its next fetch, rather than keeping every
    link it ever opened (a fleet whose host ids change, as the default one naming the boot
    does, would pile them up)."""
    a, b, c = (start_host(tmp_path, fleet_server, h) for h in "ABC")
    try:
        for source, tag in ((a, "from-a"), (c, "from-c")):
            keys = make_keys(3, tag=tag)
            assert store(source, keys) == keys
            wait_until(lambda keys=keys: peer_hits(b, keys) == 3)
            with KVClient(b.zmq_address, colocated=False) as kv:
                kv.register_namespace(SPEC)
                assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
            assert peer_stats(b)["peers_linked"] == 1  # the one it fetched from
            if source is a:
                a.terminate()
                wait_until(lambda: peer_stats(b)["peers_known"] == 1)  # C alone
    finally:
        for d in (a, b, c):
            d.kill()
