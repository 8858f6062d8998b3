"""The fleet property with real parts: store / evict / kill / restart sequences over two real
daemons (``kvserver start --cluster``, a DRAM tier of 40 chunks, so stores evict) on a real
redis-server. After every step each live daemon's index set equals, once settled, exactly the
chunks its own Lookup finds; a SIGKILLed daemon's record and sets are gone within the TTL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis as redis_sync

from kvserver.client import KVClient
from kvserver.cluster import schema
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.redis import RedisServer

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/fleet-property")  # one 4 KiB page per chunk
KEYS = make_keys(60, tag="fleet-property")
HOSTS = ("p", "q")
TTL_S = 2.0


def start(tmp: Path, redis: RedisServer, host: str, n: int) -> DaemonProc:
    d = start_daemon(
        tmp / f"{host}{n}",
        "--page-size", "4KiB", "--dram", "160KiB", "--cluster", redis.url, "--host-id", host,
        "--cluster-ttl-s", str(TTL_S), "--cluster-timeout-s", "0.5",
    )  # fmt: skip
    with KVClient(d.zmq_address) as kv:
        kv.register_namespace(SPEC)
    return d


def index_set(r: redis_sync.Redis, d: DaemonProc) -> set[bytes]:
    key = schema.index_key(d.info["cluster_host_id"], d.info["cluster_incarnation"], SPEC.ns_id,
                           schema.TIER_DRAM)  # fmt: skip
    return set(r.smembers(key))


def truth(kv: KVClient) -> set[bytes]:
    """Fingerprints of the chunks the daemon's own Lookup finds in its DRAM (one key at a time;
    its network tier's hits, chunks its peers hold, are not its own)."""
    return {schema.fingerprint(k) for k in KEYS if kv.lookup(SPEC.ns_id, [k]).tiers.get("dram")}


def run(tmp: Path, redis: RedisServer, ops: list[tuple[object, ...]]) -> None:
    redis.cli("FLUSHALL")
    r = redis_sync.Redis(port=redis.port)
    live: dict[str, DaemonProc] = {}
    killed: list[tuple[DaemonProc, list[str], float]] = []
    starts = 0
    try:
        for host in HOSTS:
            live[host] = start(tmp, redis, host, starts)
            starts += 1
        for step in ops:
            kind, host = str(step[0]), str(step[1])
            d = live.get(host)
            if kind == "store" and d is not None:
                begin, n = int(step[2]), int(step[3])  # type: ignore[call-overload]
                batch = KEYS[begin : begin + n]
                with KVClient(d.zmq_address) as kv:
                    kv.store(SPEC.ns_id, batch, [[pattern(k, 0, SPEC.part_bytes)] for k in batch])
            elif kind in ("kill", "restart") and d is not None:
                sets = redis.cli("KEYS", f"kvs1:{{h:{host}}}:{d.info['cluster_incarnation']}:*")
                killed.append((d, sets.split(), time.monotonic()))
                d.kill()
                del live[host]
            if kind == "restart":
                live[host] = start(tmp, redis, host, starts)
                starts += 1
            for d in live.values():  # every entry true, once the daemon's writes settle
                with KVClient(d.zmq_address) as kv:
                    wait_until(lambda d=d, kv=kv: index_set(r, d) == truth(kv), timeout=10.0)
        for d, sets, at in killed:  # cleaned by TTL + one heartbeat + slack after the kill
            left = max(at + TTL_S + 3.0 - time.monotonic(), 0.1)
            wait_until(lambda sets=sets: not sets or not r.exists(*sets), timeout=left)
            host = d.info["cluster_host_id"]
            if host not in live:
                assert not int(redis.cli("EXISTS", schema.host_key(host)))
    finally:
        for d in live.values():
            d.kill()
        r.close()


#: sequences over every kind of step (stores of 30 and 60 chunks evict from 40-chunk DRAM);
#: the hypothesis-driven version of this property runs on in-process members
#: (test_fleet_property.py): real daemons make each example cost seconds.
SEQUENCES = {
    "store-evict-restart": [("store", "p", 0, 30), ("store", "q", 10, 30), ("restart", "q"),
                            ("store", "p", 20, 40), ("store", "q", 0, 5)],
    "kill-restart-store": [("kill", "p"), ("restart", "p"), ("store", "p", 0, 30),
                           ("store", "p", 30, 30), ("kill", "q"), ("restart", "q"),
                           ("store", "q", 50, 10)],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_index_entries_match_real_daemons_or_go_within_the_ttl(
    tmp_path: Path, shared_redis: RedisServer, name: str
) -> None:
    run(tmp_path, shared_redis, SEQUENCES[name])  # type: ignore[arg-type]
