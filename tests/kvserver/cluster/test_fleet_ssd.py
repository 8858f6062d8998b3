"""The fleet index and the SSD tier: real daemons (``kvserver start --cluster --ssd-dir``) on a
real redis-server, with real data files.

A daemon SIGKILLed and restarted on its SSD directory indexes what it recovered under its new
incarnation (docs/cluster.md, "a daemon restarts"), and a chunk it promotes under dram; a
chunk found corrupt on read leaves the fleet index (docs/ssd_format.md, Read), so the host is
never scored for bytes it cannot serve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvserver.client import KVClient
from kvserver.cluster import schema
from kvserver.errors import UnknownKey
from kvserver.ssd import format as fmt
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.cluster.builders import eventually
from tests.kvserver.cluster.test_fleet_daemons import TTL_S, cluster_stats, reader_for
from tests.kvserver.cluster.test_fleet_losses import DEADLINE_S, holds, incarnation
from tests.kvserver.daemon.test_ssd_daemon import ENV as SSD_ENV
from tests.kvserver.daemon.test_ssd_daemon import (
    SLOT,
    data_file,
    flip,
    headers,
    on_ssd_only,
    settled,
    store_all,
)
from tests.kvserver.daemon.test_ssd_daemon import SPEC as SSD_SPEC
from tests.kvserver.daemon.test_ssd_daemon import args as ssd_args
from tests.kvserver.daemon.test_ssd_daemon import registered as ssd_registered
from tests.support.daemon import start_daemon, wait_until
from tests.support.redis import RedisServer

pytestmark = pytest.mark.multiprocess


async def test_a_restarted_ssd_daemon_indexes_what_it_recovered_under_its_new_incarnation(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """100 chunks through a 40-chunk DRAM (the rest written down), SIGKILL, a restart on the
    same directory and host id: the fleet index names the chunks it recovered on SSD, exactly
    as its own Lookup splits them, under a new incarnation; the old incarnation's sets (its
    record still alive at the restart) are unlinked, not left to expire. A recovered chunk
    a load promotes into DRAM is indexed under dram."""
    spec = make_spec(model="test/fleet-ssd-restart", part_bytes_override=12_000)
    argv = (
        "--page-size", "4KiB", "--dram", "480KiB", "--ssd-dir", str(tmp_path / "ssd"),
        "--ssd", "8MiB", "--ssd-admission", "1", "--cluster", redis_server.url,
        "--host-id", "s", "--cluster-ttl-s", "30", "--cluster-timeout-s", "2",
    )  # fmt: skip
    keys = make_keys(100, tag="fleet-ssd-restart")
    d = start_daemon(tmp_path / "first", *argv, env={"KVSERVER_SSD_RETRY_S": "0.2"})
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = kv.register_namespace(spec).ns_id
            wait_until(lambda: kv.stats()["ssd"]["unsaved_namespaces"] == 0)
            for i in range(0, 100, 10):
                batch = keys[i : i + 10]
                parts = [[pattern(k, 0, spec.part_bytes)] for k in batch]
                assert kv.store(ns_id, batch, parts) == batch
            wait_until(lambda: kv.stats()["ssd"]["writes_in_flight"] == 0)
        wait_until(lambda: cluster_stats(d)["condition"] == "ok", DEADLINE_S)
        old = incarnation(redis_server, "s")
        old_sets = [schema.index_key("s", old, ns_id, t) for t in schema.TIERS]
        wait_until(lambda: all(redis_server.cli("EXISTS", k) == "1" for k in old_sets))
    finally:
        d.kill()
    d = start_daemon(tmp_path / "second", *argv, env={"KVSERVER_SSD_RETRY_S": "0.2"})
    reader = reader_for(redis_server)
    try:
        wait_until(lambda: cluster_stats(d)["condition"] == "ok", DEADLINE_S)
        assert incarnation(redis_server, "s") != old
        with KVClient(d.zmq_address) as kv:
            assert kv.stats()["ssd"]["recovered_chunks"] > 0
            local = kv.lookup(ns_id, keys)
        assert local.hit_chunks > 0 and local.tiers["ssd"] == local.hit_chunks
        local.tiers.pop("peer")
        assert [redis_server.cli("EXISTS", k) for k in old_sets] == ["0", "0"]

        async def matches() -> bool:
            found = await reader.lookup(ns_id, keys, exact=True)
            return [(r.host.host_id, r.hit_chunks, r.tiers) for r in found] == [
                ("s", local.hit_chunks, local.tiers)
            ]

        await eventually(matches, timeout=DEADLINE_S)
        first = keys[:1]  # promoted into DRAM by a load: announced, indexed under dram too
        with KVClient(d.zmq_address) as kv:
            assert [bytes(p) for p in kv.load(ns_id, first)[0]] == [
                pattern(first[0], 0, spec.part_bytes)
            ]

        async def promoted() -> bool:
            found = await reader.lookup(ns_id, first, exact=True)
            return [r.tiers for r in found] == [{"dram": 1, "ssd": 0}]

        await eventually(promoted, timeout=DEADLINE_S)
    finally:
        d.kill()
        await reader.redis.aclose()


async def test_a_corrupt_chunk_found_on_read_leaves_the_fleet_index(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """docs/ssd_format.md, Read, with a fleet: a chunk whose payload no longer matches its
    checksum is a miss, and its BlockRemoved (STORAGE) takes it out of the fleet index, so
    the host is not scored for bytes it cannot serve; the other chunks stay listed."""
    ssd_dir = tmp_path / "ssd"
    d = start_daemon(
        tmp_path / "s", *ssd_args(ssd_dir), "--cluster", redis_server.url, "--host-id", "s",
        "--cluster-ttl-s", str(TTL_S), "--cluster-timeout-s", "2", env=SSD_ENV,
    )  # fmt: skip
    reader = reader_for(redis_server)
    try:
        wait_until(lambda: cluster_stats(d)["condition"] == "ok", DEADLINE_S)
        with KVClient(d.zmq_address, colocated=False) as kv:
            ns_id = ssd_registered(kv, SSD_SPEC)
            keys = make_keys(80, tag="fleet-corrupt")
            store_all(kv, ns_id, SSD_SPEC, keys)
            settled(kv)
            bad, good = on_ssd_only(kv, ns_id, keys)[:2]
            for key in (bad, good):
                await eventually(
                    lambda k=key: _tiers(reader, ns_id, k, {"dram": 0, "ssd": 1}), DEADLINE_S
                )
            slot, _ = headers(data_file(ssd_dir))[bad]
            flip(data_file(ssd_dir), slot * SLOT + fmt.HEADER_BYTES + 5_000)
            with pytest.raises(UnknownKey):  # a miss, never wrong bytes
                kv.get(ns_id, [bad])
            assert settled(kv)["corrupt_chunks"] == 1
        await eventually(lambda: holds(reader, ns_id, [bad], {}), timeout=DEADLINE_S)
        assert await _tiers(reader, ns_id, good, {"dram": 0, "ssd": 1})
    finally:
        d.kill()
        await reader.redis.aclose()


async def _tiers(reader: Any, ns_id: str, key: bytes, tiers: dict[str, int]) -> bool:
    return [r.tiers for r in await reader.lookup(ns_id, [key], exact=True)] == [tiers]
