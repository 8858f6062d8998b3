"""The worker process: one TP rank of a real model behind the scheduler's step protocol.

Structure follows the synthetic worker (scheduler/synthetic.py): a ZMQ ROUTER bound at
``--listen`` that the scheduler's DEALER connects to, serving one message at a time.

Start-up: join the TP process group (gloo on CPU, nccl on CUDA; every rank must start) → load
this rank's shard of the model → bind → write the ready file. ``hello`` (WorkerHello) →
allocate the paged KV caches for ``num_gpu_blocks`` blocks of ``block_size`` tokens (reused
when unchanged), with ``--kvserver`` build the worker-side connector
(:class:`~worker.kv_connector.KVServerWorkerConnector`) over the namespace the scheduler derives
from our ``WorkerInfo`` and register the caches, forget every request → reply WorkerInfo.
``step`` (StepPlan) → update request state → bind connector metadata → ``start_load_kv`` →
forward over every scheduled token → ``wait_for_save`` → ``build_connector_worker_meta`` →
StepResult with the greedy tokens. ``stop``, SIGTERM or SIGINT → wait for the connector's
transfers in flight (stores still deferred are dropped: nobody would complete them, and the
scheduler may have released their leases) → close → exit 0.

Every rank receives the same plan, so every rank runs the same collectives in the same order.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserver.crypto import CurveClient, CurveServer
from kvserver.errors import InvalidArgument
from kvserver.namespace import NamespaceSpec
from step_protocol import (
    ConnectorMetadata,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerInfo,
)
from step_protocol.limits import DEFAULT_WORKER_LIMIT_BYTES
from step_protocol.serve import serve_steps
from worker.config import WorkerConnectorConfig
from worker.kv_connector import KVServerWorkerConnector
from worker.model import SeqInput, TransformerModel, sample_greedy

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVServerSettings:
    """How to reach kvserver and the namespace fields the hello does not carry (they must
    match the scheduler's ``--chunk-blocks``, ``--hash-algo``, ``--hash-seed``)."""

    address: str
    chunk_blocks: int = 1
    hash_algo: str = "sha256_cbor"
    hash_seed: str = "vllm-none-hash"
    #: the daemon's token ("": the one a daemon on this host left for its user)
    auth_token: str = ""
    #: CURVE settings for a daemon that uses CURVE (docs/security.md)
    curve: CurveClient | None = None
    #: CUDA: staged copies address the page-locked arena from indexed kernels (docs/worker.md)
    host_kernels: bool = True


@dataclass(slots=True)
class _ReqState:
    tokens: list[int]
    block_ids: list[int]


class ModelWorker:
    """One rank: the model, its paged KV caches, the connector, per-request state."""

    def __init__(self, model: TransformerModel, kvserver: KVServerSettings | None = None) -> None:
        self.model = model
        self.rank = model.rank
        self.kvserver = kvserver
        self.caches: list[torch.Tensor] = []
        self.connector: KVServerWorkerConnector | None = None
        self._shape: tuple[int, int, str] | None = None  # (blocks, block size, model name)
        self._reqs: dict[str, _ReqState] = {}

    def hello(self, msg: WorkerHello) -> WorkerInfo:
        """Adopt the scheduler's view: (re)allocate caches if their shape changed, forget every
        request. InvalidArgument if the scheduler's rank/world size are not ours."""
        if msg.rank != self.rank or msg.world_size != self.model.world_size:
            raise InvalidArgument(
                "hello for another rank or world size",
                rank=msg.rank, world_size=msg.world_size,
                ours=(self.rank, self.model.world_size),
            )  # fmt: skip
        shape = (msg.num_gpu_blocks, msg.block_size, msg.model)
        if shape != self._shape:
            self._close_connector()
            self.caches = self.model.allocate_kv_caches(msg.num_gpu_blocks, msg.block_size)
            self._shape = shape
            if self.kvserver is not None:
                self.connector = self._make_connector(msg)
        elif self.connector is not None:
            # the scheduler forgot every transfer and released their leases: copy none of
            # the deferred stores into pages the daemon may have given to other chunks
            self.connector.forget()
        self._reqs.clear()
        vocab = self.model.config.vocab_size
        return WorkerInfo(self.rank, os.getpid(), vocab, dict(self.model.kv_layout()))

    def _make_connector(self, msg: WorkerHello) -> KVServerWorkerConnector:
        assert self.kvserver is not None
        layout = self.model.kv_layout()
        spec = NamespaceSpec(
            model=msg.model or "synthetic",
            dtype=str(layout["dtype"]),
            num_layers=int(layout["num_layers"]),
            num_kv_heads=int(layout["num_kv_heads"]),
            head_dim=int(layout["head_dim"]),
            block_size=msg.block_size,
            chunk_blocks=self.kvserver.chunk_blocks,
            hash_algo=self.kvserver.hash_algo,
            hash_seed=self.kvserver.hash_seed,
            tp_world_size=msg.world_size,
        )
        kv = self.kvserver
        config = WorkerConnectorConfig(
            kv.address,
            spec,
            rank=self.rank,
            auth_token=kv.auth_token,
            curve=kv.curve,
            host_kernels=kv.host_kernels,
        )
        conn = KVServerWorkerConnector(config)
        try:
            names = {f"layer{i}": t for i, t in enumerate(self.caches)}
            conn.register_kv_caches(names, msg.num_gpu_blocks, block_dim=1)
        except BaseException:
            conn.close()
            raise
        logger.info("rank %d: kvserver connector on %s (namespace %s, %s)", self.rank,
                    self.kvserver.address, spec.ns_id,
                    "co-located" if conn.is_colocated else "remote")  # fmt: skip
        return conn

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. InvalidArgument for a plan inconsistent with earlier ones (raised
        before any collective, identically on every rank)."""
        if self._shape is None:
            raise InvalidArgument("step before hello")
        seqs, order = self._update_state(plan)
        conn = self.connector
        if conn is not None:
            meta = plan.connector_meta
            if meta is not None and not isinstance(meta, ConnectorMetadata):
                meta = ConnectorMetadata.from_wire(meta)
            conn.bind_connector_metadata(meta or ConnectorMetadata())
            conn.start_load_kv()
        sampled: dict[str, int] = {}
        if seqs:
            logits = self.model.forward(seqs, self.caches)
            sampled = dict(zip(order, sample_greedy(logits), strict=True))
        output = None
        if conn is not None:
            conn.wait_for_save()
            output = conn.build_connector_worker_meta()
            conn.clear_connector_metadata()
        return StepResult(plan.step, self.rank, sampled, output)

    def _update_state(self, plan: StepPlan) -> tuple[list[SeqInput], list[str]]:
        reqs = self._reqs
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            reqs.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in plan.new_reqs:
            reqs[new.req_id] = _ReqState(
                [*new.prompt_token_ids, *new.output_token_ids], list(new.block_ids)
            )
            computed[new.req_id] = new.num_computed_tokens
        for cached in plan.cached_reqs:
            state = reqs.get(cached.req_id)
            if state is None:
                raise InvalidArgument("step names an unknown request", req=cached.req_id)
            state.block_ids += cached.new_block_ids
            start = cached.num_computed_tokens
            if start > len(state.tokens):
                raise InvalidArgument("tokens skipped", req=cached.req_id, start=start)
            del state.tokens[start:]  # the scheduler is the source of truth for tokens
            state.tokens += cached.token_ids
            computed[cached.req_id] = start
        num_blocks, block_size, _ = self._shape or (0, 0, "")
        seqs: list[SeqInput] = []
        order: list[str] = []
        for req_id, n in plan.num_scheduled_tokens.items():
            state = reqs.get(req_id)
            if state is None or req_id not in computed:
                raise InvalidArgument("scheduled request without data", req=req_id)
            start = computed[req_id]
            end = start + n
            if n < 1 or end > len(state.tokens):
                raise InvalidArgument("scheduled beyond the known tokens", req=req_id, end=end)
            if end > len(state.block_ids) * block_size:
                raise InvalidArgument("block table too short", req=req_id, end=end)
            if any(not 0 < b < num_blocks for b in state.block_ids):
                raise InvalidArgument("bad block id", req=req_id)
            seqs.append(SeqInput(state.tokens[start:end], start, state.block_ids))
            order.append(req_id)
        return seqs, order

    def _close_connector(self) -> None:
        conn, self.connector = self.connector, None
        if conn is not None:
            try:
                # stores it still holds would never be reported (nor completed), and the
                # scheduler may have released their leases already: dropped, not copied
                conn.forget()
            finally:
                conn.close()

    def close(self) -> None:
        """Wait for the transfers in flight, drop the deferred stores, release the connector."""
        self._close_connector()


def init_distributed(
    rank: int, world_size: int, init_method: str, device: str, timeout_s: float = 60.0
) -> None:
    """Join the TP group (gloo on CPU, nccl on CUDA); a no-op for a world of one."""
    if world_size == 1:
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # The rendezvous waits for the other ranks (up to timeout_s) inside torch's C++, where
    # Python's SIGINT handler never runs: Ctrl-C did nothing. There, SIGINT ends the process as
    # it ends any command (an ignored SIGINT, a background job's, stays ignored).
    handler = signal.getsignal(signal.SIGINT)
    default = handler is signal.default_int_handler
    default = default and threading.current_thread() is threading.main_thread()
    if default:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    logger.info("rank %d of %d: waiting for the other ranks at %s (at most %g s)",
                rank, world_size, init_method, timeout_s)  # fmt: skip
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    finally:
        if default:
            signal.signal(signal.SIGINT, handler)


def serve(
    worker: ModelWorker,
    listen: str,
    *,
    ready_file: str | None,
    curve: CurveServer | None = None,
    no_auth: bool = False,
    max_message_bytes: int = DEFAULT_WORKER_LIMIT_BYTES,
) -> int:
    """Serve the step protocol on a ROUTER bound at ``listen`` (a CURVE server with
    ``curve``; else, on ``tcp://``, requiring its step token unless ``no_auth``; taking plans
    up to ``max_message_bytes``) until ``stop`` or a signal
    (:func:`step_protocol.serve.serve_steps`); closes ``worker`` on the way out."""
    serve_steps(
        worker, listen, ready_file=ready_file, ready_info={"rank": worker.rank},
        on_exit=worker.close, curve=curve, no_auth=no_auth,
        max_message_bytes=max_message_bytes,
    )  # fmt: skip
    logger.info("worker rank %d stopped", worker.rank)
    return 0
