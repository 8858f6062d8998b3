"""The scheduler-side connector against a real daemon, with workers simulated per TP rank.

Each fake worker owns a dict of "GPU blocks" and a co-located KVClient, and really copies bytes
between those blocks and the daemon's shared-memory arena as the metadata says; the "model"
writes a block's KV (a pattern derived from its hash and the rank) when its tokens are computed.
A load that lands the right bytes in the right blocks is the end-to-end check. Metadata and
worker outputs go through the step wire format (encode/decode + from_wire) on the way.
"""

from __future__ import annotations

import hashlib
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvserver.allocator import Extents
from kvserver.client import KVClient
from kvserver.errors import InvalidArgument
from kvserver.events import BlockRemoved, BlockStored
from kvserver.hashing import BlockHasher
from kvserver.namespace import NamespaceSpec
from kvserver.wire import COMPLETE_STORE, LOOKUP, PREPARE_STORE
from scheduler.connector_base import TransferReport
from scheduler.kv_connector import KVServerSchedulerConnector
from scheduler.kv_connector_types import KVConnectorConfig
from step_protocol import (
    CachedRequestData,
    ChunkLoad,
    ChunkStore,
    ConnectorMetadata,
    ConnectorWorkerOutput,
    FailedLoad,
    NewRequestData,
    RequestTransfers,
    StepPlan,
    TransferResult,
    decode,
    encode,
)
from tests.support.connector import admit, bound, patient_config
from tests.support.daemon import DaemonProc, start_daemon
from tests.support.ports import free_port

mp = pytest.mark.multiprocess

BS = 4  # tokens per GPU block


def make_spec(tp: int = 1, chunk_blocks: int = 2, model: str = "test/connector") -> NamespaceSpec:
    """Tiny parts: 1 layer, 2 KV heads of 8 dims, 4 tokens per block, fp16 (256 B/block/TP)."""
    return NamespaceSpec(
        model=model, dtype="float16", num_layers=1, num_kv_heads=2, head_dim=8,
        block_size=BS, chunk_blocks=chunk_blocks, tp_world_size=tp,
    )  # fmt: skip


def kv_bytes(block_hash: bytes, rank: int, size: int) -> bytes:
    """The KV a block with this hash has on this rank (what the fake model computes)."""
    seed = hashlib.sha256(block_hash + bytes([rank])).digest()
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class FakeRequest:
    """Satisfies RequestLike. ``hashed=False`` leaves block_hashes empty (connector hashes)."""

    request_id: str
    all_token_ids: list[int]
    spec: NamespaceSpec
    cache_salt: str | None = None
    hashed: bool = True
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    true_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.append([])

    def append(self, new_tokens: list[int]) -> None:
        """Add (sampled) tokens; the hashes of newly full blocks follow, as in vLLM."""
        self.all_token_ids = self.all_token_ids + new_tokens
        hasher = BlockHasher(self.spec.hash_algo, BS, self.spec.hash_seed)
        self.true_hashes = list(hasher.hash_blocks(self.all_token_ids, cache_salt=self.cache_salt))
        self.block_hashes = list(self.true_hashes) if self.hashed else []

    def chunk_keys(self) -> list[bytes]:
        cb = self.spec.chunk_blocks
        return self.true_hashes[cb - 1 :: cb]


class FakeWorker:
    """One TP rank: GPU blocks in a dict, real copies through the mapped arena."""

    def __init__(self, address: str, spec: NamespaceSpec, rank: int) -> None:
        self.rank, self.block_bytes, self.chunk_blocks = rank, spec.block_bytes, spec.chunk_blocks
        self.kv = KVClient(address, colocated=True)
        self.kv.hello()
        self.gpu: dict[int, bytes] = {}
        self.hold_stores = False  # model an asynchronous copy that has not run yet
        self.held: list[RequestTransfers] = []
        self.fail_load_keys: set[bytes] = set()
        self.out = ConnectorWorkerOutput(rank)

    def run(self, meta: ConnectorMetadata) -> None:
        """The worker contract: flush barrier, stores, then loads (before the forward pass)."""
        for t in [t for t in self.held if t.req_id in meta.flush_req_ids]:
            self.held.remove(t)
            self._store(t)
        for t in meta.stores:
            if self.hold_stores and t.req_id not in meta.flush_req_ids:
                self.held.append(t)
            else:
                self._store(t)
        for t in meta.loads:
            failed = []
            for load in t.loads:
                if load.key in self.fail_load_keys:
                    failed.append(load.key)
                    continue
                part = self.kv.read(extents(load.extents[self.rank]))
                for j, block in enumerate(load.block_ids):
                    sub = load.skip_blocks + j
                    self.gpu[block] = part[sub * self.block_bytes : (sub + 1) * self.block_bytes]
            self.out.loads.append(TransferResult(t.req_id, t.lease_id, failed))

    def release_held(self) -> None:
        for t in self.held:
            self._store(t)
        self.held = []

    def _store(self, t: RequestTransfers) -> None:
        for store in t.stores:
            assert len(store.block_ids) == self.chunk_blocks
            data = b"".join(self.gpu[b] for b in store.block_ids)
            self.kv.write(extents(store.extents[self.rank]), data)
        self.out.stores.append(TransferResult(t.req_id, t.lease_id))

    def report(self) -> ConnectorWorkerOutput:
        out, self.out = self.out, ConnectorWorkerOutput(self.rank)
        return out


def extents(rank_extents: list[tuple[int, int]]) -> Extents:
    return tuple((int(offset), int(length)) for offset, length in rank_extents)


def new_request(req: FakeRequest, block_ids: list[int]) -> NewRequestData:
    return NewRequestData(
        req_id=req.request_id, prompt_token_ids=req.all_token_ids, block_ids=block_ids,
        num_computed_tokens=req.num_computed_tokens, max_tokens=16,
    )  # fmt: skip


def wire(kind: str, message: Any) -> dict[str, Any]:
    got_kind, body = decode(encode(kind, message))
    assert got_kind == kind
    return body


class Harness:
    """A minimal scheduler around the connector: block allocation, steps, fake workers."""

    def __init__(
        self,
        daemon: DaemonProc,
        spec: NamespaceSpec,
        *,
        dispatch: bool = False,
        clock: Callable[[], float] = time.monotonic,
        **config: Any,
    ) -> None:
        """``dispatch``: call ``dispatched()`` after each ``build_connector_meta``, as
        kvserver's scheduler process does; ``clock``: the connector's."""
        self.spec = spec
        self.dispatch = dispatch
        self.conn = KVServerSchedulerConnector(
            patient_config(daemon.zmq_address, spec, **config), clock=clock
        )
        self.workers = [FakeWorker(daemon.zmq_address, spec, r) for r in range(spec.tp_world_size)]
        self.blocks: dict[str, list[int]] = {}
        self.new_blocks: dict[str, list[int]] = {}
        self.sent: set[str] = set()
        self.next_block = 1
        self.step_no = 0
        self.metas: list[ConnectorMetadata] = []

    def close(self) -> None:
        self.conn.close()
        for w in self.workers:
            w.kv.close()

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def admit(
        self, req: FakeRequest, num_local: int = 0, blocks: list[int] | None = None
    ) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens + allocation (whole prompt) + update_state_after_alloc."""
        return admit(self, req, BS, num_local, blocks)

    def step(
        self,
        sched: dict[str, tuple[FakeRequest, int]] | None = None,
        preempted: tuple[str, ...] = (),
    ) -> tuple[ConnectorMetadata, TransferReport]:
        """One engine step: plan → metadata → workers (connector first) → compute → report."""
        sched = sched or {}
        self.step_no += 1
        new, cached = [], []
        for req_id, (req, n) in sched.items():
            need = -(-(req.num_computed_tokens + n) // BS) - len(self.blocks[req_id])
            if need > 0:
                added = self.alloc(need)
                self.blocks[req_id] += added
                self.new_blocks.setdefault(req_id, []).extend(added)
            if req_id not in self.sent:
                self.sent.add(req_id)
                new.append(new_request(req, list(self.blocks[req_id])))
            else:
                cached.append(CachedRequestData(
                    req_id=req_id, new_block_ids=self.new_blocks.get(req_id, []),
                    num_computed_tokens=req.num_computed_tokens, token_ids=[],
                ))  # fmt: skip
            self.new_blocks.pop(req_id, None)
        plan = StepPlan(
            step=self.step_no, new_reqs=new, cached_reqs=cached,
            num_scheduled_tokens={r: n for r, (_, n) in sched.items()},
            preempted_req_ids=list(preempted),
        )  # fmt: skip
        meta = self.conn.build_connector_meta(plan)
        if self.dispatch:
            self.conn.dispatched()
        self.metas.append(meta)
        shipped = ConnectorMetadata.from_wire(wire("meta", meta))
        for w in self.workers:
            w.run(shipped)
        for req_id, (req, n) in sched.items():  # the forward pass writes the KV of full blocks
            for b in range(req.num_computed_tokens // BS, (req.num_computed_tokens + n) // BS):
                for w in self.workers:
                    w.gpu[self.blocks[req_id][b]] = kv_bytes(req.true_hashes[b], w.rank,
                                                             w.block_bytes)  # fmt: skip
            req.num_computed_tokens += n
        outputs = [ConnectorWorkerOutput.from_wire(wire("out", w.report())) for w in self.workers]
        return meta, self.conn.update_connector_output(outputs)

    def prefill(self, req: FakeRequest) -> None:
        """Admit (expecting a miss) and compute the whole prompt but its last token; then one
        more step so the deferred stores are shipped and completed (replies applied)."""
        assert self.admit(req) == (0, False)
        self.step({req.request_id: (req, len(req.all_token_ids) - 1)})
        self.step()
        self.conn.drain()

    def assert_loaded(self, req: FakeRequest, block_indices: range) -> None:
        for w in self.workers:
            for b in block_indices:
                want = kv_bytes(req.true_hashes[b], w.rank, w.block_bytes)
                assert w.gpu[self.blocks[req.request_id][b]] == want, (w.rank, b)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("conn"), "--page-size", "4KiB", "--dram", "4MiB")
    yield d
    d.terminate()


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def harness(request: pytest.FixtureRequest, daemon: DaemonProc) -> Iterator[Harness]:
    h = Harness(daemon, make_spec(tp=request.param, model=f"test/{request.node.name}"))
    yield h
    h.close()


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def ready_chunks(daemon: DaemonProc, req: FakeRequest) -> int:
    """How many leading chunks of ``req`` the daemon has ready (asked by another client)."""
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        kv.register_namespace(req.spec)
        return kv.lookup(req.spec.ns_id, req.chunk_keys()).hit_chunks


def daemon_stats(daemon: DaemonProc) -> dict[str, Any]:
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        return kv.stats()


def stored_keys(conn: KVServerSchedulerConnector) -> list[bytes]:
    return [k for e in conn.take_events() if isinstance(e, BlockStored) for k in e.keys]


def store_keys(meta: ConnectorMetadata) -> list[bytes]:
    return [c.key for t in meta.stores for c in t.stores]


# ----------------------------------------------------------------------------- hits and misses


@mp
def test_miss_store_then_hit_loads_the_right_bytes(harness: Harness, daemon: DaemonProc) -> None:
    """A prompt computed once is stored; a request sharing 3 of its chunks loads exactly those
    bytes into its own blocks on every rank; unrelated tokens and another salt miss."""
    h, spec = harness, harness.spec
    a = FakeRequest("a", tokens(33), spec)
    h.prefill(a)
    assert ready_chunks(daemon, a) == 4
    assert stored_keys(h.conn) == a.chunk_keys()
    # b's block hashes are left to the connector: they must equal the ones a was stored under
    b = FakeRequest("b", tokens(24) + [999] * 9, spec, hashed=False)
    assert h.admit(b) == (24, True)
    assert h.conn.get_num_new_matched_tokens(b, 0) == (None, False)  # its load is pending
    meta, report = h.step()
    assert [t.req_id for t in meta.loads] == ["b"]
    assert [c.key for c in meta.loads[0].loads] == a.chunk_keys()[:3]
    assert [c.block_ids for c in meta.loads[0].loads] == [
        h.blocks["b"][i : i + 2] for i in (0, 2, 4)
    ]
    assert report.finished_recving == {"b"} and not report.load_errors
    h.assert_loaded(b, range(6))
    h.conn.drain()  # complete_load was sent without waiting
    assert daemon_stats(daemon)["pinned_pages"] == 0  # complete_load once every rank reported
    assert h.admit(FakeRequest("c", tokens(33, base=5000), spec)) == (0, False)
    assert h.admit(FakeRequest("d", tokens(33), spec, cache_salt="tenant-2")) == (0, False)
    # a full hit leaves the last token to compute, as vLLM's prefix cache does: a 32-token
    # prompt (8 blocks, all 4 chunks stored) is offered 7 blocks
    assert h.conn.get_num_new_matched_tokens(FakeRequest("e", tokens(32), spec), 0) == (28, True)
    assert h.conn.stats.hit_tokens == 24  # b took its hit; e was only offered


@mp
def test_partial_first_chunk_skips_blocks_already_on_gpu(harness: Harness) -> None:
    """3 blocks are a local GPU hit; chunk 1 (blocks 2-3) is loaded into block 3 only."""
    h, spec = harness, harness.spec
    h.prefill(FakeRequest("a", tokens(33), spec))
    b = FakeRequest("b", tokens(33), spec)
    local = h.alloc(3)
    for w in h.workers:
        for blk in local:
            w.gpu[blk] = b"LOCAL"
    assert h.admit(b, num_local=3 * BS, blocks=local) == (32 - 3 * BS, True)
    meta, report = h.step()
    loads = meta.loads[0].loads
    assert [(c.skip_blocks, c.block_ids) for c in loads] == [
        (1, [h.blocks["b"][3]]), (0, h.blocks["b"][4:6]), (0, h.blocks["b"][6:8]),
    ]  # fmt: skip
    assert report.finished_recving == {"b"}
    assert all(w.gpu[blk] == b"LOCAL" for w in h.workers for blk in local)
    h.assert_loaded(b, range(3, 8))


@mp
def test_full_hit_loads_the_last_chunk_up_to_the_block_before_the_last_token(
    harness: Harness,
) -> None:
    """A 32-token prompt whose 4 chunks are stored: 7 of its 8 blocks are loaded (the last
    chunk's first block only), as many as vLLM's own prefix cache would give it."""
    h, spec = harness, harness.spec
    h.prefill(FakeRequest("a", tokens(33), spec))
    b = FakeRequest("b", tokens(32), spec)
    assert h.admit(b) == (28, True)
    for w in h.workers:
        w.gpu[h.blocks["b"][7]] = b"UNTOUCHED"
    meta, report = h.step()
    loads = meta.loads[0].loads
    assert [(c.skip_blocks, c.block_ids) for c in loads] == [
        (0, h.blocks["b"][0:2]), (0, h.blocks["b"][2:4]), (0, h.blocks["b"][4:6]),
        (0, [h.blocks["b"][6]]),
    ]  # fmt: skip
    assert report.finished_recving == {"b"} and not report.load_errors
    h.assert_loaded(b, range(7))
    assert all(w.gpu[h.blocks["b"][7]] == b"UNTOUCHED" for w in h.workers)


@mp
def test_a_prefix_loading_for_one_request_makes_the_next_one_wait(harness: Harness) -> None:
    """Two requests sharing a stored prefix arrive together: the second is asked to wait
    (None, no lookup) while the first one's load is in flight, instead of copying the same
    chunks into blocks of its own; once the load landed the prefix cache serves it, and the
    connector offers nothing more (no lookup either)."""
    h, spec = harness, harness.spec
    h.prefill(FakeRequest("a", tokens(33), spec))
    b, c = FakeRequest("b", tokens(33), spec), FakeRequest("c", tokens(33), spec)
    assert h.admit(b) == (32, True)
    lookups = h.conn.stats.lookups
    assert h.conn.get_num_new_matched_tokens(c, 0) == (None, False)
    meta, report = h.step()
    assert [t.req_id for t in meta.loads] == ["b"] and report.finished_recving == {"b"}
    assert h.conn.get_num_new_matched_tokens(c, 32) == (0, False)  # the local hit: 8 blocks
    assert h.conn.stats.lookups == lookups
    assert h.admit(FakeRequest("d", tokens(33), spec)) == (32, True)  # no load in flight


@mp
def test_update_state_after_alloc_rejects_a_different_hit(harness: Harness) -> None:
    """The scheduler may take the offered hit or nothing; anything else is refused unchanged."""
    h, spec = harness, harness.spec
    h.prefill(FakeRequest("a", tokens(33), spec))
    b = FakeRequest("b", tokens(33), spec)
    assert h.conn.get_num_new_matched_tokens(b, 0) == (32, True)
    with pytest.raises(InvalidArgument):
        h.conn.update_state_after_alloc(b, h.alloc(9), 8)
    with pytest.raises(InvalidArgument):
        h.conn.update_state_after_alloc(b, h.alloc(3), 32)  # blocks do not cover the hit
    assert not h.conn.has_pending_transfers
    h.conn.update_state_after_alloc(b, h.alloc(9), 32)
    assert h.conn.has_pending_transfers


# ----------------------------------------------------------------------------- stores


@mp
def test_stores_are_deferred_one_step_and_never_repeated(
    harness: Harness, daemon: DaemonProc
) -> None:
    """Chunked prefill then decode: each chunk (2 GPU blocks) is reserved in the step that
    fills it, shipped in the next step's metadata, exactly once, with its own blocks."""
    h, spec = harness, harness.spec
    r = FakeRequest("r", tokens(38), spec)
    assert h.admit(r) == (0, False)
    full_at: dict[bytes, int] = {}
    shipped_at: dict[bytes, list[int]] = {}

    def step(n: int) -> ConnectorMetadata:
        before = r.num_computed_tokens // spec.chunk_tokens
        meta, _ = h.step({"r": (r, n)})
        for key in store_keys(meta):
            shipped_at.setdefault(key, []).append(h.step_no)
        for i in range(before, r.num_computed_tokens // spec.chunk_tokens):
            full_at[r.chunk_keys()[i]] = h.step_no
        return meta

    assert step(12).stores == []  # chunk 0 is full after this step: reserved, not shipped
    h.conn.drain()  # the reservation was sent without waiting
    assert daemon_stats(daemon)["reserved_pages"] == spec.tp_world_size
    step(12)
    step(13)  # 37 tokens computed: 4 chunks
    while len(r.all_token_ids) < 50:  # decode: one sampled token per step
        r.append([7])
        step(1)
    h.step()
    h.conn.drain()
    assert len(r.chunk_keys()) == 6
    assert shipped_at == {k: [full_at[k] + 1] for k in r.chunk_keys()}
    for meta in h.metas:
        for t in meta.stores:
            for c in t.stores:
                i = r.chunk_keys().index(c.key)
                assert c.block_ids == h.blocks["r"][2 * i : 2 * i + 2]
    assert ready_chunks(daemon, r) == 6
    assert h.conn.stats.planned_chunks == 6  # the cursor: each chunk asked for once
    assert stored_keys(h.conn) == r.chunk_keys()
    assert daemon_stats(daemon)["reserved_pages"] == 0


@mp
def test_a_store_completes_only_when_every_rank_reported(daemon: DaemonProc) -> None:
    """TP=2: a request finishing with its stores in flight keeps its blocks until both ranks
    copied their parts; meanwhile the chunks are not ready and a request needing them asks
    again; then they are ready and the request is in finished_sending."""
    spec = make_spec(tp=2, model="test/tp-completion")
    h = Harness(daemon, spec)
    try:
        r = FakeRequest("r", tokens(17), spec)
        assert h.admit(r) == (0, False)
        h.step({"r": (r, 16)})
        assert h.conn.request_finished(r, h.blocks["r"]) == (True, None)
        h.workers[1].hold_stores = True
        meta, report = h.step()
        assert store_keys(meta) == r.chunk_keys() and report.finished_sending == set()
        assert ready_chunks(daemon, r) == 0
        other = FakeRequest("o", tokens(17), spec)
        assert h.conn.get_num_new_matched_tokens(other, 0) == (None, False)
        h.workers[1].release_held()
        _, report = h.step()
        assert report.finished_sending == {"r"}
        h.conn.drain()
        assert ready_chunks(daemon, r) == 2
        assert h.conn.get_num_new_matched_tokens(other, 0) == (16, True)
        assert not h.conn.request_finished(FakeRequest("idle", tokens(3), spec), [])[0]
    finally:
        h.close()


@mp
def test_preemption_with_a_store_in_flight_flushes_before_blocks_are_reused(
    harness: Harness, daemon: DaemonProc
) -> None:
    """r's stores are shipped but not yet run when r is preempted and its blocks go to s in
    the same step; the metadata names r in flush_req_ids, so the stored chunks hold r's KV
    (not s's) and r, asking again meanwhile, later loads them back intact."""
    h, spec = harness, harness.spec
    r = FakeRequest("r", tokens(17), spec)
    assert h.admit(r) == (0, False)
    h.step({"r": (r, 16)})
    for w in h.workers:
        w.hold_stores = True
    meta, _ = h.step({"r": (r, 1)})
    assert store_keys(meta) == r.chunk_keys()
    freed = h.blocks.pop("r")
    r.num_computed_tokens = 0
    assert h.conn.handle_preemptions(["r"]) == {"r"}
    assert h.conn.get_num_new_matched_tokens(r, 0) == (None, False)  # its store is in flight
    s = FakeRequest("s", tokens(17, base=7000), spec)
    assert h.admit(s, blocks=freed) == (0, False)
    assert h.blocks["s"] == freed
    meta, _ = h.step({"s": (s, 16)}, preempted=("r",))
    assert meta.flush_req_ids == ["r"]
    h.conn.drain()
    assert ready_chunks(daemon, r) == 2
    assert h.admit(r) == (16, True)
    _, report = h.step()
    assert report.finished_recving == {"r"} and not report.load_errors
    h.assert_loaded(r, range(4))


@mp
def test_a_landed_load_keeps_the_store_cursor(harness: Harness) -> None:
    """The scheduler calls update_state_after_alloc again (0 external tokens) once a load
    landed: the cursor stays past the loaded chunks, so only chunks computed afterwards are
    planned; a chunk a rank failed to load is planned again once recomputed."""
    h, spec = harness, harness.spec
    a = FakeRequest("a", tokens(33), spec)
    h.prefill(a)
    b = FakeRequest("b", tokens(49), spec)
    assert h.admit(b) == (32, True)
    _, report = h.step()
    assert report.finished_recving == {"b"}
    h.conn.update_state_after_alloc(b, h.blocks["b"], 0)  # the scheduler admits it again
    planned = h.conn.stats.planned_chunks
    h.step({"b": (b, 16)})  # computes chunks 4 and 5
    meta, _ = h.step()
    assert store_keys(meta) == b.chunk_keys()[4:6]
    assert h.conn.stats.planned_chunks - planned == 2  # not 6: chunks 0-3 came from kvserver
    c = FakeRequest("c", tokens(33), spec)
    assert h.admit(c) == (32, True)
    h.workers[-1].fail_load_keys = {a.chunk_keys()[2]}
    _, report = h.step()
    assert report.load_errors == {"c": 16}
    h.workers[-1].fail_load_keys = set()
    h.conn.update_state_after_alloc(c, h.blocks["c"], 0)
    c.num_computed_tokens = 16
    planned = h.conn.stats.planned_chunks
    h.step({"c": (c, 16)})  # recomputes chunks 2 and 3 (kvserver has them: nothing to copy)
    assert h.conn.stats.planned_chunks - planned == 2


# ----------------------------------------------------------------------------- calls per step


@mp
@pytest.mark.parametrize("num_requests", [2, 24])
def test_daemon_calls_per_step_do_not_grow_with_requests(
    daemon: DaemonProc, num_requests: int
) -> None:
    """Requests sharing a prefix in chunked prefill, then decode: every step makes at most one
    prepare_store (all requests' new chunks, one lease) and one complete_store, whatever the
    number of requests; lookups are one per admission. Every chunk is stored, a shared one
    once."""
    spec = make_spec(model=f"test/calls-{num_requests}")
    h = Harness(daemon, spec)
    try:
        reqs = [
            FakeRequest(f"r{i}", tokens(16) + tokens(21, base=1000 * (i + 1)), spec)
            for i in range(num_requests)
        ]
        sent = h.conn.client.sent_by_op
        for r in reqs:
            assert h.admit(r) == (0, False)
        assert sent[LOOKUP] == num_requests
        per_step: list[Counter[str]] = []

        def step(sched: dict[str, tuple[FakeRequest, int]]) -> ConnectorMetadata:
            before = Counter(sent)
            meta, _ = h.step(sched)
            per_step.append(Counter(sent) - before)
            assert len({t.lease_id for t in meta.stores}) <= 1
            return meta

        step({r.request_id: (r, 12) for r in reqs})
        shared = store_keys(step({r.request_id: (r, 12) for r in reqs}))
        assert sorted(shared) == sorted(set(shared))  # the common prefix chunk: once
        step({r.request_id: (r, 12) for r in reqs})
        for _ in range(8):  # decode
            for r in reqs:
                r.append([7])
            step({r.request_id: (r, 1) for r in reqs})
        step({})
        assert all(c[PREPARE_STORE] <= 1 and c[COMPLETE_STORE] <= 1 for c in per_step), per_step
        assert all(sum(c.values()) <= 2 for c in per_step), per_step
        assert sum(c[PREPARE_STORE] for c in per_step) >= 4  # stores were really made
        h.conn.drain()
        want = {k for r in reqs for k in r.chunk_keys()}
        assert sorted(stored_keys(h.conn)) == sorted(want)
        assert all(ready_chunks(daemon, r) == len(r.chunk_keys()) == 5 for r in reqs)
    finally:
        h.close()


@mp
def test_store_reservation_is_not_waited_for(tmp_path: Path) -> None:
    """A daemon stopped (SIGSTOP) right after admission does not delay the step: the
    reservation is sent at the end of build_connector_meta and collected at the start of the
    next one, which ships the stores once the daemon runs again."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "4MiB")
    spec = make_spec(model="test/not-waited")
    h = Harness(d, spec, op_timeout_s=30.0)
    try:
        r = FakeRequest("r", tokens(17), spec)
        assert h.admit(r) == (0, False)
        d.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            meta, _ = h.step({"r": (r, 16)})
            assert time.monotonic() - t0 < 5.0  # far below op_timeout_s: nothing waited
            assert meta.stores == [] and h.conn.client.sent_by_op[PREPARE_STORE] == 1
            assert h.conn.request_finished(r, h.blocks["r"]) == (True, None)
            assert h.conn.has_pending_transfers
        finally:
            d.proc.send_signal(signal.SIGCONT)
        meta, report = h.step()
        assert store_keys(meta) == r.chunk_keys() and report.finished_sending == {"r"}
        h.conn.drain()
        assert ready_chunks(d, r) == 2
    finally:
        h.close()
        d.terminate()


@mp
def test_unanswered_reservation_is_dropped_in_bounded_time(tmp_path: Path) -> None:
    """The daemon stops answering once the reservation is sent: the next step waits at most
    op_timeout_s for it, marks the daemon down, ships no store and releases the finished
    request's blocks; nothing more is planned or completed while it is down."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "4MiB")
    spec = make_spec(model="test/unanswered")
    h = Harness(d, spec, op_timeout_s=0.3, down_backoff_s=60)
    try:
        r = FakeRequest("r", tokens(25), spec)
        assert h.admit(r) == (0, False)
        d.proc.send_signal(signal.SIGSTOP)
        try:
            h.step({"r": (r, 16)})
            assert h.conn.request_finished(r, h.blocks["r"]) == (True, None)
            t0 = time.monotonic()
            meta, report = h.step()
            assert time.monotonic() - t0 < 3.0
            assert meta.stores == [] and report.finished_sending == {"r"}
            assert h.conn.is_daemon_down and h.conn.stats.timeouts == 1
            assert not h.conn.has_pending_transfers
            s = FakeRequest("s", tokens(17, base=500), spec)
            assert h.admit(s) == (0, False)
            h.step({"s": (s, 16)})
            h.step()
            assert h.conn.client.sent_by_op[PREPARE_STORE] == 1
        finally:
            d.proc.send_signal(signal.SIGCONT)
    finally:
        h.close()
        d.terminate()


@mp
def test_a_batch_the_cache_cannot_hold_is_halved_until_it_fits(tmp_path: Path) -> None:
    """20 chunks full at once, 16 pages of cache: the whole batch is refused (cache full),
    the next ones are halved until they fit, and every chunk is still shipped exactly once."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "64KiB")
    spec = make_spec(model="test/halved")  # one page per chunk
    h = Harness(d, spec)
    try:
        r = FakeRequest("r", tokens(161), spec)
        assert h.admit(r) == (0, False)
        shipped: list[bytes] = []
        shipped += store_keys(h.step({"r": (r, 160)})[0])
        for _ in range(10):
            r.append([7])
            shipped += store_keys(h.step({"r": (r, 1)})[0])
        assert h.conn.stats.store_rejections >= 1
        assert len(shipped) >= 20 and shipped == r.chunk_keys()[: len(shipped)]
    finally:
        h.close()
        d.terminate()


# ----------------------------------------------------------------------------- failures


@mp
def test_failed_load_reports_the_tokens_to_recompute(harness: Harness, daemon: DaemonProc) -> None:
    """One rank cannot copy chunk 2: the load still finishes (pins released), and the report
    says tokens from chunk 2 on must be recomputed and which blocks hold no valid KV."""
    h, spec = harness, harness.spec
    a = FakeRequest("a", tokens(33), spec)
    h.prefill(a)
    b = FakeRequest("b", tokens(33), spec)
    assert h.admit(b) == (32, True)
    h.workers[-1].fail_load_keys = {a.chunk_keys()[2]}
    _, report = h.step()
    assert report.finished_recving == {"b"}
    assert report.load_errors == {"b": 2 * spec.chunk_tokens}
    assert report.invalid_block_ids == set(h.blocks["b"][4:6])
    h.conn.drain()
    assert daemon_stats(daemon)["pinned_pages"] == 0
    assert h.conn.stats.load_errors == 1


@mp
def test_hit_evicted_before_allocation_loads_what_is_left(tmp_path: Path) -> None:
    """Between the lookup and the pin another client's store evicts the hit's last chunk (LRU):
    the rest is still loaded, the report says to recompute from that chunk on, and a
    BlockRemoved event names the chunk found gone."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "64KiB")  # 16 pages
    spec = make_spec(model="test/evicted")
    h = Harness(d, spec)
    try:
        a = FakeRequest("a", tokens(33), spec)
        h.prefill(a)  # 4 chunks, 4 pages
        b = FakeRequest("b", tokens(33), spec)
        assert h.conn.get_num_new_matched_tokens(b, 0) == (32, True)
        with KVClient(d.zmq_address, colocated=False) as kv:
            kv.register_namespace(spec)
            filler = [hashlib.sha256(b"fill%d" % i).digest() for i in range(13)]
            assert kv.put(spec.ns_id, filler, [bytes(spec.part_bytes)] * 13).stored == filler
        assert ready_chunks(d, a) == 3
        blocks = h.alloc(9)
        h.blocks["b"] = blocks
        h.conn.update_state_after_alloc(b, blocks, 32)
        removed = [k for e in h.conn.take_events() if isinstance(e, BlockRemoved) for k in e.keys]
        assert removed == a.chunk_keys()[3:]
        meta, report = h.step()
        assert [c.key for c in meta.loads[0].loads] == a.chunk_keys()[:3]
        assert report.finished_recving == {"b"}
        assert report.load_errors == {"b": 3 * spec.chunk_tokens}
        assert report.invalid_block_ids == set(blocks[6:8])
        h.assert_loaded(b, range(6))
    finally:
        h.close()
        d.terminate()


@mp
def test_unreachable_daemon_means_no_hit_within_bounded_time(tmp_path: Path) -> None:
    """Nothing listens: the first lookup times out and marks the daemon down; the other 19
    answer at once; the step's metadata is built and completion handling works. Once the
    backoff has passed and a daemon listens there, lookups go through again."""
    port, offset = free_port(), [0.0]
    spec = make_spec(model="test/dead")
    config = KVConnectorConfig(
        f"tcp://127.0.0.1:{port}", spec, lookup_timeout_s=0.25, down_backoff_s=60
    )
    reqs = [FakeRequest(f"r{i}", tokens(33, base=100 * i), spec) for i in range(20)]
    with KVServerSchedulerConnector(config, clock=lambda: time.monotonic() + offset[0]) as conn:
        t0 = time.monotonic()
        for r in reqs:
            assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
            conn.update_state_after_alloc(r, list(range(9)), 0)
        plan = StepPlan(
            step=1,
            new_reqs=[new_request(r, list(range(9))) for r in reqs],
            num_scheduled_tokens={r.request_id: 32 for r in reqs},
        )
        assert conn.build_connector_meta(plan).is_empty
        assert conn.update_connector_output([]) == TransferReport()
        assert all(conn.request_finished(r, []) == (False, None) for r in reqs)
        elapsed = time.monotonic() - t0
        # one 0.25 s timeout, not 20 (5 s; 10 s with the stores): bounded at half of 20
        assert elapsed < 10 * config.lookup_timeout_s, elapsed
        assert conn.is_daemon_down
        assert (conn.stats.timeouts, conn.stats.lookups_failed) == (1, 20)
        d = start_daemon(tmp_path, "--zmq-port", str(port))
        try:
            offset[0] = 61.0
            bound(conn, lookup_timeout_s=10.0)  # the lookup to the live daemon must answer
            assert conn.get_num_new_matched_tokens(reqs[0], 0) == (0, False)
            assert (conn.stats.timeouts, conn.stats.lookups_failed) == (1, 20)
            assert not conn.is_daemon_down
        finally:
            d.terminate()


@mp
def test_daemon_killed_with_transfers_in_flight(tmp_path: Path) -> None:
    """kill -9 of the daemon between a lookup and the pin, with stores reserved: the pin fails
    over to recomputation, the finished request's blocks are released once its store ran,
    later lookups answer 'no hit' at once, and each step completes in bounded time."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "4MiB")
    spec = make_spec(model="test/killed")
    h = Harness(d, spec, down_backoff_s=60)  # patient while the daemon lives
    try:
        h.prefill(FakeRequest("a", tokens(33), spec))
        b = FakeRequest("b", tokens(33), spec)
        assert h.conn.get_num_new_matched_tokens(b, 0) == (32, True)
        r = FakeRequest("r", tokens(17, base=900), spec)
        assert h.admit(r) == (0, False)
        h.step({"r": (r, 16)})  # r's stores reserved, shipped by the next step
        h.conn.drain()  # ... and the reservation answered
        bound(h.conn, lookup_timeout_s=0.2, op_timeout_s=0.2)
        d.kill()
        t0 = time.monotonic()
        h.conn.update_state_after_alloc(b, h.alloc(9), 32)
        assert h.conn.request_finished(r, h.blocks["r"]) == (True, None)
        meta, report = h.step()
        assert store_keys(meta) == r.chunk_keys()
        assert report.finished_recving == {"b"} and report.load_errors == {"b": 0}
        assert report.finished_sending == {"r"}
        c = FakeRequest("c", tokens(33), spec)
        assert h.conn.get_num_new_matched_tokens(c, 0) == (0, False)
        assert time.monotonic() - t0 < 5.0  # bounded: no call waits past the one timeout
        assert h.conn.stats.timeouts == 1
    finally:
        h.close()
        Path(d.arena_path).unlink(missing_ok=True)


@mp
def test_reset_forgets_transfers_and_releases_leases(tmp_path: Path) -> None:
    """The workers lost their KV with a load pinned, stores shipped but unreported and a
    reservation in flight: reset() releases all of it on the daemon, no report mentions those
    requests, and the connector works on."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "4MiB")
    spec = make_spec(model="test/reset")
    h = Harness(d, spec)
    try:
        a = FakeRequest("a", tokens(33), spec)
        h.prefill(a)
        r = FakeRequest("r", tokens(25, base=300), spec)
        assert h.admit(r) == (0, False)
        h.step({"r": (r, 16)})
        for w in h.workers:
            w.hold_stores = True
        h.step({"r": (r, 8)})  # r's first stores shipped (held), the next ones in flight
        b = FakeRequest("b", tokens(33), spec)
        assert h.admit(b) == (32, True)  # pinned
        assert h.conn.has_pending_transfers
        h.conn.reset()
        assert not h.conn.has_pending_transfers
        stats = daemon_stats(d)
        assert (stats["reserved_pages"], stats["pinned_pages"], stats["num_leases"]) == (0, 0, 0)
        for w in h.workers:
            w.held, w.hold_stores = [], False
        meta, report = h.step()
        assert meta.is_empty and report == TransferReport()
        assert h.admit(FakeRequest("b2", tokens(33), spec)) == (32, True)
    finally:
        h.close()
        d.terminate()


@mp
def test_lease_no_worker_reports_expires(daemon: DaemonProc) -> None:
    """Workers never report a shipped store: past its lease deadline the job is dropped and
    the finished request's blocks are released."""
    offset = [0.0]
    spec = make_spec(model="test/expire")
    conn = KVServerSchedulerConnector(
        patient_config(daemon.zmq_address, spec, lease_s=5.0),
        clock=lambda: time.monotonic() + offset[0],
    )
    with conn:
        r = FakeRequest("r", tokens(17), spec)
        assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
        conn.update_state_after_alloc(r, list(range(5)), 0)
        plan = StepPlan(step=1, new_reqs=[new_request(r, list(range(5)))],
                        num_scheduled_tokens={"r": 16})  # fmt: skip
        conn.build_connector_meta(plan)
        assert store_keys(conn.build_connector_meta(StepPlan(2))) == r.chunk_keys()
        assert conn.request_finished(r, []) == (True, None)
        conn.build_connector_meta(StepPlan(3))
        assert conn.update_connector_output([]).finished_sending == set()
        offset[0] = 10.0
        conn.build_connector_meta(StepPlan(4))
        assert conn.update_connector_output([]).finished_sending == {"r"}
        assert conn.stats.expired_jobs == 1 and not conn.has_pending_transfers


# ----------------------------------------------------------------------------- wire format


def test_connector_messages_round_trip_and_reject_malformed() -> None:
    meta = ConnectorMetadata(
        ns_id="ns",
        loads=[RequestTransfers("a", 7, loads=[ChunkLoad(b"k", [3], 1, [[(0, 64)], [(64, 64)]])])],
        stores=[RequestTransfers("b", 8, stores=[ChunkStore(b"j", [4, 5], [[(128, 64)]])])],
        flush_req_ids=["b"],
        failed_loads=[FailedLoad("c", [9, 10], finished=True), FailedLoad("a", [11])],
    )
    assert ConnectorMetadata.from_wire(wire("meta", meta)) == meta
    older = {k: v for k, v in wire("meta", meta).items() if k != "failed_loads"}
    assert ConnectorMetadata.from_wire(older).failed_loads == []  # optional on the wire
    meta.stores[0].expires_in_s = 29.5
    assert ConnectorMetadata.from_wire(wire("meta", meta)).stores[0].expires_in_s == 29.5
    old_store = {k: v for k, v in wire("meta", meta)["stores"][0].items() if k != "expires_in_s"}
    older = {**wire("meta", meta), "stores": [old_store]}
    assert ConnectorMetadata.from_wire(older).stores[0].expires_in_s is None  # optional
    out = ConnectorWorkerOutput(1, [TransferResult("a", 7, [b"k"])], [TransferResult("b", 8)])
    assert ConnectorWorkerOutput.from_wire(wire("out", out)) == out
    body = wire("meta", meta)
    for bad in (
        {**body, "loads": "x"},
        {**body, "flush_req_ids": [1]},
        {k: v for k, v in body.items() if k != "stores"},
        {**body, "loads": [{**body["loads"][0], "lease_id": True}]},
        {**body, "stores": [{**body["stores"][0], "stores": [{"key": "str", "block_ids": []}]}]},
        {**body, "failed_loads": {"c": [9]}},
        {**body, "failed_loads": [{"req_id": "c", "block_ids": ["9"], "finished": True}]},
        {**body, "failed_loads": [{"req_id": "c", "block_ids": [9], "finished": 1}]},
        {**body, "failed_loads": [{"block_ids": [9], "finished": True}]},
        {**body, "stores": [{**body["stores"][0], "expires_in_s": -1.0}]},
        {**body, "stores": [{**body["stores"][0], "expires_in_s": "30"}]},
        {**body, "stores": [{**body["stores"][0], "expires_in_s": float("nan")}]},
        [],
    ):
        with pytest.raises(InvalidArgument):
            ConnectorMetadata.from_wire(bad)
    with pytest.raises(InvalidArgument):
        ConnectorWorkerOutput.from_wire({"rank": 0, "loads": [{"req_id": "a"}], "stores": []})
