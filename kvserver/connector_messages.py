"""Messages between the scheduler process and the worker processes (defined once, here).

Both ``scheduler/`` and ``worker/`` import this module; it depends on nothing but the standard
library and msgpack, so neither process pulls in the other's dependencies (the scheduler never
imports torch). Each message is a slots dataclass with ``to_wire()`` / ``from_wire()`` over
plain msgpack-able values; :func:`encode` / :func:`decode` frame them with a type tag and the
protocol version.

Per engine step::

    scheduler ──StepPlan (SchedulerOutput + ConnectorMetadata)──► every worker
    scheduler ◄──StepResult (sampled tokens + ConnectorWorkerOutput)── every worker

Chunk transfers (seed 000 §10–§12). A chunk spans ``chunk_blocks`` GPU blocks and is stored
under its key as one part per TP rank.
- ``ChunkLoad``: copy chunk ``key``'s part for this rank from the daemon into GPU blocks
  ``block_ids``; the first ``skip_blocks`` sub-blocks of the chunk are already on the GPU (a
  partly-cached first chunk) and are not overwritten.
- ``ChunkStore``: copy GPU blocks ``block_ids`` into chunk ``key``'s part for this rank.
Loads and stores carry the daemon lease under which the scheduler pinned / reserved them, plus
for co-located workers the arena extents of every rank's part (``extents[rank]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvserver.errors import InvalidArgument, UnsupportedVersion

STEP_PROTOCOL_VERSION = 1

#: ((offset, length), ...) per rank, as in kvserver.allocator.Extents
RankExtents = list[list[tuple[int, int]]]


@dataclass(slots=True)
class ChunkLoad:
    key: bytes
    block_ids: list[int]
    skip_blocks: int = 0
    extents: RankExtents = field(default_factory=list)


@dataclass(slots=True)
class ChunkStore:
    key: bytes
    block_ids: list[int]
    extents: RankExtents = field(default_factory=list)


@dataclass(slots=True)
class RequestTransfers:
    """All chunk transfers of one request in one step, under one daemon lease."""

    req_id: str
    lease_id: int
    loads: list[ChunkLoad] = field(default_factory=list)
    stores: list[ChunkStore] = field(default_factory=list)


def _to_plain(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {name: _to_plain(getattr(obj, name)) for name in obj.__dataclass_fields__}
    if isinstance(obj, list | tuple):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def encode(kind: str, message: Any) -> bytes:
    """Frame a message dataclass (or plain dict) as msgpack with its kind and version."""
    return msgpack.packb(
        {"v": STEP_PROTOCOL_VERSION, "kind": kind, "body": _to_plain(message)},
        use_bin_type=True,
    )


def decode(data: bytes) -> tuple[str, dict[str, Any]]:
    """Unframe; returns (kind, body) with the body as plain values. Raises InvalidArgument."""
    try:
        frame = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidArgument(f"undecodable step message: {exc}") from None
    if not isinstance(frame, dict) or "v" not in frame:
        raise InvalidArgument("step message is not a versioned map")
    if frame["v"] != STEP_PROTOCOL_VERSION:
        raise UnsupportedVersion("step protocol version mismatch", got=frame["v"],
                                 want=STEP_PROTOCOL_VERSION)
    kind, body = frame.get("kind"), frame.get("body")
    if not isinstance(kind, str) or not isinstance(body, dict):
        raise InvalidArgument("step message needs a kind and a body map")
    return kind, body
