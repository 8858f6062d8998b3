"""The scheduler role of the vLLM plug-in (:class:`KVServerConnectorScheduler`).

Runs in vLLM's scheduler process, called from one thread by
:class:`~kvserver_vllm.connector.KVServerConnector` (built with ``KVConnectorRole.SCHEDULER``).
It adapts vLLM's calls to :class:`~scheduler.kv_connector.KVServerSchedulerConnector`
(lookups, pins, store planning, lease completion) and keeps only what vLLM needs on top: the
vLLM requests (for its KV events), the requests that finished holding their blocks for stores,
and the hits that could not be pinned after vLLM changed them.

Invariants: a request is in ``_delayed`` from ``request_finished`` returning True until vLLM
reports it in ``finished_sending``; every hit refused by ``update_state_after_alloc`` reaches
the workers once, in the next metadata's ``failed_loads``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvserver.errors import KVServerError
from kvserver_vllm.config import PluginConfig
from kvserver_vllm.metadata import KVServerConnectorMetadata, KVServerWorkerMetadata
from kvserver_vllm.steps import EventSource, VllmStep
from scheduler.kv_connector import KVServerSchedulerConnector
from step_protocol import FailedLoad

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVServerConnectorScheduler:
    """The scheduler-side methods of ``KVServerConnector``; see the module docstring."""

    def __init__(self, config: PluginConfig, *, is_consumer: bool) -> None:
        """``is_consumer``: vLLM's ``kv_transfer_config.is_kv_consumer`` (a pure producer
        only stores)."""
        self.config = config
        self.connector = KVServerSchedulerConnector(config.scheduler)
        self._is_consumer = is_consumer
        spec = config.spec
        self._events = EventSource(spec.block_size, spec.chunk_blocks)
        self._requests: dict[str, Request] = {}
        self._delayed: set[str] = set()
        self._delayed_new: list[str] = []
        self._unpinnable: list[FailedLoad] = []

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests.setdefault(request.request_id, request)
        if not self._is_consumer:
            return 0, False  # kv_producer: this instance only stores
        hit, is_async = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if hit is not None and 0 < hit < self.config.min_hit_tokens:
            return 0, False  # too short to be worth a load (the plan is dropped on alloc)
        return hit, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens:
            self._events.index(request)  # a chunk the pin finds gone is removed by its blocks
        try:
            self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)
        except KVServerError as exc:
            if not num_external_tokens:
                raise
            # vLLM changed the hit we offered (it may cap it); load nothing, recompute it:
            # the blocks after the local hit the lookup started from (vLLM sets
            # request.num_computed_tokens only after this call: 0 for a new request)
            logger.warning("cannot load the hit of %s, recomputing: %s", request.request_id, exc)
            bs = self.config.spec.block_size
            local = self.connector.offered_local_tokens(request.request_id)
            first = local // bs
            last = -(-(local + num_external_tokens) // bs)
            self._unpinnable.append(FailedLoad(request.request_id, block_ids[first:last], True))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVServerConnectorMetadata:
        inner = self.connector.build_connector_meta(VllmStep.of(scheduler_output))
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
        self.connector.update_connector_output(outputs)
        for req_id in connector_output.finished_sending or ():
            self._delayed.discard(req_id)
            self._forget(req_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        delay, _ = self.connector.request_finished(request, block_ids)
        if delay and self.connector.num_pending(req_id)[1]:
            self._delayed.add(req_id)
            self._delayed_new.append(req_id)
            return True, None
        # nothing in flight, or only a load: vLLM holds the blocks until it is reported
        self._forget(req_id)
        return False, None

    def take_events(self) -> Iterable[Any]:
        events = self.connector.take_events()
        if not events:
            return ()
        return self._events.convert(
            events, (VllmBlockStored, VllmBlockRemoved, maybe_convert_block_hash)
        )

    def has_pending_block_frees(self) -> bool:
        """Finished requests hold blocks until their stores are over: wait, do not preempt."""
        return bool(self._delayed)

    def shutdown(self) -> None:
        self.connector.close()

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._events.forget(req_id)
