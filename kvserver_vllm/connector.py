"""KVServerConnector: kvserver as a vLLM V1 KV connector.

Load it with one line (docs/vllm.md)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvserver_vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "tcp://127.0.0.1:7070"}}'

vLLM builds one instance per role. The **scheduler** instance wraps
:class:`~scheduler.kv_connector.KVServerSchedulerConnector` (lookups, pins, store planning,
lease completion); each **worker** instance wraps
:class:`~worker.kv_connector.KVServerWorkerConnector` (the copies between the paged KV cache
and kvserver). Configuration: :mod:`kvserver_vllm.config`.

How the two halves' verdicts reach vLLM's scheduler:

- A load is over on a rank when that rank's transfer ends: the worker reports the request in
  ``get_finished`` (receiving) and the GPU blocks of chunks it could not fill in
  ``get_block_ids_with_load_errors``; vLLM waits for every rank (its ``KVOutputAggregator``)
  and recomputes from the first failed block (``kv_load_failure_policy="recompute"``). The
  same per-rank results travel to the scheduler connector as worker metadata
  (:class:`KVServerWorkerMetadata`, aggregated by vLLM), which completes the daemon leases.
- A hit the scheduler connector could not pin never reaches a worker as a transfer; the
  metadata names it (``failed_loads``) and every worker reports it, so vLLM's accounting stays
  per rank.
- A request that finishes with stores in flight keeps its GPU blocks (``request_finished``
  returns True); the next metadata names it, and each worker reports it as finished sending
  once its own stores of the request are over. A request that finishes while its load is in
  flight is held by vLLM itself until the load is reported, so it is not held twice.

Thread-safety: vLLM calls each instance from one thread. Nothing here blocks for longer than
the configured timeouts; a daemon that is down costs one lookup timeout per back-off period and
vLLM keeps scheduling (no hits, no stores).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvserver.errors import KVServerError
from kvserver_vllm.config import PluginConfig, load_config
from kvserver_vllm.steps import EventSource, VllmStep
from scheduler.kv_connector import KVServerSchedulerConnector
from step_protocol import ConnectorMetadata, ConnectorWorkerOutput, FailedLoad
from worker.kv_connector import KVServerWorkerConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVServerConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, every step: the connector's plan (``inner``) and the requests that
    finished holding their blocks for stores (``delayed_req_ids``)."""

    def __init__(self, inner: ConnectorMetadata, delayed_req_ids: list[str]) -> None:
        self.inner = inner
        self.delayed_req_ids = delayed_req_ids


class KVServerWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler: what each rank finished (vLLM aggregates the ranks' objects)."""

    def __init__(self, outputs: list[ConnectorWorkerOutput]) -> None:
        self.outputs = outputs

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVServerWorkerMetadata:
        if not isinstance(other, KVServerWorkerMetadata):
            return self
        return KVServerWorkerMetadata(self.outputs + other.outputs)


class KVServerConnector(KVConnectorBase_V1, SupportsHMA):
    """kvserver's vLLM connector; see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config: PluginConfig = load_config(vllm_config, kv_cache_config)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self.scheduler_half: KVServerSchedulerConnector | None = None
        self.worker_half: KVServerWorkerConnector | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_half = KVServerSchedulerConnector(self.config.scheduler)
        else:
            self.worker_half = KVServerWorkerConnector(self.config.worker(_tp_rank()))
        spec = self.config.spec
        # scheduler state
        self._events = EventSource(spec.block_size, spec.chunk_blocks)
        self._requests: dict[str, Request] = {}
        self._delayed: set[str] = set()
        self._delayed_new: list[str] = []
        self._unpinnable: list[FailedLoad] = []
        # worker state
        self._awaiting_send: set[str] = set()
        self._relayed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._unreported: list[ConnectorWorkerOutput] = []

    # ================================================================ scheduler side

    @property
    def _sched(self) -> KVServerSchedulerConnector:
        assert self.scheduler_half is not None, "a scheduler-side method on a worker"
        return self.scheduler_half

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests.setdefault(request.request_id, request)
        if not self._kv_transfer_config.is_kv_consumer:
            return 0, False  # kv_producer: this instance only stores
        hit, is_async = self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        if hit is not None and 0 < hit < self.config.min_hit_tokens:
            return 0, False  # too short to be worth a load (the plan is dropped on alloc)
        return hit, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = list(blocks.get_block_ids()[0])
        try:
            self._sched.update_state_after_alloc(request, block_ids, num_external_tokens)
        except KVServerError as exc:
            if not num_external_tokens:
                raise
            # vLLM changed the hit we offered (it may cap it); load nothing, recompute it.
            logger.warning("cannot load the hit of %s, recomputing: %s", request.request_id, exc)
            bs = self.config.spec.block_size
            first = request.num_computed_tokens // bs
            last = -(-(request.num_computed_tokens + num_external_tokens) // bs)
            self._unpinnable.append(FailedLoad(request.request_id, block_ids[first:last], True))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        inner = self._sched.build_connector_meta(VllmStep.of(scheduler_output))
        inner.failed_loads += self._unpinnable
        self._unpinnable = []
        for t in inner.stores:
            if (request := self._requests.get(t.req_id)) is not None:
                self._events.record(request, (c.key for c in t.stores))
        meta = KVServerConnectorMetadata(inner, self._delayed_new)
        self._delayed_new = []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        outputs = worker_meta.outputs if isinstance(worker_meta, KVServerWorkerMetadata) else []
        # vLLM learns of finished transfers from the workers' own reports; the scheduler
        # connector's report only repeats them (failed pins were shipped as failed_loads).
        self._sched.update_connector_output(outputs)
        for req_id in connector_output.finished_sending or ():
            self._delayed.discard(req_id)
            self._forget(req_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        delay, _ = self._sched.request_finished(request, block_ids)
        if delay and self._sched.num_pending(req_id)[1]:
            self._delayed.add(req_id)
            self._delayed_new.append(req_id)
            return True, None
        # nothing in flight, or only a load: vLLM holds the blocks until it is reported
        self._forget(req_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> Iterable[Any]:
        events = self._sched.take_events()
        if not events:
            return ()
        return self._events.convert(
            events, (VllmBlockStored, VllmBlockRemoved, maybe_convert_block_hash)
        )

    def has_pending_block_frees(self) -> bool:
        """Finished requests hold blocks until their stores are over: wait, do not preempt."""
        return bool(self._delayed)

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._events.forget(req_id)

    # ================================================================ worker side

    @property
    def _worker(self) -> KVServerWorkerConnector:
        assert self.worker_half is not None, "a worker-side method on the scheduler"
        return self.worker_half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, self._num_blocks)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVServerConnectorMetadata):
            self._worker.flush(kv_connector_metadata.inner)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVServerConnectorMetadata)
        self._worker.bind_connector_metadata(connector_metadata.inner)
        self._awaiting_send.update(connector_metadata.delayed_req_ids)
        for failed in connector_metadata.inner.failed_loads:
            self._load_errors.update(failed.block_ids)
            if failed.finished:
                self._relayed_recving.add(failed.req_id)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete before the request runs (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole chunks are stored after the step (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) on this rank since the last call. The only
        place that polls the worker half: the same results go to the scheduler connector in
        this pass's ``build_connector_worker_meta``, so both see every transfer once."""
        report = self._worker.build_connector_worker_meta()
        if report.loads or report.stores:
            self._unreported.append(report)
        recving = {r.req_id for r in report.loads} | self._relayed_recving
        self._relayed_recving = set()
        sending = {r for r in self._awaiting_send if not self._worker.stores_pending(r)}
        self._awaiting_send -= sending
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._load_errors |= self._worker.take_load_error_block_ids()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """What ``get_finished`` polled since the previous call, for the scheduler side."""
        if not self._unreported:
            return None
        reports, self._unreported = self._unreported, []
        merged = ConnectorWorkerOutput(reports[0].rank)
        for report in reports:
            merged.loads += report.loads
            merged.stores += report.stores
        return KVServerWorkerMetadata([merged])

    # ================================================================ both

    def shutdown(self) -> None:
        if self.scheduler_half is not None:
            self.scheduler_half.close()
        if self.worker_half is not None:
            self.worker_half.drain()
            self.worker_half.close()


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 before vLLM set up its process groups)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0
