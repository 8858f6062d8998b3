"""KVServerConnector: kvserver as a vLLM V1 KV connector.

Load it with one line (docs/vllm.md)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvserver_vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "tcp://127.0.0.1:7070"}}'

vLLM builds one instance per role, and this class only delegates by role, as vLLM's own
OffloadingConnector does: the **scheduler** instance holds a
:class:`~kvserver_vllm.scheduler_role.KVServerConnectorScheduler` (over
:class:`~scheduler.kv_connector.KVServerSchedulerConnector`: lookups, pins, store planning,
lease completion); each **worker** instance a
:class:`~kvserver_vllm.worker_role.KVServerConnectorWorker` (over
:class:`~worker.kv_connector.KVServerWorkerConnector`: the copies between the paged KV cache
and kvserver). Each role keeps its own bookkeeping; what passes between them is
:mod:`kvserver_vllm.metadata`. Configuration: :mod:`kvserver_vllm.config`.

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
  once its own stores of the request are over (stores of the bound metadata count even
  before ``wait_for_save`` queued them: vLLM's model runners with a speculator collect the
  results first). A request that finishes while its load is in
  flight is held by vLLM itself until the load is reported, so it is not held twice.

Thread-safety: vLLM calls each instance from one thread. Nothing here blocks for longer than
the configured timeouts; a daemon that is down costs one lookup timeout per back-off period and
vLLM keeps scheduling (no hits, no stores).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvserver_vllm.config import PluginConfig, load_config
from kvserver_vllm.metadata import KVServerConnectorMetadata, KVServerWorkerMetadata
from kvserver_vllm.scheduler_role import KVServerConnectorScheduler
from kvserver_vllm.worker_role import KVServerConnectorWorker
from scheduler.kv_connector import KVServerSchedulerConnector
from worker.kv_connector import KVServerWorkerConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVServerConnector", "KVServerConnectorMetadata", "KVServerWorkerMetadata"]


class KVServerConnector(KVConnectorBase_V1, SupportsHMA):
    """kvserver's vLLM connector; see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config: PluginConfig = load_config(vllm_config, kv_cache_config)
        self.connector_scheduler: KVServerConnectorScheduler | None = None
        self.connector_worker: KVServerConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVServerConnectorScheduler(
                self.config, is_consumer=bool(self._kv_transfer_config.is_kv_consumer)
            )
        else:
            self.connector_worker = KVServerConnectorWorker(
                self.config, _tp_rank(), int(kv_cache_config.num_blocks)
            )

    @property
    def scheduler_half(self) -> KVServerSchedulerConnector | None:
        """The project's scheduler connector under the scheduler role (None on a worker)."""
        role = self.connector_scheduler
        return None if role is None else role.connector

    @property
    def worker_half(self) -> KVServerWorkerConnector | None:
        """The project's worker connector under the worker role (None on the scheduler)."""
        role = self.connector_worker
        return None if role is None else role.connector

    # ================================================================ scheduler side

    @property
    def _sched(self) -> KVServerConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side method on a worker"
        return self.connector_scheduler

    def on_new_request(self, request: Request) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> Iterable[Any]:
        return self._sched.take_events()

    def has_pending_block_frees(self) -> bool:
        """Finished requests hold blocks until their stores are over: wait, do not preempt."""
        return self._sched.has_pending_block_frees()

    # ================================================================ worker side

    @property
    def _worker(self) -> KVServerConnectorWorker:
        assert self.connector_worker is not None, "a worker-side method on the scheduler"
        return self.connector_worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_connector_metadata(connector_metadata)

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
        """(finished sending, finished receiving) on this rank since the last call."""
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta()

    # ================================================================ both

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 before vLLM set up its process groups)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0
