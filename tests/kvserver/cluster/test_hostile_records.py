"""What Redis hands a daemon is not trusted: entries no daemon of this version writes (another
version's, a buggy writer's), written straight into a real redis-server beside a live member.
The member keeps its place in the fleet, reads the valid members, and says what it skipped;
a lookup and ``ScoreHosts`` answer for the valid hosts, or a clear error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.cluster import schema
from kvserver.cluster.rpc import score_hosts
from kvserver.cluster.schema import MAX_RECORD_BYTES, HostInfo
from kvserver.errors import UnknownNamespace
from tests.kvserver.cluster.builders import NS, Member, cluster_config, eventually, keys
from tests.support.redis import RedisServer

TTL_MS = 600_000  # the stand-in records outlive the test


def good(host_id: str, **fields: Any) -> dict[str, Any]:
    """A record as a daemon writes it, as a dict (``fields`` replace its values)."""
    info = HostInfo(host_id, "inc0000000000001", "tcp://127.0.0.1:1", "127.0.0.1:2",
                    ("dram",), {"dram": 1 << 30}, (NS,), 1.7e9)  # fmt: skip
    return json.loads(info.encode()) | fields


def as_json(d: dict[str, Any]) -> bytes:
    return json.dumps(d).encode()


#: host id -> its record: none of them is what a version-1 daemon writes
BAD_RECORDS: dict[str, bytes] = {
    "not-json": b"{not json",
    "not-utf8": b'{"version": 1, "host_id": "\xff\xfe"}',
    "a-list": b"[1, 2, 3]",
    "nested": b"[" * 100_000 + b"]" * 100_000,
    "huge": as_json(good("huge", pad="x" * MAX_RECORD_BYTES)),
    "version-2": as_json(good("version-2", version=2)),
    "no-address": as_json({k: v for k, v in good("no-address").items() if k != "data_address"}),
    "ipc-address": as_json(good("ipc-address", data_address="ipc:///tmp/kvserver.sock")),
    "bad-port": as_json(good("bad-port", data_address="tcp://127.0.0.1:99999")),
    "bare-host": as_json(good("bare-host", data_address="tcp://127.0.0.1")),
    "bad-stream": as_json(good("bad-stream", stream_address="udp://127.0.0.1:5")),
    "negative": as_json(good("negative", capacity={"dram": -5})),
    "absurd": as_json(good("absurd", capacity={"dram": 10**30})),
    "nan-start": json.dumps(good("nan-start", started_at=float("nan"))).encode(),
    "number-id": as_json(good("number-id") | {"host_id": 7}),
    "brace-inc": as_json(good("brace-inc", incarnation="a}b")),
    "many-ns": as_json(good("many-ns", namespaces=[f"{i:016x}" for i in range(5000)])),
    "impostor": as_json(good("host-b")),  # stored under another host's id
}
#: hosts-set members that are not host ids (no record could be named by them)
BAD_IDS = [b"\xff\xfe", b"has space", b"x" * 300]


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client, to write what no daemon writes."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


async def test_entries_no_daemon_writes_are_skipped_and_the_member_stays_in_the_fleet(
    redis_server: RedisServer, raw: redis.Redis
) -> None:
    """Beside one valid member (host-b), the hosts set holds ids that are not host ids (one
    not UTF-8) and records no version-1 daemon writes. host-a keeps heartbeating ``ok`` with
    no Redis error, lists itself and host-b only, forgets the ids no daemon can have and
    counts the records it skipped. Before: the id
    that is not UTF-8 failed every read of the members (UnicodeDecodeError), so every
    heartbeat failed: host-a went ``unavailable``, re-registered and resynced at every retry,
    out of the fleet; and records with a negative capacity, an ipc:// or out-of-range data
    address, a NaN start or an impostor's host id were taken as members."""
    member = Member("host-a", cluster_config(redis_server.url, ttl_s=1.5))
    node = await member.start()
    try:
        raw.sadd(schema.hosts_key(), "host-b", *BAD_RECORDS, *BAD_IDS)
        raw.set(schema.host_key("host-b"), as_json(good("host-b")), px=TTL_MS)
        for host_id, record in BAD_RECORDS.items():
            raw.set(schema.host_key(host_id), record, px=TTL_MS)
        beats = node.counters.heartbeats

        async def three_more_heartbeats() -> bool:  # the first may have read before
            return node.counters.heartbeats >= beats + 3

        await eventually(three_more_heartbeats, timeout=30.0)
        assert node.condition == "ok", node.stats()
        assert node.counters.errors == 0 and node.counters.registrations == 1
        assert [h.host_id for h in node.members] == ["host-a", "host-b"]
        # the ids no daemon can have are forgotten; the records stay (not ours), skipped
        assert not set(BAD_IDS) & set(raw.smembers(schema.hosts_key()))
        assert node.stats()["bad_records"] == len(BAD_RECORDS)
        member.store(keys(3))
        await member.settled()  # and it still writes its index
    finally:
        await node.stop()


@pytest.mark.parametrize("exact", [True, False])
async def test_an_index_set_of_another_type_hides_that_host_only(
    redis_server: RedisServer, raw: redis.Redis, exact: bool
) -> None:
    """A live member's index set is a string, not a set (another version's key layout): a
    lookup answers the other hosts' runs, that host holding nothing. Before: the script's
    SMISMEMBER failed with WRONGTYPE, failing the whole lookup (one script reads every host):
    one such key hid every holder of the fleet from every daemon (Unavailable: no peer
    fetches, ScoreHosts UNAVAILABLE)."""
    member = Member("host-a", cluster_config(redis_server.url))
    node = await member.start()
    try:
        ks = keys(4)
        member.store(ks)
        await member.settled()
        info = HostInfo.decode(as_json(good("host-b")))
        raw.set(schema.host_key("host-b"), info.encode(), px=TTL_MS)
        raw.sadd(schema.hosts_key(), "host-b")
        dram = schema.index_key("host-b", info.incarnation, NS, schema.TIER_DRAM)
        raw.set(dram, b"not a set", px=TTL_MS)
        runs = await node.reader.lookup(NS, ks, exact=exact)
        assert [(r.host.host_id, r.hit_chunks) for r in runs] == [("host-a", 4)]
        assert node.stats()["unreadable_sets"] == 1
    finally:
        await node.stop()


class _Service:
    """What ``score_hosts`` reads of a daemon: this one has registered no namespace."""

    def __init__(self, node: Any) -> None:
        self.cluster = node

    def find_namespace(self, ns_id: str) -> None:
        return None

    def hash_prompt(self, *args: Any, **kw: Any) -> list[bytes]:
        raise AssertionError("not asked: the spec is refused first")


@pytest.mark.parametrize(
    "spec",
    [b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000, b'"' + b"x" * (1 << 20) + b'"'],
    ids=["not-utf8", "nested", "huge"],
)
async def test_a_fleet_spec_no_daemon_writes_is_a_clear_unknown_namespace(
    redis_server: RedisServer, raw: redis.Redis, spec: bytes
) -> None:
    """ScoreHosts for a namespace this daemon has not registered reads the spec a member
    published; one no daemon writes answers UnknownNamespace (NOT_FOUND) saying the fleet's
    spec is unusable. Before: bytes that were not UTF-8 and JSON nested too deep raised out of
    the call (gRPC INTERNAL)."""
    member = Member("host-a", cluster_config(redis_server.url))
    node = await member.start()
    try:
        ns_id = "badspec000000001"
        raw.hset(schema.namespaces_key(), ns_id, spec)
        req = pb.ScoreHostsRequest(namespace_id=ns_id, keys=pb.KeyPrefix(keys=keys(2)))
        with pytest.raises(UnknownNamespace, match="the fleet's spec of this namespace is unusa"):
            await score_hosts(_Service(node), req)
    finally:
        await node.stop()
