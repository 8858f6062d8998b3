"""Builders for worker tests: a tiny namespace, fake requests, CPU "GPU" KV caches in several
layouts, and a cluster = the real scheduler-side connector + one real worker connector per TP
rank, stepped by hand against a real daemon."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserver.hashing import BlockHasher
from kvserver.namespace import NamespaceSpec
from scheduler.connector_base import TransferReport
from scheduler.kv_connector import KVServerSchedulerConnector
from step_protocol import (
    CachedRequestData,
    ConnectorMetadata,
    NewRequestData,
    StepPlan,
    decode,
    encode,
)
from tests.support.connector import admit, patient_config
from worker.config import WorkerConnectorConfig
from worker.kv_connector import KVServerWorkerConnector
from worker.layout import CanonicalKVCaches

BS = 4  # tokens per GPU block
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
NUM_BLOCKS = 64


def make_spec(model: str, tp: int = 1, chunk_blocks: int = 2) -> NamespaceSpec:
    """2 layers, 2 KV heads of 8 dims, 4 tokens per block, fp16: 1 KiB per block (tp=1)."""
    return NamespaceSpec(
        model=model, dtype="float16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_size=BS, chunk_blocks=chunk_blocks, tp_world_size=tp,
    )  # fmt: skip


def kv_caches(spec: NamespaceSpec, layout: str) -> dict[str, torch.Tensor]:
    """Zeroed KV caches of one rank: ``flash`` (2, blocks, ...) per layer, ``blocks_first``
    (blocks, 2, ...) per layer, or ``cross`` one (blocks, layers, 2, ...) tensor."""
    h = spec.kv_heads_per_rank
    if layout == "flash":
        shape = (2, NUM_BLOCKS, BS, h, HEAD_DIM)
        return {f"layer{i}": torch.zeros(shape, dtype=torch.float16) for i in range(LAYERS)}
    if layout == "blocks_first":
        shape = (NUM_BLOCKS, 2, BS, h, HEAD_DIM)
        return {f"layer{i}": torch.zeros(shape, dtype=torch.float16) for i in range(LAYERS)}
    assert layout == "cross", layout
    return {"all": torch.zeros((NUM_BLOCKS, LAYERS, 2, BS, h, HEAD_DIM), dtype=torch.float16)}


def kv_bytes(block_hash: bytes, rank: int, size: int) -> bytes:
    """The KV a block with this hash has on this rank (what the fake model computes)."""
    seed = hashlib.sha256(block_hash + bytes([rank])).digest()
    return (seed * (size // len(seed) + 1))[:size]


def write_block(c: CanonicalKVCaches, block: int, data: bytes) -> None:
    for view, off, page in zip(c.views, c.offsets, c.page_bytes, strict=True):
        view[block].copy_(torch.frombuffer(bytearray(data[off : off + page]), dtype=torch.uint8))


def read_block(c: CanonicalKVCaches, block: int) -> bytes:
    return b"".join(bytes(view[block].tolist()) for view in c.views)


@dataclass
class FakeRequest:
    """Satisfies the scheduler connector's RequestLike."""

    request_id: str
    all_token_ids: list[int]
    spec: NamespaceSpec
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        hasher = BlockHasher(self.spec.hash_algo, BS, self.spec.hash_seed)
        self.block_hashes = list(hasher.hash_blocks(self.all_token_ids))

    def chunk_keys(self) -> list[bytes]:
        cb = self.spec.chunk_blocks
        return self.block_hashes[cb - 1 :: cb]


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


class Worker:
    """One TP rank: CPU KV caches + the real worker connector."""

    def __init__(self, address: str, spec: NamespaceSpec, rank: int, layout: str,
                 colocated: bool) -> None:  # fmt: skip
        self.rank = rank
        self.conn = KVServerWorkerConnector(
            WorkerConnectorConfig(address, spec, rank, colocated=colocated)
        )
        self.caches = self.conn.register_kv_caches(kv_caches(spec, layout), NUM_BLOCKS)

    def block(self, b: int) -> bytes:
        return read_block(self.caches, b)


Tamper = Callable[[int, ConnectorMetadata], None]


class Cluster:
    """Scheduler connector + workers; :meth:`step` runs one engine step by hand."""

    def __init__(self, address: str, spec: NamespaceSpec, *, layout: str = "flash",
                 colocated: bool = True) -> None:  # fmt: skip
        self.spec = spec
        self.conn = KVServerSchedulerConnector(patient_config(address, spec))
        self.workers = [
            Worker(address, spec, r, layout, colocated) for r in range(spec.tp_world_size)
        ]
        self.blocks: dict[str, list[int]] = {}
        self.sent: set[str] = set()
        self.next_block = 1
        self.step_no = 0

    def close(self) -> None:
        self.conn.close()
        for w in self.workers:
            w.conn.close()

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def admit(self, req: FakeRequest, num_local: int = 0,
              blocks: list[int] | None = None) -> tuple[int | None, bool]:  # fmt: skip
        return admit(self, req, BS, num_local, blocks)

    def plan(self, sched: dict[str, tuple[FakeRequest, int]] | None = None,
             preempted: tuple[str, ...] = ()) -> ConnectorMetadata:  # fmt: skip
        """The scheduler half of a step: the metadata, through the wire format."""
        self.step_no += 1
        new, cached = [], []
        for req_id, (req, _) in (sched or {}).items():
            if req_id not in self.sent:
                self.sent.add(req_id)
                new.append(NewRequestData(req_id, req.all_token_ids, list(self.blocks[req_id]),
                                          req.num_computed_tokens, 16))  # fmt: skip
            else:
                cached.append(CachedRequestData(req_id, [], req.num_computed_tokens, []))
        plan = StepPlan(
            step=self.step_no, new_reqs=new, cached_reqs=cached,
            num_scheduled_tokens={r: n for r, (_, n) in (sched or {}).items()},
            preempted_req_ids=list(preempted),
        )  # fmt: skip
        return self.conn.build_connector_meta(plan)

    def step(
        self,
        sched: dict[str, tuple[FakeRequest, int]] | None = None,
        preempted: tuple[str, ...] = (),
        *,
        tamper: Tamper | None = None,
        sync: bool = False,
        before_forward: Callable[[], None] | None = None,
    ) -> tuple[ConnectorMetadata, TransferReport]:
        """plan → every worker (bind, start_load_kv) → forward pass (writes the KV of full
        blocks) → wait_for_save → reports → update_connector_output. ``sync``: wait for the
        transfers in flight before reporting (deterministic tests)."""
        sched = sched or {}
        meta = self.plan(sched, preempted)
        for w in self.workers:
            _, body = decode(encode("meta", meta))
            mine = ConnectorMetadata.from_wire(body)
            if tamper is not None:
                tamper(w.rank, mine)
            w.conn.bind_connector_metadata(mine)
            w.conn.start_load_kv()
        if before_forward is not None:
            before_forward()
        for req_id, (req, n) in sched.items():
            for b in range(req.num_computed_tokens // BS, (req.num_computed_tokens + n) // BS):
                for w in self.workers:
                    data = kv_bytes(req.block_hashes[b], w.rank, w.caches.block_bytes)
                    write_block(w.caches, self.blocks[req_id][b], data)
            req.num_computed_tokens += n
        outputs = []
        for w in self.workers:
            w.conn.wait_for_save()
            if sync:
                w.conn.wait_inflight()
            outputs.append(w.conn.build_connector_worker_meta())
            w.conn.clear_connector_metadata()
        return meta, self.conn.update_connector_output(outputs)

    def settle(self, max_steps: int = 8) -> TransferReport:
        """Empty synchronous steps until no transfer is pending; the merged report. A store
        completion may be held for ``completion_hold_steps`` steps waiting for a reservation
        to carry it (docs/connector.md), so those steps come on top of ``max_steps``."""
        total = TransferReport()
        for _ in range(max_steps + self.conn.config.completion_hold_steps):
            if not self.conn.has_pending_transfers and not any(
                w.conn.num_pending for w in self.workers
            ):
                return total
            _, r = self.step(sync=True)
            total.finished_recving |= r.finished_recving
            total.finished_sending |= r.finished_sending
            total.load_errors.update(r.load_errors)
            total.invalid_block_ids |= r.invalid_block_ids
        raise AssertionError("transfers still pending")

    def prefill(self, req: FakeRequest) -> None:
        """Admit (a miss), compute all but the last prompt token, store it all."""
        assert self.admit(req) == (0, False)
        self.step({req.request_id: (req, len(req.all_token_ids) - 1)})
        self.settle()

    def assert_same_kv(self, req: FakeRequest, blocks: range, source: Any = None) -> None:
        """Blocks of ``req`` hold the KV its hashes imply on every rank."""
        for w in self.workers:
            for b in blocks:
                want = kv_bytes(req.block_hashes[b], w.rank, w.caches.block_bytes)
                assert w.block(self.blocks[req.request_id][b]) == want, (w.rank, b)
