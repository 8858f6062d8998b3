"""What vLLM carries between the plug-in's two roles (built by one, read by the other).

- :class:`KVServerConnectorMetadata`: scheduler role → every worker, each step (vLLM's
  ``KVConnectorMetadata``);
- :class:`KVServerWorkerMetadata`: each worker → the scheduler role (vLLM's
  ``KVConnectorWorkerMetadata``, aggregated over the ranks by vLLM).

Plain value holders over the step protocol's messages; no state, no I/O.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from step_protocol import ConnectorMetadata, ConnectorWorkerOutput


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
