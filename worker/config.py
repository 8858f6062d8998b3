"""Configuration of the worker-side connector (worker/kv_connector.py).

Plain data, validated on construction; shared by the worker process and tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserver.crypto import CurveClient
from kvserver.errors import InvalidArgument
from kvserver.namespace import NamespaceSpec


@dataclass(frozen=True, slots=True)
class WorkerConnectorConfig:
    """Where the daemon is, the model's namespace, and which TP rank this worker is.

    ``colocated``: None = map the arena when the daemon is on this host, False = always use
    payload frames, True = require the arena. ``defer_stores``: submit a step's stores at the
    start of the next step rather than at once. ``host_kernels``: on CUDA, staged copies
    read and write page-locked host memory from indexed kernels instead of one DMA per arena
    extent where the extents are small (docs/worker.md, "Copies").
    """

    address: str
    spec: NamespaceSpec
    rank: int = 0
    colocated: bool | None = None
    defer_stores: bool = True
    timeout_s: float = 10.0
    auth_token: str = ""
    client_id: str | None = None
    #: CURVE settings for the daemon's data plane (None: plain TCP; docs/security.md)
    curve: CurveClient | None = None
    host_kernels: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.spec.tp_world_size:
            raise InvalidArgument("rank out of range", rank=self.rank,
                                  tp_world_size=self.spec.tp_world_size)  # fmt: skip
        if not self.timeout_s > 0:
            raise InvalidArgument("timeout_s must be > 0", value=self.timeout_s)
