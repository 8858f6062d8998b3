"""The worker role of the vLLM plug-in (:class:`KVServerConnectorWorker`).

Runs in each vLLM worker process (one per TP rank), called from one thread by
:class:`~kvserver_vllm.connector.KVServerConnector` (built with ``KVConnectorRole.WORKER``). It
adapts vLLM's calls to :class:`~worker.kv_connector.KVServerWorkerConnector` (the copies
between the paged KV cache and kvserver) and keeps what vLLM's per-rank accounting needs on
top: the requests to report as finished sending once their stores are over, the failed pins to
relay as finished receiving and load errors, and the reports polled by ``get_finished`` that
still have to reach the scheduler role.

Invariant: every report ``get_finished`` polls from the worker half goes to the scheduler role
exactly once, in the next ``build_connector_worker_meta``.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvserver_vllm.config import PluginConfig
from kvserver_vllm.metadata import KVServerConnectorMetadata, KVServerWorkerMetadata
from step_protocol import ConnectorWorkerOutput
from worker.kv_connector import KVServerWorkerConnector


class KVServerConnectorWorker:
    """The worker-side methods of ``KVServerConnector``; see the module docstring."""

    def __init__(self, config: PluginConfig, tp_rank: int, num_blocks: int) -> None:
        self.connector = KVServerWorkerConnector(config.worker(tp_rank))
        self._num_blocks = num_blocks
        self._awaiting_send: set[str] = set()
        self._relayed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._unreported: list[ConnectorWorkerOutput] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector.register_kv_caches(kv_caches, self._num_blocks)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        if isinstance(metadata, KVServerConnectorMetadata):
            self.connector.flush(metadata.inner)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, KVServerConnectorMetadata)
        self.connector.bind_connector_metadata(metadata.inner)
        self._awaiting_send.update(metadata.delayed_req_ids)
        for failed in metadata.inner.failed_loads:
            self._load_errors.update(failed.block_ids)
            if failed.finished:
                self._relayed_recving.add(failed.req_id)

    def clear_connector_metadata(self) -> None:
        self.connector.clear_connector_metadata()

    def start_load_kv(self) -> None:
        self.connector.start_load_kv()

    def wait_for_save(self) -> None:
        self.connector.wait_for_save()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) on this rank since the last call. The only
        place that polls the worker half: the same results go to the scheduler role in this
        pass's ``build_connector_worker_meta``, so both see every transfer once."""
        report = self.connector.build_connector_worker_meta()
        if report.loads or report.stores:
            self._unreported.append(report)
        recving = {r.req_id for r in report.loads} | self._relayed_recving
        self._relayed_recving = set()
        sending = {r for r in self._awaiting_send if not self.connector.stores_pending(r)}
        self._awaiting_send -= sending
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._load_errors |= self.connector.take_load_error_block_ids()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVServerWorkerMetadata | None:
        """What ``get_finished`` polled since the previous call, for the scheduler role."""
        if not self._unreported:
            return None
        reports, self._unreported = self._unreported, []
        merged = ConnectorWorkerOutput(reports[0].rank)
        for report in reports:
            merged.loads += report.loads
            merged.stores += report.stores
        return KVServerWorkerMetadata([merged])

    def shutdown(self) -> None:
        self.connector.drain()
        self.connector.close()
