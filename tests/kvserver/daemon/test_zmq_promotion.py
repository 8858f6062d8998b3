"""SSD promotion off the receive loop, against a real daemon process on loopback.

While one client's load waits for its chunks to come up from SSD, other clients are served;
two loads of the same SSD-only chunk read it once and both get it byte-exact; the connection
that asked keeps its order (a later ``lookup``/``release`` of it runs after the load, replies
leave in request order); at most ``--ssd-promotions`` batches read at once.

"In progress" is a fault injection the real disk cannot produce: the daemon runs from this
module (``python -m tests.kvserver.daemon.test_zmq_promotion daemon GATE ...``) with every SSD
slot read (``FileIO.pread_into``, the tier's OS seam) first opening the FIFO ``GATE`` while it
exists and reading one byte or EOF. Opening its write end non-blocking succeeds exactly when a
read waits there; unlinking the FIFO and closing the write end lets every read through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvserver import wire
from kvserver.client import KVClient
from kvserver.ssd import format as fmt
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.daemon.local_conn import LocalConn
from tests.support.daemon import (
    READY_TIMEOUT_S,
    DaemonProc,
    raw_dealer,
    wait_for_ready_file,
    wait_until,
)

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[3]
SPEC = make_spec(part_bytes_override=12_000)  # 3 pages of 4 KiB; slot 16 KiB
SLOT = fmt.slot_bytes_for(12_000)


# ----------------------------------------------------------------------------- the gated daemon


def gated_daemon(gate: str, argv: list[str]) -> int:
    """Child: ``kvserver`` with every SSD slot read held at the FIFO ``gate`` while it exists."""
    from kvserver.cli import main
    from kvserver.ssd.fileio import FileIO

    read = FileIO.pread_into

    def pread_into(self: FileIO, fd: int, buf: memoryview, offset: int) -> int:
        try:
            held = os.open(gate, os.O_RDONLY)  # blocks until the test opens the write end
        except FileNotFoundError:
            pass  # no gate (any more)
        else:
            try:
                os.read(held, 1)  # a byte or EOF: the test let it through
            finally:
                os.close(held)
        return read(self, fd, buf, offset)

    FileIO.pread_into = pread_into  # type: ignore[method-assign]
    return main(argv)


def start_gated(tmp_path: Path, gate: Path, *extra: str) -> DaemonProc:
    ready = tmp_path / "ready.json"
    log_path = tmp_path / "daemon.log"
    args = [
        sys.executable, "-m", "tests.kvserver.daemon.test_zmq_promotion", "daemon", str(gate),
        "start", "--host", "127.0.0.1", "--grpc-port", "0", "--zmq-port", "0", "--pub-port",
        "-1", "--ready-file", str(ready), "--page-size", "4KiB", "--dram", "480KiB",
        "--ssd-dir", str(tmp_path / "ssd"), "--ssd", "8MiB", "--ssd-admission", "1", *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_ready_file(ready, proc, time.monotonic() + READY_TIMEOUT_S)
    except RuntimeError as exc:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"daemon {exc}:\n{log_path.read_text()}") from None
    return DaemonProc(proc, json.loads(ready.read_text()), log_path, args)


@contextmanager
def gate_closed(gate: Path) -> Iterator[Callable[[], None]]:
    """Hold every SSD read from now on; yields ``wait_for_read()``, which returns once a read
    waits at the gate. On exit every held read (and every later one) goes through."""
    os.mkfifo(gate)
    writer: list[int] = []

    def waiting_read() -> bool:
        try:
            writer.append(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: no read waits at the gate yet
            return False
        return True

    def wait_for_read() -> None:
        if not writer:
            wait_until(waiting_read)

    try:
        yield wait_for_read
    finally:
        gate.unlink()
        for fd in writer:
            os.close(fd)


# ----------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One batch reads at a time (``--ssd-promotions 1``); 80 chunks stored, most on SSD only."""
    tmp = tmp_path_factory.mktemp("promo")
    d = start_gated(tmp, tmp / "gate", "--ssd-promotions", "1")
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = kv.register_namespace(SPEC).ns_id
            wait_until(lambda: ssd(kv)["unsaved_namespaces"] == 0)
            keys = make_keys(80, tag="promo")
            for i in range(0, len(keys), 8):
                batch = keys[i : i + 8]
                assert kv.store(ns_id, batch, [expected(k) for k in batch]) == batch
            wait_until(lambda: ssd(kv)["writes_in_flight"] == 0)
        yield d
    finally:
        assert d.terminate() == 0, d.log()


@pytest.fixture
def gate(daemon: DaemonProc) -> Path:
    return Path(daemon.args[daemon.args.index("daemon") + 1])


def expected(key: bytes) -> list[bytes]:
    return [pattern(key, 0, SPEC.part_bytes)]


def ssd(kv: KVClient) -> dict[str, Any]:
    stats: dict[str, Any] = kv.stats()["ssd"]
    return stats


def cold_keys(kv: KVClient, n: int) -> list[bytes]:
    """``n`` stored keys that are on SSD only (promoted ones are in DRAM and are skipped)."""
    out = []
    for key in make_keys(80, tag="promo"):
        if kv.lookup(SPEC.ns_id, [key]).tiers.get("ssd") == 1:
            out.append(key)
            if len(out) == n:
                return out
    raise AssertionError(f"fewer than {n} chunks on SSD only")


def load_in_thread(
    pool: ThreadPoolExecutor, d: DaemonProc, keys: list[bytes], *, colocated: bool
) -> Future[list[list[bytes]]]:
    """``load`` on a client of its own (shared memory: prepare_load; remote: get)."""

    def run() -> list[list[bytes]]:
        with KVClient(d.zmq_address, colocated=colocated, timeout=60) as kv:
            kv.register_namespace(SPEC)
            assert kv.is_colocated is colocated
            return [[bytes(p) for p in row] for row in kv.load(SPEC.ns_id, keys)]

    return pool.submit(run)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("colocated", [True, False], ids=["shared-memory", "remote"])
def test_other_clients_are_served_while_a_promotion_reads(
    daemon: DaemonProc, gate: Path, colocated: bool
) -> None:
    """A load waits for its chunk's SSD read (held at the gate); another client meanwhile looks
    up, stores, loads and reads stats; once the read goes through the load is byte-exact."""
    with KVClient(daemon.zmq_address) as other, ThreadPoolExecutor(1) as pool:
        other.register_namespace(SPEC)
        (cold,) = cold_keys(other, 1)
        before = ssd(other)
        with gate_closed(gate) as wait_for_read:
            waiting = load_in_thread(pool, daemon, [cold], colocated=colocated)
            wait_for_read()
            fresh = make_keys(4, tag=f"other-{colocated}")
            assert other.store(SPEC.ns_id, fresh, [expected(k) for k in fresh]) == fresh
            assert other.lookup(SPEC.ns_id, fresh).tiers["dram"] == 4
            got = other.load(SPEC.ns_id, fresh)
            assert [[bytes(p) for p in row] for row in got] == [expected(k) for k in fresh]
            assert ssd(other)["promoting_chunks"] == 1
            assert not waiting.done()  # its read is still held at the gate
        assert waiting.result(timeout=60) == [expected(cold)]
        after = ssd(other)
        assert after["promoted_chunks"] == before["promoted_chunks"] + 1
        assert after["promoting_chunks"] == 0
        assert other.lookup(SPEC.ns_id, [cold]).tiers["dram"] == 1


@pytest.mark.parametrize(
    "first, second",
    [(True, True), (False, False), (True, False)],
    ids=["shared-memory+shared-memory", "remote+remote", "shared-memory+remote"],
)
def test_two_loads_of_one_ssd_chunk_read_it_once(
    daemon: DaemonProc, gate: Path, first: bool, second: bool
) -> None:
    """The second load of a chunk whose promotion is under way joins it: one SSD read, one
    promotion, both loads byte-exact."""
    with KVClient(daemon.zmq_address) as watcher, ThreadPoolExecutor(2) as pool:
        watcher.register_namespace(SPEC)
        (cold,) = cold_keys(watcher, 1)
        before = ssd(watcher)
        with gate_closed(gate) as wait_for_read:
            one = load_in_thread(pool, daemon, [cold], colocated=first)
            wait_for_read()
            two = load_in_thread(pool, daemon, [cold], colocated=second)
            joined = before["joined_promotion_chunks"] + 1
            wait_until(lambda: ssd(watcher)["joined_promotion_chunks"] == joined)
            assert not one.done() and not two.done()
        assert one.result(timeout=60) == [expected(cold)]
        assert two.result(timeout=60) == [expected(cold)]
        after = ssd(watcher)
        assert after["loaded_chunks"] == before["loaded_chunks"] + 1  # one slot read
        assert after["promoted_chunks"] == before["promoted_chunks"] + 1
        assert after["served_direct_chunks"] == before["served_direct_chunks"]
        wait_until(lambda: watcher.stats()["num_leases"] == 0)  # both loads let go


@pytest.mark.parametrize("transport", ["zmq", "local"])
def test_a_connection_keeps_its_order_behind_its_promotion(
    daemon: DaemonProc, gate: Path, transport: str
) -> None:
    """prepare_load (promoting), then lookup and release pipelined on the same connection (a
    DEALER, or a connection of the local channel): another client is served meanwhile; the
    replies come back in request order, the lookup sees the chunk in DRAM and the release
    releases the load's lease (neither overtook)."""
    ctx = zmq.Context()
    conn: Any
    if transport == "local":
        with KVClient(daemon.zmq_address) as kv:
            conn = LocalConn(str(kv.hello()["local_path"]), timeout=60)
    else:
        conn = raw_dealer(daemon.zmq_address, ctx=ctx)
        conn.setsockopt(zmq.RCVTIMEO, 60_000)
    try:
        with KVClient(daemon.zmq_address) as other:
            other.register_namespace(SPEC)
            (cold,) = cold_keys(other, 1)
            ns, keys = SPEC.ns_id, [cold]
            with gate_closed(gate) as wait_for_read:
                for req_id, op, args in (
                    (1, wire.PREPARE_LOAD, {"ns_id": ns, "keys": keys}),
                    (2, wire.LOOKUP, {"ns_id": ns, "keys": keys}),
                    (3, wire.RELEASE, {}),
                ):
                    frame = wire.encode_request(
                        req_id, op, args, auth=daemon.token, client="ordered"
                    )
                    conn.send_multipart([frame])
                wait_for_read()
                assert other.lookup(ns, keys).tiers["ssd"] == 1  # served; still on SSD only
                assert not conn.poll(0)  # nothing answered while the read is held
            replies = [wire.decode_reply(conn.recv_multipart()[0]) for _ in range(3)]
        assert [r.req_id for r in replies] == [1, 2, 3]
        assert all(r.ok for r in replies), [r.error for r in replies]
        assert replies[0].result["grant"]["keys"] == keys
        assert replies[1].result["tiers"] == {"dram": 1, "ssd": 0}
        assert replies[2].result["released"] == 1
    finally:
        conn.close()
        ctx.term()


def test_promotions_beyond_the_limit_wait_for_a_slot(daemon: DaemonProc, gate: Path) -> None:
    """With --ssd-promotions 1, a second load of another SSD chunk claims it but does not read
    (its slot is not even pinned) until the first promotion is done; then both are exact."""
    with KVClient(daemon.zmq_address) as watcher, ThreadPoolExecutor(2) as pool:
        watcher.register_namespace(SPEC)
        a, b = cold_keys(watcher, 2)
        with gate_closed(gate) as wait_for_read:
            one = load_in_thread(pool, daemon, [a], colocated=False)
            wait_for_read()
            two = load_in_thread(pool, daemon, [b], colocated=True)
            # the second batch claims its key and, were a slot free, would pin its SSD entry in
            # the same step: when the claim shows, only the first batch's entry is pinned
            stats = wait_until(lambda: (s := ssd(watcher))["promoting_chunks"] == 2 and s)
            assert stats["pinned_bytes"] == SLOT
        assert one.result(timeout=60) == [expected(a)]
        assert two.result(timeout=60) == [expected(b)]
        assert ssd(watcher)["promoting_chunks"] == 0


if __name__ == "__main__":
    if sys.argv[1] == "daemon":
        raise SystemExit(gated_daemon(sys.argv[2], sys.argv[3:]))
    raise SystemExit(f"unknown child {sys.argv[1]}")
