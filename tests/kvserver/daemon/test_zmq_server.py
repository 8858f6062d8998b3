"""The ZMQ data plane against the real daemon process on loopback (ephemeral ports).

Byte-exact round trips on both data paths (co-located through the mapped arena; remote as
payload frames) for TP=1 and TP=2; TP by rank over the network; zero-copy sends whose pins are
released once sent; fragmented parts; KV events on PUB in vLLM's format with replay; clients
SIGKILLed mid-store and mid-load; 16 concurrent client processes with bounded daemon memory.

Child processes run this module: ``python -m tests.kvserver.daemon.test_zmq_server ...``.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvserver import wire, wire_events
from kvserver.client import KVClient, NamespaceInfo
from kvserver.errors import KVServerError, LeaseError
from kvserver.events import Medium
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, raw_dealer, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[3]
TP_SPECS = {1: make_spec(), 2: make_spec(tp_world_size=2, model="test/tp2")}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("zmq"), "--page-size", "4KiB", "--dram", "64MiB")
    yield d
    assert d.terminate() == 0, d.log()


def parts_for(keys: list[bytes], spec: NamespaceSpec) -> list[list[bytes]]:
    return [[pattern(k, r, spec.part_bytes) for r in range(spec.tp_world_size)] for k in keys]


def idle(kv: KVClient) -> bool:
    s = kv.stats()
    return bool(s["reserved_pages"] == 0 and s["pinned_pages"] == 0 and s["num_leases"] == 0)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tp", [1, 2])
def test_colocated_round_trip_through_the_arena(daemon: DaemonProc, tp: int) -> None:
    spec, keys = TP_SPECS[tp], make_keys(5, tag=f"shm{tp}")
    expected = parts_for(keys, spec)
    with KVClient(daemon.zmq_address) as kv:
        ns = kv.register_namespace(spec)
        assert kv.is_colocated and kv.hello()["arena_path"] == daemon.arena_path
        grant = kv.prepare_store(ns.ns_id, keys, lease_s=30)
        assert grant is not None and grant.keys == keys
        for i, extents in enumerate(grant.locations):
            assert len(extents) == tp
            for rank, ext in enumerate(extents):
                kv.write(ext, expected[i][rank])
        assert kv.lookup(ns.ns_id, keys).hit_chunks == 0  # invisible until complete
        assert kv.complete_store(grant.lease_id) == keys
        assert kv.lookup(ns.ns_id, keys).hit_chunks == 5
        load = kv.prepare_load(ns.ns_id, keys)
        assert kv.stats()["pinned_pages"] > 0
        for i, extents in enumerate(load.locations):
            assert [kv.read(ext) for ext in extents] == expected[i]
        kv.complete_load(load.lease_id)
        got = kv.load(ns.ns_id, keys)  # the helper takes the same path
        assert [[bytes(p) for p in row] for row in got] == expected
        assert idle(kv)


@pytest.mark.parametrize("tp", [1, 2])
def test_remote_round_trip_as_payload_frames(daemon: DaemonProc, tp: int) -> None:
    spec, keys = TP_SPECS[tp], make_keys(5, tag=f"net{tp}")
    expected = parts_for(keys, spec)
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        ns = kv.register_namespace(spec)
        assert not kv.is_colocated
        flat_or_nested = [p[0] for p in expected] if tp == 1 else expected
        result = kv.put(ns.ns_id, keys, flat_or_nested)
        assert result.stored == keys and not result.rejected
        assert kv.put(ns.ns_id, keys[:2], flat_or_nested[:2]).present == keys[:2]
        assert [[bytes(p) for p in row] for row in kv.get(ns.ns_id, keys)] == expected
        for rank in range(tp):
            got = kv.get(ns.ns_id, keys, ranks=[rank])
            assert [bytes(row[0]) for row in got] == [p[rank] for p in expected]
        assert [[bytes(p) for p in row] for row in kv.load(ns.ns_id, keys)] == expected
        wait_until(lambda: idle(kv))


def test_tp_by_rank_over_the_network(daemon: DaemonProc) -> None:
    """A scheduler reserves and pins; each rank's worker moves only its own parts."""
    spec, keys = TP_SPECS[2], make_keys(4, tag="byrank")
    expected = parts_for(keys, spec)
    with (
        KVClient(daemon.zmq_address, colocated=False) as sched,
        KVClient(daemon.zmq_address, colocated=False) as w0,
        KVClient(daemon.zmq_address, colocated=False) as w1,
    ):
        ns = sched.register_namespace(spec)
        grant = sched.prepare_store(ns.ns_id, keys)
        assert grant is not None
        assert w0.write_parts(grant.lease_id, keys, 0, [p[0] for p in expected]) == []
        assert sched.lookup(ns.ns_id, keys).hit_chunks == 0  # rank 1 still missing
        assert w1.write_parts(grant.lease_id, keys, 1, [p[1] for p in expected]) == keys
        load = sched.prepare_load(ns.ns_id, keys)
        for rank, worker in enumerate((w0, w1)):
            got = worker.read_parts(ns.ns_id, load.lease_id, keys, rank)
            assert [bytes(v) for v in got] == [p[rank] for p in expected]
        sched.complete_load(load.lease_id)
        wait_until(lambda: idle(sched))


def test_large_parts_are_sent_zero_copy_and_unpinned_once_sent(daemon: DaemonProc) -> None:
    spec = make_spec(model="test/large", part_bytes_override=256 << 10)
    keys = make_keys(16, tag="large")
    expected = [pattern(k, 0, spec.part_bytes) for k in keys]
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        ns = kv.register_namespace(spec)
        assert kv.put(ns.ns_id, keys, expected).stored == keys
        for _ in range(3):
            assert [bytes(row[0]) for row in kv.get(ns.ns_id, keys)] == expected
        wait_until(lambda: idle(kv))
        assert kv.stats()["totals"]["loaded_chunks"] >= 48


def test_fragmented_parts_are_reassembled(tmp_path: Path) -> None:
    """Evicting every other page leaves a new part in 8 extents: sent as 8 frames, joined."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "256KiB")
    try:
        small, big = make_spec(model="test/small"), make_spec(model="test/big", chunk_blocks=8)
        with KVClient(d.zmq_address, colocated=False) as kv, KVClient(d.zmq_address) as shm:
            a, b = kv.register_namespace(small), kv.register_namespace(big)
            fill = make_keys(64, tag="fill")
            assert kv.put(a.ns_id, fill, [pattern(k, 0, a.part_bytes) for k in fill]).stored == fill
            assert kv.lookup(a.ns_id, fill[1::2], touch=True).hit_chunks == 32  # odd ones MRU
            key = make_keys(1, tag="big")
            data = pattern(key[0], 0, b.part_bytes)
            assert kv.put(b.ns_id, key, [data]).stored == key
            grant = shm.prepare_load(b.ns_id, key)
            assert len(grant.locations[0][0]) == 8  # eight one-page extents
            shm.complete_load(grant.lease_id)
            assert bytes(kv.get(b.ns_id, key)[0][0]) == data
            assert bytes(shm.load(b.ns_id, key)[0][0]) == data
    finally:
        assert d.terminate() == 0


# ----------------------------------------------------------------------------- events


def test_events_on_pub_in_vllm_format_with_replay(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "64KiB")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, wire.TOPIC_PREFIX.encode())
    sub.connect(d.pub_address)
    replay = raw_dealer(d.zmq_address, ctx=ctx)
    try:
        # over ZMQ: the put of 16 keys below is one request, so one Removed and one Stored
        # batch (over the stream it passes half this 64 KiB DRAM's stream quota: in windows)
        with KVClient(d.zmq_address, colocated=False, stream=False) as kv:
            spec = make_spec(model="test/events")
            ns = kv.register_namespace(spec)
            probes = iter(make_keys(1000, tag="probe"))

            def subscribed() -> bool:  # PUB drops until the subscription has propagated
                key = next(probes)
                kv.put(ns.ns_id, [key], [bytes(spec.part_bytes)])
                return sub.poll(50) != 0

            wait_until(subscribed)
            last = kv.stats()["events_last_seq"]
            seq = 0
            while seq < last:  # drain the probes' events (every one is numbered)
                assert sub.poll(5000)
                topic, seq_b, _ = sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
            host = socket.gethostname()
            assert topic == f"kv@{host}:{d.info['zmq_port']}/{ns.ns_id}@test/events".encode()

            keys = make_keys(16, tag="ev")  # fills the 16-page arena: evicts every probe
            assert kv.put(ns.ns_id, keys, [bytes(spec.part_bytes)] * 16).stored == keys
            received = []
            while len(received) < 2 and sub.poll(5000):
                received.append(sub.recv_multipart())
            seqs = [int.from_bytes(m[1], "big") for m in received]
            assert seqs == [last + 1, last + 2]
            batches = [wire_events.decode_batch(m[2]) for m in received]
            (removed,) = batches[0].events
            (stored,) = batches[1].events
            assert isinstance(removed, wire_events.RemovedEvent) and removed.medium == "CPU"
            assert stored == wire_events.StoredEvent(
                keys, None, [], spec.chunk_tokens, None, Medium.CPU, None
            )

            # replay is served on a connection that authenticated (docs/wire.md, Replay)
            replay.send_multipart([wire.encode_request(1, wire.HELLO, {}, auth=d.token)])
            assert replay.poll(5000) and wire.decode_reply(replay.recv_multipart()[0]).ok
            replay.send_multipart([b"", wire.seq_bytes(last + 1)])
            replayed = []
            while True:
                assert replay.poll(5000)
                _empty, seq_b, payload = replay.recv_multipart()
                if seq_b == wire.REPLAY_END_SEQ:
                    assert payload == b""
                    break
                events = wire_events.decode_batch(payload).events
                replayed.append((int.from_bytes(seq_b, "big"), events))
            assert replayed == [(last + 1, batches[0].events), (last + 2, batches[1].events)]
    finally:
        sub.close()
        replay.close()
        assert d.terminate() == 0


# ----------------------------------------------------------------------------- crashed clients


def child_hold(
    address: str, mode: str, path: str, spec_json: str, keys_hex: str, lease_s: str = "1.0"
) -> None:
    """Reserve (and half-write) or pin, say "ready", then block until killed. A lease that
    expired before the operation's second step (a loaded machine can outlast a short one) is
    taken again, twice as long: "ready" means held, mid-operation."""
    lease = float(lease_s)
    kv = KVClient(address, colocated=path == "shm")
    ns = kv.register_namespace(NamespaceSpec.from_dict(json.loads(spec_json)))
    keys = [bytes.fromhex(k) for k in keys_hex.split(",")]
    while True:
        try:
            _hold(kv, ns, keys, mode, path, lease)
            break
        except LeaseError:
            lease *= 2
    print("ready", flush=True)
    sys.stdin.read()


def _hold(
    kv: KVClient, ns: NamespaceInfo, keys: list[bytes], mode: str, path: str, lease: float
) -> None:
    if mode == "store":
        grant = kv.prepare_store(ns.ns_id, keys, lease_s=lease)
        assert grant is not None and grant.keys == keys
        part = bytes(ns.part_bytes)
        if path == "shm":
            kv.write(grant.locations[0][0], part)
        else:
            kv.write_parts(grant.lease_id, keys[:1], 0, [part], complete=False)
    else:
        load = kv.prepare_load(ns.ns_id, keys, lease_s=lease)
        if path == "shm":
            kv.read(load.locations[0][0])
        else:
            kv.read_parts(ns.ns_id, load.lease_id, keys, 0)


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.kvserver.daemon.test_zmq_server", *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("mode", ["store", "load"])
def test_client_killed_mid_operation_is_reclaimed(daemon: DaemonProc, mode: str) -> None:
    """Two clients reserve (and half-write) or pin, then are SIGKILLed: the co-located one's
    lease (600 s) is released when its local channel closes, the ZMQ one's (5 s) expires, and
    the keys are storable (store) or loadable (load) again. The ZMQ client's lease is not
    checked as held once it says "ready" (it was, in the child): a loaded machine could outlast
    it before the check, which failed so once; its expiry is counted instead."""
    spec = TP_SPECS[2]
    with KVClient(daemon.zmq_address) as kv:
        ns = kv.register_namespace(spec)
        before = kv.stats()["totals"]
        children = []
        for path, lease_s in (("shm", "600"), ("frames", "5.0")):
            keys = make_keys(3, tag=f"kill-{mode}-{path}")
            if mode == "load":
                assert kv.store(ns.ns_id, keys, parts_for(keys, spec)) == keys
            spec_json = json.dumps(spec.to_dict())
            child = spawn(
                "hold", daemon.zmq_address, mode, path, spec_json,
                ",".join(k.hex() for k in keys), lease_s,
            )  # fmt: skip
            children.append((child, keys))
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            if path == "shm":
                held = kv.stats()
                assert held["num_leases"] >= 1
                assert held["reserved_pages" if mode == "store" else "pinned_pages"] > 0
        for child, _keys in children:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            assert child.returncode == -signal.SIGKILL
            assert child.stdin is not None and child.stdout is not None
            child.stdin.close()
            child.stdout.close()
        wait_until(lambda: idle(kv), timeout=60)
        after = kv.stats()["totals"]
        assert after["expired_leases"] >= before["expired_leases"] + 1  # the ZMQ client's
        assert after["released_leases"] >= before["released_leases"] + 1  # the co-located's
        for _child, keys in children:
            if mode == "store":  # rolled back: invisible, and storable again
                assert kv.lookup(ns.ns_id, keys).hit_chunks == 0
                assert kv.store(ns.ns_id, keys, parts_for(keys, spec)) == keys
            loaded = kv.load(ns.ns_id, keys)
            assert [[bytes(p) for p in row] for row in loaded] == parts_for(keys, spec)


def test_a_local_client_killed_mid_store_and_mid_load_is_released_at_once(
    daemon: DaemonProc,
) -> None:
    """Co-located clients (local channel) reserve or pin with 600 s leases and are killed:
    the daemon releases both when their connections close, long before the leases expire."""
    spec = TP_SPECS[1]
    with KVClient(daemon.zmq_address) as kv:
        ns = kv.register_namespace(spec)
        before = kv.stats()["totals"]["expired_leases"]
        children = []
        for mode in ("store", "load"):
            keys = make_keys(3, tag=f"early-{mode}")
            if mode == "load":
                assert kv.store(ns.ns_id, keys, parts_for(keys, spec)) == keys
            args = ("hold", daemon.zmq_address, mode, "shm", json.dumps(spec.to_dict()))
            children.append(spawn(*args, ",".join(k.hex() for k in keys), "600"))
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
        held = kv.stats()
        assert held["reserved_pages"] > 0 and held["pinned_pages"] > 0
        for child in children:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            assert child.stdin is not None and child.stdout is not None
            child.stdin.close()
            child.stdout.close()
        wait_until(lambda: idle(kv), timeout=20)  # the leases had 600 s to run
        assert kv.stats()["totals"]["expired_leases"] == before  # released, not expired


# ----------------------------------------------------------------------------- many clients

NUM_CLIENTS = 16
STRESS_S = 10.0


def child_stress(address: str, index: str, seconds: str) -> None:
    """store / lookup / load / get loops on unique keys; prints {"ops", "errors"} as JSON."""
    i = int(index)
    rng = random.Random(i)
    spec = TP_SPECS[1 + i % 2]
    ops, errors = 0, []
    with KVClient(address, colocated=i % 4 < 2, timeout=60) as kv:
        ns = kv.register_namespace(spec)
        deadline = time.monotonic() + float(seconds)
        n = 0
        while time.monotonic() < deadline:
            keys = make_keys(rng.randint(1, 8), start=n, tag=f"stress{i}-")
            n += len(keys)
            expected = parts_for(keys, spec)
            try:
                assert kv.store(ns.ns_id, keys, expected) == keys
                assert kv.lookup(ns.ns_id, keys).hit_chunks == len(keys)
                got = kv.load(ns.ns_id, keys)
                assert [[bytes(p) for p in row] for row in got] == expected
                rank = rng.randrange(spec.tp_world_size)
                got = kv.get(ns.ns_id, keys[:1], ranks=[rank])
                assert bytes(got[0][0]) == expected[0][rank]
                ops += 4
            except (AssertionError, KVServerError) as exc:
                errors.append(repr(exc))
    print(json.dumps({"ops": ops, "errors": errors[:5], "num_errors": len(errors)}), flush=True)


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                out[name] = int(value.split()[0])
    return out


@pytest.mark.slow
def test_sixteen_concurrent_clients_no_errors_bounded_memory(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--dram", "128MiB")
    try:
        pid = d.info["pid"]
        with KVClient(d.zmq_address) as kv:  # warm up both namespaces and both paths
            for spec in TP_SPECS.values():
                ns = kv.register_namespace(spec)
                keys = make_keys(2, tag="warm")
                kv.store(ns.ns_id, keys, parts_for(keys, spec))
            before = memory_kib(pid)
            children = [
                spawn("stress", d.zmq_address, str(i), str(STRESS_S)) for i in range(NUM_CLIENTS)
            ]
            reports = []
            for child in children:
                out, _ = child.communicate(timeout=STRESS_S + 120)
                assert child.returncode == 0, out
                reports.append(json.loads(out))
            after = memory_kib(pid)
            assert all(r["num_errors"] == 0 for r in reports), reports
            assert all(r["ops"] > 0 for r in reports), reports
            wait_until(lambda: idle(kv))
            stats = kv.stats()
            assert stats["totals"]["stored_chunks"] > NUM_CLIENTS
        print("daemon KiB before/after:", before, after, "ops:", [r["ops"] for r in reports])
        grew_anon = after["RssAnon"] - before["RssAnon"]
        grew_rss = after["VmRSS"] - before["VmRSS"]
        # heap growth bounded (generous: allocator slack, event log); RSS may also include the
        # arena pages the daemon touched (remote puts), at most the 128 MiB DRAM tier.
        assert grew_anon < 96 << 10, (before, after)
        assert grew_rss < (128 + 96) << 10, (before, after)
        assert d.proc.poll() is None
    finally:
        assert d.terminate() == 0, d.log()[-3000:]


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        child_hold(*sys.argv[2:8])
    elif sys.argv[1] == "stress":
        child_stress(*sys.argv[2:5])
    else:
        raise SystemExit(f"unknown child {sys.argv[1]}")
