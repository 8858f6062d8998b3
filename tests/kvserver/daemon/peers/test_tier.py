"""The network tier in real daemons: three hosts on loopback, chunks stored through one, looked
up and loaded through the others (``--peers``: every daemon names the other two).

A peer killed in the middle of a fetch is a fault the test times with the SSD read gate of
``test_zmq_promotion`` (the peer's promotion for the fetch waits at a FIFO: the fetch is then
in flight, deterministically, when the peer is SIGKILLed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.crypto import CurveClient, make_curve_keys
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.peers.fetch import STREAM_WINDOW_BYTES
from kvserver.errors import InvalidArgument, UnknownKey
from kvserver.grpc_client import GrpcClient
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.daemon.test_zmq_promotion import gate_closed, start_gated
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.metrics import scrape

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(tp_world_size=2)
TIMEOUT = "1.5"  # --peer-timeout-s


def parts(key: bytes) -> list[bytes]:
    return [pattern(key, r, SPEC.part_bytes) for r in range(SPEC.tp_world_size)]


def rows(got: list[list[memoryview]]) -> list[list[bytes]]:
    return [[bytes(p) for p in row] for row in got]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[DaemonProc]]:
    """A, B and C, each with the other two as peers (ports known only once they listen, so
    A starts first alone, then B and C name it and each other through A's restart-free
    order: A has no peers, B names A, C names A and B)."""
    a = start_daemon(tmp_path / "a", "--dram", "8MiB")
    b = start_daemon(tmp_path / "b", "--dram", "8MiB", "--peers", a.zmq_address,
                     "--peer-timeout-s", TIMEOUT)  # fmt: skip
    c = start_daemon(tmp_path / "c", "--dram", "8MiB", "--peers",
                     f"{a.zmq_address},{b.zmq_address}", "--peer-timeout-s", TIMEOUT)  # fmt: skip
    try:
        yield [a, b, c]
    finally:
        for d in (a, b, c):
            d.kill()


def test_chunks_stored_through_a_are_looked_up_and_loaded_through_b_and_c(
    fleet: list[DaemonProc],
) -> None:
    a, b, c = fleet
    keys = make_keys(6)
    with KVClient(a.zmq_address) as kv:
        kv.register_namespace(SPEC)
        assert kv.store(SPEC.ns_id, keys[:4], [parts(k) for k in keys[:4]]) == keys[:4]
    with KVClient(b.zmq_address) as kv:
        kv.register_namespace(SPEC)
    with GrpcClient(b.grpc_address) as g:  # the gRPC Lookup carries the peer count too
        reply = g.lookup_keys(SPEC.ns_id, keys)
        assert (reply.hit_chunks, reply.tiers) == (4, {"dram": 0, "peer": 4})
        (peer_tier,) = [t for t in g.stats().tiers if t.name == "peer"]
        assert (peer_tier.condition, peer_tier.hit_chunks) == ("ok", 4)
    for daemon, colocated in ((b, True), (c, False)):
        with KVClient(daemon.zmq_address, colocated=colocated) as kv:
            kv.register_namespace(SPEC)
            assert kv.is_colocated is colocated
            hit = kv.lookup(SPEC.ns_id, keys)
            assert (hit.hit_chunks, hit.tiers) == (4, {"dram": 0, "peer": 4})
            assert rows(kv.load(SPEC.ns_id, keys[:4])) == [parts(k) for k in keys[:4]]
            hit = kv.lookup(SPEC.ns_id, keys)  # now in this daemon's own DRAM
            assert (hit.hit_chunks, hit.tiers) == (4, {"dram": 4, "peer": 0})
            peer = kv.stats()["peer"]
            assert (peer["fetched_chunks"], peer["placed_chunks"], peer["condition"]) == (
                4, 4, "ok")  # fmt: skip
            with pytest.raises(UnknownKey):  # held by no one: a miss, as without peers
                kv.load(SPEC.ns_id, keys[4:])


def test_a_load_without_a_lookup_asks_a_likely_peer_for_the_bytes_straight_away(
    fleet: list[DaemonProc],
) -> None:
    """``--peers``: a load asks no lookup of the peers before fetching. B (one peer) fetches
    from A at once; C (two peers) looks up the first time, then asks the peer that last sent
    it chunks of the namespace first, and looks up only what that one did not send (none of
    the keys, or all but a leading part)."""
    a, b, c = fleet
    k1, k2, k3, k4, nobody = (make_keys(3, tag=t) for t in ("1", "2", "3", "4", "none"))

    def put(d: DaemonProc, keys: list[bytes]) -> None:
        with KVClient(d.zmq_address) as kv:
            kv.register_namespace(SPEC)
            assert kv.store(SPEC.ns_id, keys, [parts(k) for k in keys]) == keys

    def load(d: DaemonProc, keys: list[bytes]) -> dict[str, int]:
        with KVClient(d.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
            stats: dict[str, int] = kv.stats()["peer"]
            return stats

    def counts(stats: dict[str, int]) -> tuple[int, int, int]:
        return stats["directory_lookups"], stats["directory_skipped"], stats["fetched_chunks"]

    put(a, k1)
    put(a, k2)
    put(b, k3)
    assert counts(load(c, k1)) == (1, 0, 3)  # two peers, none sent anything yet: look up
    assert counts(load(c, k2)) == (1, 1, 6)  # A sent k1: asked first, no lookup
    assert counts(load(c, k3)) == (2, 2, 9)  # A sends none of k3: then looked up, B sends
    put(b, k4[:1])
    put(a, k4)
    assert counts(load(c, k4)) == (3, 3, 12)  # B (the last sender) sends 1, A the other 2
    assert counts(load(b, k1)) == (0, 1, 3)  # one peer: never a lookup before a fetch
    with KVClient(b.zmq_address, colocated=False) as kv:
        kv.register_namespace(SPEC)
        with pytest.raises(UnknownKey):  # held by no one: A's fetch says so, a miss
            kv.load(SPEC.ns_id, nobody)
        peer = kv.stats()["peer"]
        assert counts(peer) == (0, 2, 3) and peer["peers_suspect"] == 0
        assert peer["missed_chunks"] == 0  # A was asked on a guess, not on the directory's word


def test_a_namespace_a_peer_does_not_know_is_a_miss_not_a_failure(
    fleet: list[DaemonProc],
) -> None:
    """docs/cluster.md, "namespace unknown at the peer": B asks A (its one peer) for chunks of
    a namespace A has not registered: a miss, A neither failed nor suspect, so once A holds
    them B's next load fetches them byte-exact."""
    a, b, _c = fleet
    keys = make_keys(3, tag="unknown-at-peer")
    with KVClient(b.zmq_address) as kv:
        kv.register_namespace(SPEC)
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0
        with pytest.raises(UnknownKey):
            kv.load(SPEC.ns_id, keys)
        peer = kv.stats()["peer"]
        assert peer["directory_lookups"] >= 1 and peer["fetches"] >= 1, peer  # A was asked
        assert (peer["failures"], peer["timeouts"], peer["peers_suspect"]) == (0, 0, 0), peer
    with KVClient(a.zmq_address) as kv:
        kv.register_namespace(SPEC)
        assert kv.store(SPEC.ns_id, keys, [parts(k) for k in keys]) == keys
    with KVClient(b.zmq_address) as kv:
        assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
        assert kv.stats()["peer"]["condition"] == "ok"


def test_a_peers_own_request_is_answered_from_local_tiers_only(
    fleet: list[DaemonProc],
) -> None:
    """A holds a chunk. B would fetch it for its clients, but a request marked as a peer's
    (``lookup local=``, ``get leading=``) is answered from B's own tiers: fetches never chain."""
    a, b, _ = fleet
    (key,) = make_keys(1, tag="only-a")
    with KVClient(a.zmq_address, colocated=False) as kv:
        kv.register_namespace(SPEC)
        assert kv.put(SPEC.ns_id, [key], [parts(key)]).stored == [key]
    with KVClient(b.zmq_address, colocated=False) as kv:
        kv.register_namespace(SPEC)
        assert kv.lookup(SPEC.ns_id, [key], local=True).tiers == {"dram": 0}
        assert kv.get(SPEC.ns_id, [key], leading=True) == []
        assert kv.stats()["peer"]["fetches"] == 0
        assert kv.lookup(SPEC.ns_id, [key]).tiers["peer"] == 1  # its own clients see A's


def test_concurrent_loads_of_a_peer_chunk_fetch_it_once(fleet: list[DaemonProc]) -> None:
    a, b, _ = fleet
    keys = make_keys(3, tag="shared")
    with KVClient(a.zmq_address) as kv:
        kv.register_namespace(SPEC)
        kv.store(SPEC.ns_id, keys, [parts(k) for k in keys])

    def load() -> list[list[bytes]]:
        with KVClient(b.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            return rows(kv.load(SPEC.ns_id, keys))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: load(), range(4)))
    assert results == [[parts(k) for k in keys]] * 4
    with KVClient(b.zmq_address) as kv:
        peer = kv.stats()["peer"]
    assert peer["fetched_chunks"] == 3  # whatever the interleaving, fetched once


SLOW_SPEC = make_spec(part_bytes_override=12_000)  # the gated daemon's geometry


def test_a_peer_killed_mid_fetch_is_a_miss_no_hang_and_suspect(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    (tmp_path / "a").mkdir()
    a = start_gated(tmp_path / "a", gate)
    b = start_daemon(tmp_path / "b", "--dram", "8MiB", "--peers", a.zmq_address,
                     "--peer-timeout-s", TIMEOUT, "--peer-suspect-s", "60")  # fmt: skip
    try:
        keys = make_keys(60, tag="cold")
        data = {k: [pattern(k, 0, SLOW_SPEC.part_bytes)] for k in keys}
        with KVClient(a.zmq_address) as kv:
            kv.register_namespace(SLOW_SPEC)
            wait_until(lambda: kv.stats()["ssd"]["unsaved_namespaces"] == 0)
            for i in range(0, len(keys), 6):
                batch = keys[i : i + 6]
                assert kv.store(SLOW_SPEC.ns_id, batch, [data[k] for k in batch]) == batch
            wait_until(lambda: kv.stats()["ssd"]["writes_in_flight"] == 0)
            cold = [k for k in keys if kv.lookup(SLOW_SPEC.ns_id, [k]).tiers.get("ssd") == 1]
        assert len(cold) >= 2
        with (
            KVClient(b.zmq_address, colocated=False, timeout=30) as kv,
            ThreadPoolExecutor(1) as pool,
        ):
            kv.register_namespace(SLOW_SPEC)
            assert kv.lookup(SLOW_SPEC.ns_id, cold[:1]).tiers["peer"] == 1
            with gate_closed(gate) as wait_for_read:

                def load() -> list[list[bytes]]:
                    with KVClient(b.zmq_address, colocated=False, timeout=30) as other:
                        other.register_namespace(SLOW_SPEC)
                        return rows(other.load(SLOW_SPEC.ns_id, cold[:1]))

                waiting = pool.submit(load)
                wait_for_read()  # A is reading the chunk for B's fetch
                a.kill()
                start = time.monotonic()
                with pytest.raises(UnknownKey):  # a miss: nothing served, nothing wrong
                    waiting.result(timeout=30)
                assert time.monotonic() - start < float(TIMEOUT) + 2
            peer = kv.stats()["peer"]
            assert (peer["timeouts"], peer["placed_chunks"], peer["peers_suspect"]) == (1, 0, 1)
            assert peer["condition"] == "degraded" and a.zmq_address in peer["condition_detail"]
            start = time.monotonic()  # a suspect peer costs nothing: no lookup waits for it
            assert kv.lookup(SLOW_SPEC.ns_id, cold).hit_chunks == 0
            assert time.monotonic() - start < float(TIMEOUT)  # waited for no peer timeout
            m = scrape(b.metrics_url)  # the same in /metrics, by prometheus_client's parser
            assert m.value("kvserver_peer_timeouts_total") == 1
            assert m.value("kvserver_peers_suspect") == 1 and m.value("kvserver_peers_known") == 1
            assert m.value("kvserver_peer_condition", kvserver_peer_condition="degraded") == 1
            (fresh,) = make_keys(1, tag="fresh")  # and B serves its own chunks as before
            kv.store(SLOW_SPEC.ns_id, [fresh], [data[keys[0]]])
            assert rows(kv.load(SLOW_SPEC.ns_id, [fresh])) == [data[keys[0]]]
    finally:
        a.kill()
        b.kill()


def test_peers_call_each_other_over_curve_with_the_fleet_key_pair(tmp_path: Path) -> None:
    """A and B share one CURVE key pair (the fleet's): B fetches from A over CURVE; C, started
    without the key, is refused by A's handshake and misses (its call times out)."""
    public, secret = make_curve_keys(str(tmp_path / "keys"), "fleet")
    a = start_daemon(tmp_path / "a", "--dram", "8MiB", "--curve-secret-key-file", secret)
    b = start_daemon(tmp_path / "b", "--dram", "8MiB", "--curve-secret-key-file", secret,
                     "--peers", a.zmq_address, "--peer-timeout-s", TIMEOUT)  # fmt: skip
    c = start_daemon(tmp_path / "c", "--dram", "8MiB", "--peers", a.zmq_address,
                     "--peer-timeout-s", "0.5", "--peer-suspect-s", "60")  # fmt: skip
    try:
        keys = make_keys(3, tag="curve")
        curve = CurveClient.from_files(public)
        with KVClient(a.zmq_address, colocated=False, curve=curve) as kv:
            kv.register_namespace(SPEC)
            assert kv.put(SPEC.ns_id, keys, [parts(k) for k in keys]).stored == keys
        with KVClient(b.zmq_address, colocated=False, curve=curve) as kv:
            kv.register_namespace(SPEC)
            assert rows(kv.load(SPEC.ns_id, keys)) == [parts(k) for k in keys]
            assert kv.stats()["peer"]["fetched_chunks"] == 3
        with KVClient(c.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0
            with pytest.raises(UnknownKey):
                kv.load(SPEC.ns_id, keys)
            peer = kv.stats()["peer"]
            assert peer["fetched_chunks"] == 0 and peer["timeouts"] >= 1
    finally:
        for d in (a, b, c):
            d.kill()


def test_the_stream_window_is_a_size_setting_within_bounds(tmp_path: Path) -> None:
    """``peer_stream_window``: a size like ``--dram`` (flag over KVSERVER_* over the config
    file), by default the fetch's STREAM_WINDOW_BYTES; below 1 MiB, above 1 GiB or not a size,
    a clear error, and ``kvserver start`` exits 2 before any start-up work."""
    assert DaemonConfig().peer_stream_window == STREAM_WINDOW_BYTES  # one default
    config = tmp_path / "kvserver.toml"
    config.write_text('peer_stream_window = "16MiB"\n')

    def window(env: dict[str, str], **flags: object) -> int:
        loaded = DaemonConfig.load(config_file=str(config), env=env, overrides=flags)
        return loaded.peer_stream_window

    env = {"KVSERVER_PEER_STREAM_WINDOW": "4MiB"}
    assert (window({}), window(env), window(env, peer_stream_window="1GiB")) == (
        16 << 20, 4 << 20, 1 << 30)  # fmt: skip
    assert window({}, peer_stream_window=1 << 20) == 1 << 20
    bounds = "peer_stream_window must be between 1MiB and 1GiB"
    for bad in ("512KiB", (1 << 20) - 1, "1.5GiB"):
        with pytest.raises(InvalidArgument, match=bounds):
            window({}, peer_stream_window=bad)
    for bad in ("lots", "0", "-8MiB"):
        with pytest.raises(InvalidArgument, match="size"):
            window({"KVSERVER_PEER_STREAM_WINDOW": bad})
    cmd = [
        sys.executable, "-m", "kvserver.cli", "start", "--peer-stream-window", "512KiB",
        "--shm-dir", str(tmp_path), "--metrics-port", "-1",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert result.returncode == 2, result.stderr
    assert f"{bounds} (value=524288)" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["kvserver.toml"]  # no arena was created


def test_a_peer_address_with_a_port_out_of_range_is_refused_at_start() -> None:
    """``--peers tcp://HOST:99999``: a clear error at start (before: accepted, since ZMQ
    connects to it without complaint, and every fetch from that peer timed out)."""
    for bad in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://127.0.0.1"):
        with pytest.raises(InvalidArgument, match=r"tcp://HOST:PORT \(port 1-65535\)"):
            DaemonConfig.load(env={}, overrides={"peers": f"tcp://127.0.0.1:1,{bad}"})
    assert DaemonConfig.load(env={}, overrides={"peers": "tcp://h:65535"}).peer_addresses == [
        "tcp://h:65535"
    ]


def test_a_small_stream_window_setting_fetches_in_several_windows(tmp_path: Path) -> None:
    """Twelve 256 KiB chunks (2 ranks of 128 KiB) held by A are loaded through B, started
    with ``--peer-stream-window 1MiB``, and through C (the default window, 32 MiB): B asks
    them of A's stream in three windows of four chunks, C in one; both serve A's bytes."""
    spec = make_spec(model="test/window", tp_world_size=2, part_bytes_override=128 << 10)
    keys = make_keys(12, tag="window")
    data = [[pattern(k, r, spec.part_bytes) for r in range(2)] for k in keys]
    a = start_daemon(tmp_path / "a", "--dram", "8MiB")
    b = start_daemon(tmp_path / "b", "--dram", "8MiB", "--peers", a.zmq_address,
                     "--peer-stream-window", "1MiB")  # fmt: skip
    c = start_daemon(tmp_path / "c", "--dram", "8MiB", "--peers", a.zmq_address)
    try:
        with KVClient(a.zmq_address) as kv:
            kv.register_namespace(spec)
            assert kv.store(spec.ns_id, keys, data) == keys
        for daemon, windows in ((b, 3), (c, 1)):
            with KVClient(daemon.zmq_address, colocated=False) as kv:
                kv.register_namespace(spec)
                assert rows(kv.load(spec.ns_id, keys)) == data
                peer = kv.stats()["peer"]
                assert (peer["fetches"], peer["stream_fetches"]) == (windows, windows)
                assert (peer["fetched_chunks"], peer["placed_chunks"]) == (12, 12)
                assert kv.lookup(spec.ns_id, keys).tiers == {"dram": 12, "peer": 0}
    finally:
        for d in (a, b, c):
            d.kill()
