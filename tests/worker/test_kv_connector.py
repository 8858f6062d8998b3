"""The worker connector against a real daemon and the real scheduler-side connector.

Each cluster has one worker connector per TP rank with CPU tensors as its "GPU" KV caches; the
fake model writes a block's KV (derived from its hash and the rank) when its tokens are
computed. Stored parts are checked in the daemon, loads by comparing block bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvserver.client import KVClient  # noqa: E402
from kvserver.errors import InvalidArgument  # noqa: E402
from step_protocol import ConnectorMetadata  # noqa: E402
from tests.support.daemon import DaemonProc, start_daemon, wait_until  # noqa: E402
from tests.support.gate import Gate  # noqa: E402
from tests.worker.builders import (  # noqa: E402
    BS,
    NUM_BLOCKS,
    Cluster,
    FakeRequest,
    kv_bytes,
    kv_caches,
    make_spec,
    tokens,
    write_block,
)
from worker.config import WorkerConnectorConfig  # noqa: E402
from worker.kv_connector import KVServerWorkerConnector  # noqa: E402
from worker.transfer import Direction  # noqa: E402

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("worker"), "--page-size", "4KiB", "--dram", "8MiB")
    yield d
    d.terminate()


@pytest.fixture
def make_cluster(daemon: DaemonProc, request: pytest.FixtureRequest) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(
        tp: int = 1, colocated: bool = True, layout: str = "flash", spec: Any = None
    ) -> Cluster:
        spec = spec or make_spec(f"test/{request.node.name}", tp=tp)
        made.append(Cluster(daemon.zmq_address, spec, layout=layout, colocated=colocated))
        return made[-1]

    yield make
    for c in made:
        c.close()


def stored_parts(daemon: DaemonProc, req: FakeRequest) -> list[list[bytes]]:
    """Every rank's part of every chunk of ``req`` in the daemon (asked by another client)."""
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        kv.register_namespace(req.spec)
        ranks = list(range(req.spec.tp_world_size))
        got = kv.get(req.spec.ns_id, req.chunk_keys(), ranks=ranks)
        return [[bytes(p) for p in row] for row in got]


def ready_chunks(daemon: DaemonProc, req: FakeRequest) -> int:
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        kv.register_namespace(req.spec)
        return kv.lookup(req.spec.ns_id, req.chunk_keys()).hit_chunks


def expected_part(req: FakeRequest, chunk: int, rank: int, block_bytes: int) -> bytes:
    cb = req.spec.chunk_blocks
    hashes = req.block_hashes[chunk * cb : (chunk + 1) * cb]
    return b"".join(kv_bytes(h, rank, block_bytes) for h in hashes)


# ----------------------------------------------------------------------------- data paths


@pytest.mark.parametrize("colocated", [True, False], ids=["shm", "remote"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_store_then_load_into_other_blocks(
    make_cluster: Any, daemon: DaemonProc, tp: int, colocated: bool
) -> None:
    """A computed prompt is stored, each rank writing its own part; a request sharing three
    chunks loads exactly those bytes into different blocks on every rank."""
    c = make_cluster(tp=tp, colocated=colocated)
    assert all(w.conn.is_colocated is colocated for w in c.workers)
    a = FakeRequest("a", tokens(33), c.spec)
    c.prefill(a)
    parts = stored_parts(daemon, a)
    bb = c.workers[0].caches.block_bytes
    assert parts == [[expected_part(a, i, r, bb) for r in range(tp)] for i in range(4)]
    b = FakeRequest("b", tokens(24) + [999] * 9, c.spec)
    assert c.admit(b) == (24, True)
    assert set(c.blocks["b"]).isdisjoint(c.blocks["a"])
    _, report = c.step()
    report.finished_recving |= c.settle().finished_recving
    assert report.finished_recving == {"b"} and not report.load_errors
    c.assert_same_kv(b, range(6))
    assert all(w.conn.num_pending == 0 for w in c.workers)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_colocated_cpu_load_is_reported_by_the_step_that_shipped_it(
    make_cluster: Any, tp: int
) -> None:
    """CPU caches with the arena mapped: start_load_kv finishes its loads, so the same step's
    report has them (no waiting, no extra steps) and the request can run in the next one."""
    c = make_cluster(tp=tp)
    c.prefill(FakeRequest("a", tokens(33), c.spec))
    b = FakeRequest("b", tokens(33), c.spec)
    assert c.admit(b) == (32, True)
    # Each worker's load thread is held for a while first: start_load_kv must outwait it
    # (without the wait, the check right after it finds the loads still queued).
    gates = [Gate(w.conn, Direction.LOAD) for w in c.workers]
    timers = [threading.Timer(0.3, g.open) for g in gates]
    for t in timers:
        t.start()
    landed: list[bool] = []

    def loads_landed() -> None:  # right after every worker's start_load_kv
        for w in c.workers:
            queue = w.conn.engine._inflight[Direction.LOAD]
            landed.append(bool(queue) and all(t.done for t in queue))

    _, report = c.step(before_forward=loads_landed)
    for t in timers:
        t.join()
    assert landed == [True] * tp
    assert report.finished_recving == {"b"} and not report.load_errors
    c.assert_same_kv(b, range(8))


def test_different_layouts_share_parts(make_cluster: Any) -> None:
    """Stored by FlashAttention-layout workers, loaded by cross-layer-layout ones: same bytes."""
    flash = make_cluster(layout="flash")
    cross = make_cluster(layout="cross", spec=flash.spec)
    a = FakeRequest("a", tokens(17), flash.spec)
    flash.prefill(a)
    b = FakeRequest("b", tokens(17), flash.spec)
    assert cross.admit(b) == (16, True)
    assert cross.step(sync=True)[1].finished_recving == {"b"}
    cross.assert_same_kv(b, range(4))


def test_partial_first_chunk_leaves_local_blocks_untouched(make_cluster: Any) -> None:
    """3 blocks are a local GPU hit; chunk 1 (blocks 2-3) is loaded into block 3 only."""
    c = make_cluster(tp=2)
    c.prefill(FakeRequest("a", tokens(33), c.spec))
    b = FakeRequest("b", tokens(33), c.spec)
    local = c.alloc(3)
    sentinel = b"\x5a" * c.workers[0].caches.block_bytes
    for w in c.workers:
        for blk in local:
            write_block(w.caches, blk, sentinel)
    assert c.admit(b, num_local=3 * BS, blocks=local) == (32 - 3 * BS, True)
    meta, report = c.step(sync=True)
    assert meta.loads[0].loads[0].skip_blocks == 1
    assert report.finished_recving == {"b"}
    assert all(w.block(blk) == sentinel for w in c.workers for blk in local)
    c.assert_same_kv(b, range(3, 8))


# ----------------------------------------------------------------------------- step protocol


def test_stores_are_deferred_to_the_next_steps_start(make_cluster: Any, daemon: DaemonProc) -> None:
    """wait_for_save only queues; the next start_load_kv submits; the copied chunks become
    ready only once the scheduler completes the lease (workers never complete): the completion
    the workers' report hands it is held and goes out with a later step's plan (carried on its
    prepare_store, or alone at the end of the ``completion_hold_steps``-th: docs/connector.md)."""
    c = make_cluster()
    w = c.workers[0]
    r = FakeRequest("r", tokens(17), c.spec)
    assert c.admit(r) == (0, False)
    c.step({"r": (r, 16)}, sync=True)  # computes; the scheduler reserves 2 chunks
    meta, report = c.step(sync=True)  # ships the stores: deferred by the worker
    assert [len(t.stores) for t in meta.stores] == [2]
    assert w.conn.num_pending == 1 and w.conn.engine is not None
    assert w.conn.engine.num_inflight == 0 and not report.finished_sending
    meta = c.plan()
    w.conn.bind_connector_metadata(meta)
    w.conn.start_load_kv()  # submits the deferred store
    assert w.conn.engine.num_inflight == 1
    w.conn.wait_inflight()
    w.conn.wait_for_save()
    out = w.conn.build_connector_worker_meta()
    assert [s.req_id for s in out.stores] == ["r"] and not out.stores[0].failed_keys
    assert ready_chunks(daemon, r) == 0  # copied, not completed
    c.conn.update_connector_output([out])
    assert ready_chunks(daemon, r) == 0  # held for a later step's plan
    hold = c.conn.config.completion_hold_steps
    for _ in range(hold - 1):  # no reservation to carry it: held up to `hold` plans
        c.plan()
        assert ready_chunks(daemon, r) == 0
    c.plan()  # then sent alone at the end of the hold-th
    assert ready_chunks(daemon, r) == 2


def test_a_steps_stores_of_many_requests_run_as_one_group(
    make_cluster: Any, daemon: DaemonProc
) -> None:
    """The stores a step ships for several requests (one lease each) reach the engine
    together and run as one group of copies (decode stores one chunk per request per step);
    every request's bytes land in its own chunks."""
    c = make_cluster()
    w = c.workers[0]
    reqs = [FakeRequest(f"r{i}", tokens(17, base=1000 * i), c.spec) for i in range(4)]
    for r in reqs:
        assert c.admit(r) == (0, False)
    c.step({r.request_id: (r, 16) for r in reqs}, sync=True)  # computes; reserves
    meta, _ = c.step(sync=True)  # ships the stores, one lease per request: deferred
    assert sorted(t.req_id for t in meta.stores) == [r.request_id for r in reqs]
    engine = w.conn.engine
    assert engine is not None and engine.stats.groups["store"] == 0
    w.conn.bind_connector_metadata(c.plan())
    w.conn.start_load_kv()  # submits the deferred stores together
    w.conn.wait_inflight()
    w.conn.wait_for_save()
    out = w.conn.build_connector_worker_meta()
    assert sorted(s.req_id for s in out.stores) == [r.request_id for r in reqs]
    assert not any(s.failed_keys for s in out.stores)
    assert engine.stats.groups["store"] == 1
    assert engine.stats.grouped_transfers["store"] == len(reqs)
    c.conn.update_connector_output([out])
    for _ in range(c.conn.config.completion_hold_steps):
        c.plan()
    block_bytes = w.caches.block_bytes
    for r in reqs:
        parts = stored_parts(daemon, r)
        assert len(parts) == len(r.chunk_keys()) > 0
        for chunk, row in enumerate(parts):
            assert row == [expected_part(r, chunk, 0, block_bytes)]


def test_get_finished_never_blocks(make_cluster: Any) -> None:
    """With the store direction held, get_finished and the report return at once and empty;
    once released, the store is reported exactly once and the request is finished sending."""
    c = make_cluster()
    w = c.workers[0]
    r = FakeRequest("r", tokens(17), c.spec)
    c.admit(r)
    c.step({"r": (r, 16)})
    c.step()  # stores shipped, deferred
    gate = Gate(w.conn, Direction.STORE)
    w.conn.bind_connector_metadata(c.plan())
    w.conn.start_load_kv()
    w.conn.wait_for_save()
    assert w.conn.get_finished() == (set(), set())
    assert w.conn.build_connector_worker_meta().stores == []
    gate.open()
    w.conn.wait_inflight()
    assert w.conn.get_finished() == ({"r"}, set())
    assert [s.req_id for s in w.conn.build_connector_worker_meta().stores] == ["r"]
    assert w.conn.get_finished() == (set(), set())


@pytest.mark.parametrize("when", ["same_step", "next_step"])
def test_preemption_barrier_finishes_stores_before_blocks_are_reused(
    make_cluster: Any, daemon: DaemonProc, when: str
) -> None:
    """r is preempted while its stores are shipped in this step's metadata (same_step) or
    deferred from the last one (next_step); its blocks go to s, whose forward pass overwrites
    them in this very step. start_load_kv returns only after r's stores have read the blocks
    (the barrier waited on a store still held in the engine), so the daemon holds r's KV."""
    c = make_cluster()
    w = c.workers[0]
    r = FakeRequest("r", tokens(17), c.spec)
    c.admit(r)
    c.step({"r": (r, 16)})
    if when == "next_step":
        meta, _ = c.step()
        assert meta.stores and w.conn.num_pending == 1
    gate = Gate(w.conn, Direction.STORE)
    seen: list[list[tuple[Any, bool]]] = []
    assert w.conn.engine is not None
    wait = w.conn.engine.wait

    def barrier(transfers: Any) -> None:
        transfers = list(transfers)
        seen.append([(t.tag, bool(t.done)) for t in transfers])
        gate.open()
        wait(transfers)

    w.conn.engine.wait = barrier  # type: ignore[method-assign]
    freed = c.blocks.pop("r")
    r.num_computed_tokens = 0
    s = FakeRequest("s", tokens(17, base=7000), c.spec)
    assert c.admit(s, blocks=freed) == (0, False)
    meta, _ = c.step({"s": (s, 16)}, preempted=("r",))
    assert meta.flush_req_ids == ["r"]
    assert [[(tag[:2], done) for tag, done in call] for call in seen] == [[((False, "r"), False)]]
    w.conn.engine.wait = wait  # type: ignore[method-assign]
    c.settle()
    bb = w.caches.block_bytes
    assert stored_parts(daemon, r) == [[expected_part(r, i, 0, bb)] for i in range(2)]


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "colocated, how",
    [(True, "block_ids"), (True, "extents"), (False, "block_ids")],
    ids=["shm-block_ids", "shm-extents", "remote-block_ids"],
)
def test_a_failed_load_is_reported(make_cluster: Any, colocated: bool, how: str) -> None:
    """The last rank cannot copy chunk 2 (a bad block id, or extents outside the arena): it
    reports the key failed, the other chunks land, and the scheduler is told to recompute from
    chunk 2 and not to trust its blocks."""
    c = make_cluster(tp=2, colocated=colocated)
    a = FakeRequest("a", tokens(33), c.spec)
    c.prefill(a)
    b = FakeRequest("b", tokens(33), c.spec)
    assert c.admit(b) == (32, True)

    def tamper(rank: int, meta: ConnectorMetadata) -> None:
        if rank == 1 and meta.loads:
            load = meta.loads[0].loads[2]
            if how == "block_ids":
                load.block_ids = [NUM_BLOCKS + 1, 0]
            else:
                load.extents[rank] = [(1 << 40, c.spec.part_bytes)]

    _, report = c.step(tamper=tamper, sync=True)
    assert report.finished_recving == {"b"}
    assert report.load_errors == {"b": 2 * c.spec.chunk_tokens}
    assert report.invalid_block_ids == set(c.blocks["b"][4:6])
    c.assert_same_kv(b, range(4))


def test_remote_store_to_an_unknown_lease_fails_its_keys(make_cluster: Any) -> None:
    """write_parts refused by the daemon (a lease it does not know): every key of the lease is
    reported failed and the scheduler rolls the chunks back."""
    c = make_cluster(colocated=False)
    r = FakeRequest("r", tokens(17), c.spec)
    c.admit(r)
    c.step({"r": (r, 16)})
    c.step()  # shipped, deferred
    w = c.workers[0]
    t = w.conn._deferred[0]
    lease, t.lease_id = t.lease_id, 1 << 60
    w.conn.drain()
    out = w.conn.build_connector_worker_meta()
    assert [(s.lease_id, sorted(s.failed_keys)) for s in out.stores] == [
        (1 << 60, sorted(r.chunk_keys()))
    ]
    t.lease_id = lease


def test_a_colocated_load_whose_lease_ran_out_before_its_copy_copies_nothing(
    make_cluster: Any,
) -> None:
    """The scheduler ships each load with the time its lease has left; a co-located worker
    that gets to the copy only after that much time (none left on arrival, as after a stall)
    fails the load without copying (the daemon may have handed the pages on, after a
    quarantine): its blocks are reported invalid and recomputed. Was: loads carried no
    deadline and were copied regardless, reported good."""
    c = make_cluster()
    w = c.workers[0]
    c.prefill(FakeRequest("a", tokens(33), c.spec))
    b = FakeRequest("b", tokens(33), c.spec)
    assert c.admit(b) == (32, True)
    shipped: list[float | None] = []

    def no_time_left(rank: int, meta: ConnectorMetadata) -> None:
        for t in meta.loads:
            shipped.append(t.expires_in_s)
            t.expires_in_s = 0.0

    before = [w.block(blk) for blk in c.blocks["b"]]
    _, report = c.step(tamper=no_time_left, sync=True)
    assert shipped and all(s is not None and s > 0 for s in shipped)  # stamped when shipped
    assert report.finished_recving == {"b"}
    assert report.load_errors == {"b": 0}  # recomputed from its first token
    assert report.invalid_block_ids == set(c.blocks["b"][:8])  # the 32 tokens it loads
    assert [w.block(blk) for blk in c.blocks["b"]] == before, "copied out of an expired lease"
    assert w.conn.deadlines.expired_loads == 1


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_a_colocated_load_that_lands_after_its_deadline_fails(make_cluster: Any, tp: int) -> None:
    """A co-located load starts in time but its copies land only after its lease deadline
    (the load thread stalled: held by a gate until the deadline has passed). What it copied
    may be another key's bytes (the daemon reclaims the lease and, after a quarantine, reuses
    the pages), so the load fails on every rank that was late: its blocks are reported
    invalid. Was: reported loaded."""
    c = make_cluster(tp=tp)
    c.prefill(FakeRequest("a", tokens(33), c.spec))
    b = FakeRequest("b", tokens(33), c.spec)
    assert c.admit(b) == (32, True)
    gates = [Gate(w.conn, Direction.LOAD) for w in c.workers]

    def open_after_deadline(w: Any, gate: Gate) -> None:
        try:  # once the load is submitted, its deadline (noted before) is < now + 0.5
            wait_until(lambda: w.conn.deadlines.num_watched == 1)
            deadline = time.monotonic() + 0.5
            wait_until(lambda: time.monotonic() > deadline)
        finally:
            gate.open()

    openers = [
        threading.Thread(target=open_after_deadline, args=(w, g))
        for w, g in zip(c.workers, gates, strict=True)
    ]
    for t in openers:
        t.start()

    def short_lease(rank: int, meta: ConnectorMetadata) -> None:
        for t in meta.loads:
            t.expires_in_s = 0.5

    _, report = c.step(tamper=short_lease, sync=True)
    for t in openers:
        t.join()
    assert report.finished_recving == {"b"}
    assert report.load_errors == {"b": 0}
    assert report.invalid_block_ids == set(c.blocks["b"][:8])
    assert [w.conn.deadlines.expired_loads for w in c.workers] == [1] * tp


def test_a_load_stalled_past_its_daemon_lease_never_yields_another_prompts_kv(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """End to end on a 16-page daemon with a 1 s default lease: a co-located worker's load
    thread stalls (gated) until the daemon has reclaimed the load lease and another client
    has tried to fill the whole arena. The daemon keeps the loaded chunks from eviction for
    the quarantine (the filler's store does not fit, the chunks stay), and the worker, whose
    copies landed after the deadline, reports the load failed: its blocks are recomputed,
    never served. Was: the filler evicted them and took their pages, and the worker copied
    the filler's bytes into b's blocks and reported them loaded."""
    d = start_daemon(
        tmp_path_factory.mktemp("stall"), "--page-size", "4KiB", "--dram", "64KiB",
        "--default-lease-s", "1", "--policy", "lru",
    )  # fmt: skip
    c = Cluster(d.zmq_address, make_spec("test/stalled-load"))
    try:
        w = c.workers[0]
        a = FakeRequest("a", tokens(33), c.spec)
        c.prefill(a)
        b = FakeRequest("b", tokens(33), c.spec)
        assert c.admit(b) == (32, True)
        gate = Gate(w.conn, Direction.LOAD)
        filled: list[list[bytes]] = []

        def reclaim_and_fill() -> None:
            try:
                queue = w.conn.engine._inflight[Direction.LOAD]
                wait_until(lambda: len(queue) == 2)  # the load is submitted, behind the gate
                deadline = time.monotonic() + 1.0  # past the worker's (noted before)
                with KVClient(d.zmq_address, colocated=False) as kv:
                    kv.register_namespace(c.spec)
                    wait_until(lambda: kv.stats()["totals"]["expired_leases"] >= 1)
                    size, part = len(a.chunk_keys()[0]), c.spec.part_bytes
                    keys = [bytes([i]) * size for i in range(16)]
                    parts = [bytes([i]) * part for i in range(16)]
                    filled.append(kv.store(c.spec.ns_id, keys, parts))
                wait_until(lambda: time.monotonic() > deadline)
            finally:
                gate.open()

        filler = threading.Thread(target=reclaim_and_fill)
        filler.start()
        _, report = c.step(sync=True)
        filler.join()
        assert filled == [[]], "the expired load's chunks were evicted for another key"
        assert ready_chunks(d, a) == 4
        assert report.finished_recving == {"b"}
        assert report.load_errors == {"b": 0}
        assert report.invalid_block_ids == set(c.blocks["b"][:8])
    finally:
        c.close()
        d.terminate()


def test_register_checks_the_namespace(daemon: DaemonProc) -> None:
    spec = make_spec("test/register", tp=2)
    conn = KVServerWorkerConnector(WorkerConnectorConfig(daemon.zmq_address, spec, 1))
    try:
        with pytest.raises(InvalidArgument, match="namespace"):
            conn.register_kv_caches(kv_caches(make_spec("x", tp=1), "flash"), NUM_BLOCKS)
        conn.register_kv_caches(kv_caches(spec, "blocks_first"), NUM_BLOCKS)
        with pytest.raises(InvalidArgument, match="another namespace"):
            conn.bind_connector_metadata(ConnectorMetadata(ns_id="0" * 16))
        with pytest.raises(InvalidArgument, match="rank"):
            WorkerConnectorConfig(daemon.zmq_address, spec, 2)
    finally:
        conn.close()


def test_a_colocated_store_whose_lease_ran_out_before_its_copy_writes_nothing(
    make_cluster: Any, daemon: DaemonProc
) -> None:
    """The scheduler ships each store with the time its lease has left; a co-located worker
    that gets to the copy only after that much time (here: none left on arrival, as after a
    stall) fails the store instead of writing pages the daemon may have handed on (a
    quarantine later). Was: it copied regardless; here the chunks then became READY."""
    c = make_cluster()
    w = c.workers[0]
    r = FakeRequest("late", tokens(17, base=700), c.spec)
    assert c.admit(r) == (0, False)
    shipped: list[float | None] = []

    def no_time_left(rank: int, meta: ConnectorMetadata) -> None:
        for t in meta.stores:
            shipped.append(t.expires_in_s)
            t.expires_in_s = 0.0

    c.step({"late": (r, 16)}, tamper=no_time_left, sync=True)  # the scheduler reserves
    for _ in range(8):
        _, report = c.step(tamper=no_time_left, sync=True)
        if "late" in report.finished_sending:
            break
    c.settle()  # the completion goes out (held for a later plan)
    assert shipped and all(s is not None and s > 0 for s in shipped)  # stamped when shipped
    assert ready_chunks(daemon, r) == 0, "copied into an expired reservation and completed"
    assert w.conn.deadlines.expired_stores == 1
