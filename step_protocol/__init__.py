"""The scheduler ↔ worker step protocol, defined once; both ``scheduler/`` and ``worker/``
(and the vLLM plug-in) import it, and ``kvserver/`` does not.

It depends on nothing but the standard library, msgpack, ``kvserver.errors`` and
``kvserver.files`` (and zmq, imported by ``serve`` when called), so neither
process pulls in the other's dependencies (the scheduler never imports torch). Each message is
a slots dataclass with ``to_wire()`` / ``from_wire()`` over plain msgpack-able values;
:func:`encode` / :func:`decode` frame them with a type tag and the protocol version.

- ``codec``: framing (version, kind, body) and the field checks of every ``from_wire``;
- ``connector``: the KV connector's messages (ConnectorMetadata: chunk loads and stores under
  daemon leases; ConnectorWorkerOutput: what each rank finished);
- ``step``: the per-step messages (WorkerHello / WorkerInfo, StepPlan / StepResult);
- ``serve``: the worker end's ROUTER loop (the model worker and the synthetic one run it);
- ``security``, ``step_auth``: the channel's CURVE options and its default token on loopback
  (``step_auth`` imports zmq and the daemon's token and ZAP code; imported by ``serve`` when
  called and by the scheduler's ``workers``, never by this package's ``__init__``).
"""

from __future__ import annotations

from step_protocol.codec import STEP_PROTOCOL_VERSION, decode, encode, encode_body
from step_protocol.connector import (
    ChunkLoad,
    ChunkStore,
    ConnectorMetadata,
    ConnectorWorkerOutput,
    FailedLoad,
    RankExtents,
    RequestTransfers,
    TransferResult,
)
from step_protocol.step import (
    KIND_ERROR,
    KIND_HELLO,
    KIND_RESULT,
    KIND_STEP,
    KIND_STOP,
    CachedRequestData,
    NewRequestData,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerInfo,
)

__all__ = [
    "KIND_ERROR",
    "KIND_HELLO",
    "KIND_RESULT",
    "KIND_STEP",
    "KIND_STOP",
    "STEP_PROTOCOL_VERSION",
    "CachedRequestData",
    "ChunkLoad",
    "ChunkStore",
    "ConnectorMetadata",
    "ConnectorWorkerOutput",
    "FailedLoad",
    "NewRequestData",
    "RankExtents",
    "RequestTransfers",
    "StepPlan",
    "StepResult",
    "TransferResult",
    "WorkerHello",
    "WorkerInfo",
    "decode",
    "encode",
    "encode_body",
]
