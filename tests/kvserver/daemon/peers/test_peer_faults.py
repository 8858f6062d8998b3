"""The network tier's contract under faults, in real daemons: nothing wrong is served, nothing
hangs, nothing leaks.

A holds the chunks; B (``--peers A``) fetches them for its clients, over A's peer stream or
over ZMQ (``--peer-stream-port -1`` on B: it neither opens nor dials a stream, as a fleet with
CURVE). A peer that stalls is a real daemon SIGSTOPped (its sockets stay open, nothing comes).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.errors import KVServerError, UnknownKey
from tests.kvserver.builders import make_engine, make_keys, make_spec, pattern
from tests.kvserver.daemon.test_ssd_daemon import ENV as SSD_ENV
from tests.kvserver.daemon.test_ssd_daemon import SLOT, expected, on_ssd_only, registered, settled
from tests.kvserver.daemon.test_ssd_daemon import SPEC as SSD_SPEC
from tests.kvserver.daemon.test_ssd_daemon import args as ssd_args
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.metrics import scrape

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20
SPEC = make_spec(model="test/peer-faults", part_bytes_override=MiB)
KEYS = make_keys(24, tag="faults")


@pytest.fixture(params=["stream", "zmq"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[DaemonProc]:
    a = start_daemon(tmp_path / "a", "--dram", "64MiB")
    try:
        with KVClient(a.zmq_address, colocated=False, timeout=30) as kv:
            kv.register_namespace(SPEC)
            for i in range(0, len(KEYS), 8):
                run = KEYS[i : i + 8]
                assert kv.put(SPEC.ns_id, run, [pattern(k, 0, MiB) for k in run]).stored == run
        yield a
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
        a.kill()


def fetcher(tmp_path: Path, a: DaemonProc, transport: str, timeout_s: str) -> DaemonProc:
    zmq_only = ("--peer-stream-port", "-1") if transport == "zmq" else ()
    return start_daemon(tmp_path / "b", "--dram", "64MiB", "--peers", a.zmq_address,
                        "--peer-timeout-s", timeout_s, *zmq_only)  # fmt: skip


def test_overlapping_loads_fetch_each_chunk_once_and_leave_nothing_held(
    tmp_path: Path, holder: DaemonProc, transport: str
) -> None:
    """Two clients of B load overlapping runs (keys 0-15 and 8-23) at once, each twice:
    every chunk is fetched from A once whatever the interleaving, each client gets A's bytes,
    and afterwards B holds no reservation, lease or fetch in flight."""
    b = fetcher(tmp_path, holder, transport, "10")
    try:

        def load(keys: list[bytes]) -> list[bytes]:
            with KVClient(b.zmq_address, colocated=False, timeout=30) as kv:
                kv.register_namespace(SPEC)
                return [bytes(row[0]) for row in kv.load(SPEC.ns_id, keys)]

        runs = [KEYS[:16], KEYS[8:], KEYS[:16], KEYS[8:]]
        with ThreadPoolExecutor(len(runs)) as pool:
            got = list(pool.map(load, runs))
        assert got == [[pattern(k, 0, MiB) for k in run] for run in runs]
        with KVClient(b.zmq_address, colocated=False) as kv:
            stats = kv.stats()
        peer = stats["peer"]
        assert peer["fetched_chunks"] == len(KEYS) == peer["placed_chunks"]
        assert peer["fetching_chunks"] == 0 and peer["refused_windows"] == 0
        assert (stats["reserved_pages"], stats["pinned_pages"], stats["num_leases"]) == (0, 0, 0)
        m = scrape(b.metrics_url)
        assert m.value("kvserver_peer_fetched_chunks_total") == len(KEYS)
        assert m.value("kvserver_peer_refused_windows_total") == 0
    finally:
        b.kill()


def test_a_fetcher_stopped_while_its_peer_stalls_mid_fetch_exits_at_once(
    tmp_path: Path, holder: DaemonProc, transport: str
) -> None:
    """B is fetching for a client from A, which has stopped answering (SIGSTOP); B gets
    SIGTERM: its ordered shutdown cancels the fetch (not waiting out the 30 s peer timeout),
    the client's load fails cleanly, and B exits 0 with its arena removed."""
    b = fetcher(tmp_path, holder, transport, "30")
    try:
        with KVClient(b.zmq_address, colocated=False, timeout=60) as kv:
            kv.register_namespace(SPEC)
            assert len(kv.get(SPEC.ns_id, KEYS[:1])) == 1  # B's link to A is up
            os.kill(holder.proc.pid, signal.SIGSTOP)
            failed: list[BaseException] = []

            def load() -> None:
                try:
                    kv.get(SPEC.ns_id, KEYS[1:])
                except KVServerError as exc:
                    failed.append(exc)

            waiting = threading.Thread(target=load)
            waiting.start()
            wait_until(lambda: kv_fetching(b) or not waiting.is_alive(), timeout=10)
            assert waiting.is_alive()  # the load waits on the fetch
            start = time.monotonic()
            b.proc.send_signal(signal.SIGTERM)
            assert b.proc.wait(20) == 0
            assert time.monotonic() - start < 5.0
            waiting.join(20)
            assert not waiting.is_alive() and len(failed) == 1
        assert not Path(b.info["arena_path"]).exists()
    finally:
        b.kill()


def kv_fetching(b: DaemonProc) -> bool:
    """B has a fetch under way (keys claimed by it)."""
    with KVClient(b.zmq_address, colocated=False) as kv:
        return int(kv.stats()["peer"]["fetching_chunks"]) > 0


async def test_a_peer_too_busy_to_serve_a_window_is_not_suspect(
    tmp_path: Path, transport: str
) -> None:
    """A is busy: its DRAM is fully pinned by a client's load and its SSD read buffers allow
    6 chunks, so it answers a window of 8 SSD-only chunks ``capacity`` (retry later), as it
    would any client's ``get``. B (the tier's classes over a real engine) leaves that window
    to another holder, else a miss, but A is not suspect for being busy: B's next fetch, of
    4 of those chunks, asks A and places them byte for byte. Over the stream the refusal was
    taken for a fault (a failure, A suspect for suspect_s: the next fetch asked nobody)."""
    env = {**SSD_ENV, "KVSERVER_SSD_STAGING": str(6 * SLOT)}
    a = start_daemon(tmp_path / "a", *ssd_args(tmp_path / "ssd"), env=env)
    try:
        with KVClient(a.zmq_address) as kv:
            ns_id = registered(kv, SSD_SPEC)
            keys = make_keys(80, tag="busy")
            for i in range(0, len(keys), 4):  # 4 victims at most per store: staging holds 6
                batch = keys[i : i + 4]
                assert kv.store(ns_id, batch, [expected(SSD_SPEC, k) for k in batch]) == batch
                settled(kv)
            cold = on_ssd_only(kv, ns_id, keys)
            assert len(cold) >= 8
            hot = [k for k in keys if kv.lookup(ns_id, [k]).tiers["dram"] == 1]
            grant = kv.prepare_load(ns_id, hot)  # every DRAM page pinned: nothing can move in
            try:
                with make_engine(num_pages=64) as engine:
                    engine.register_namespace(SSD_SPEC)
                    book = PeerBook(PeerSettings(stream=transport == "stream", timeout_s=5,
                                                 suspect_s=60))  # fmt: skip
                    fetches = PeerFetches(engine, book, publish=lambda: None)
                    peer = {"A": Peer("A", "", a.zmq_address)}
                    await fetches.fetch(SSD_SPEC, [(k, frozenset({"A"})) for k in cold[:8]], peer)
                    assert engine.lookup(ns_id, cold[:8]) == 0
                    assert not book.is_suspect("A")
                    c = book.counters
                    assert (c.failures, c.timeouts, c.missed_chunks) == (0, 0, 8)
                    assert c.refused_windows == 0  # not the cap on unsent replies
                    await fetches.fetch(SSD_SPEC, [(k, frozenset({"A"})) for k in cold[:4]], peer)
                    got = engine.prepare_load(ns_id, cold[:4])
                    held = [[b"".join(engine.read_part(got.lease_id, k, 0))] for k in cold[:4]]
                    engine.complete_load(got.lease_id)
                    assert held == [expected(SSD_SPEC, k) for k in cold[:4]]
                    engine.check_invariants()
                    await book.close()
            finally:
                kv.complete_load(grant.lease_id)
    finally:
        a.kill()


def test_while_a_peer_stalls_mid_fetch_other_clients_are_served_and_the_load_ends(
    tmp_path: Path, holder: DaemonProc, transport: str
) -> None:
    """A stops answering (SIGSTOP) while B fetches for one client: another client of B stores
    and loads chunks of its own meanwhile, byte for byte, both calls within 2 s (B's loop is
    not held by the fetch: held, they would end with it, 3 s after it began), and the
    waiting load ends at the peer timeout (3 s) with the chunks missing, not a hang; A is
    suspect."""
    b = fetcher(tmp_path, holder, transport, "3")
    try:
        with KVClient(b.zmq_address, colocated=False, timeout=30) as kv:
            kv.register_namespace(SPEC)
            assert len(kv.get(SPEC.ns_id, KEYS[:1])) == 1  # B's link to A is up
            os.kill(holder.proc.pid, signal.SIGSTOP)
            result: list[object] = []

            def load() -> None:
                start = time.monotonic()
                try:
                    result.append(len(kv.get(SPEC.ns_id, KEYS[1:])))
                except KVServerError as exc:
                    result.append(exc)
                result.append(time.monotonic() - start)

            waiting = threading.Thread(target=load)
            waiting.start()
            wait_until(lambda: kv_fetching(b) or not waiting.is_alive(), timeout=10)
            assert waiting.is_alive()
            own = make_keys(4, tag="own")
            data = [pattern(k, 1, MiB) for k in own]
            with KVClient(b.zmq_address, colocated=False, timeout=30) as other:
                other.register_namespace(SPEC)
                start = time.monotonic()
                assert other.put(SPEC.ns_id, own, data).stored == own
                got = [bytes(r[0]) for r in other.get(SPEC.ns_id, own)]
                assert time.monotonic() - start < 2.0
                assert got == data
            assert waiting.is_alive()  # still waiting on A meanwhile
            waiting.join(15)
            assert not waiting.is_alive()
            outcome, took = result
            assert isinstance(outcome, UnknownKey)  # a miss: nothing served for them
            assert isinstance(took, float) and took < 3.0 + 2.0
            assert kv.stats()["peer"]["peers_suspect"] == 1
    finally:
        b.kill()
