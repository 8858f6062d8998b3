"""The KV connector's messages: ConnectorMetadata (scheduler connector → every worker, inside
the step plan) and ConnectorWorkerOutput (each worker → scheduler connector, inside the step
result). Producer: scheduler/kv_connector.py; consumers: worker/kv_connector.py and the vLLM
plug-in. See docs/connector.md.

Chunk transfers. A chunk spans ``chunk_blocks`` GPU blocks and is stored
under its key as one part per TP rank.
- ``ChunkLoad``: copy chunk ``key``'s part for this rank from the daemon into GPU blocks
  ``block_ids``; the first ``skip_blocks`` sub-blocks of the chunk are already on the GPU (a
  partly-cached first chunk) and are not overwritten.
- ``ChunkStore``: copy GPU blocks ``block_ids`` into chunk ``key``'s part for this rank.
Loads and stores carry the daemon lease under which the scheduler pinned / reserved them, the
daemon incarnation that granted it (``granted_by``), plus for co-located workers the arena
extents of every rank's part (``extents[rank]``).

Part layout: a chunk's part for one rank is its ``chunk_blocks`` GPU blocks in order, block j at
bytes [j * block_bytes, (j + 1) * block_bytes). ``ChunkStore.block_ids[j]`` is the GPU block of
sub-block j (exactly ``chunk_blocks`` ids). ``ChunkLoad.block_ids[j]`` receives sub-block
``skip_blocks + j`` (1 to ``chunk_blocks - skip_blocks`` ids): the skipped leading sub-blocks of
a partly-cached first chunk are neither read into nor overwritten on the GPU, and a load that
ends inside its last chunk (the offer stops before the prompt's last token) lists fewer ids:
its trailing sub-blocks are not read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserver.errors import InvalidArgument
from step_protocol.codec import (
    as_map,
    checked,
    count,
    count_list,
    to_plain,
    typed_field,
)

#: ((offset, length), ...) per rank, as in kvserver.allocator.Extents (a grant's location as
#: it is: tuples or lists)
RankExtents = Sequence[Sequence[tuple[int, int]]]


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
class FailedLoad:
    """A load the scheduler connector could not pin (wholly, or some trailing chunks): the
    GPU blocks ``block_ids`` of request ``req_id`` will not be filled. ``finished``: nothing of
    the request's load was shipped (its load is over now); otherwise a shipped load of the
    same request covers the chunks that were pinned."""

    req_id: str
    block_ids: list[int]
    finished: bool = False


@dataclass(slots=True)
class RequestTransfers:
    """All chunk transfers of one request in one step, under one daemon lease.

    ``granted_by``: the daemon incarnation that granted the lease (its session id ``sid``,
    :attr:`kvserver.grants.LoadGrant.granted_by`); "" when the producer does not say. The
    lease id and the extents are that incarnation's: a co-located worker copies only if the
    arena it has mapped belongs to it, and otherwise fails the transfer (never reading or
    writing another arena at these offsets).

    ``expires_in_s``: the lease time left when the producer shipped the metadata; None when
    it does not say (older producers; before loads carried it, stores only). A co-located
    worker does not start copying into a store's extents, nor out of a load's, once that
    much time has passed since it received the metadata, and fails a load whose copies it
    saw landed only after then: the daemon has rolled the reservation back or dropped the
    load's pins by then, and after a quarantine hands their pages to other keys, so the
    transfer fails instead (reported in ``failed_keys``; a load's tokens are recomputed).
    """

    req_id: str
    lease_id: int
    loads: list[ChunkLoad] = field(default_factory=list)
    stores: list[ChunkStore] = field(default_factory=list)
    granted_by: str = ""
    expires_in_s: float | None = None


@dataclass(slots=True)
class ConnectorMetadata:
    """Everything a worker's connector does in one step.

    Worker contract, in this order:

    1. ``flush_req_ids``: requests preempted in this step. Every store of theirs, in this
       metadata or still running from an earlier step, must have finished reading its GPU
       blocks before any load of this step writes GPU blocks and before this step's forward
       pass: the scheduler may already have given those blocks to another request.
    2. ``stores``: GPU blocks → chunk parts. Their KV was computed in an earlier step (stores
       are deferred one step). Apart from (1) they may run alongside compute.
    3. ``loads``: chunk parts → GPU blocks. The request does not run until they are reported.

    ``failed_loads`` (informational): hits this step that could not be pinned. A worker that
    reports failed blocks itself (vLLM's ``get_block_ids_with_load_errors``) reports these
    too; kvserver's own scheduler learns of them from its connector directly.

    Each rank reports every ``(req_id, lease_id)`` exactly once, when its own part of every
    chunk of that lease has been copied (or has failed), in a :class:`ConnectorWorkerOutput`.
    Workers never complete leases: co-located workers copy at ``extents[rank]``, remote ones use
    ``read_parts`` / ``write_parts(complete=False)`` with ``lease_id``; the scheduler connector
    completes a lease once every rank has reported it.
    """

    ns_id: str = ""
    loads: list[RequestTransfers] = field(default_factory=list)
    stores: list[RequestTransfers] = field(default_factory=list)
    flush_req_ids: list[str] = field(default_factory=list)
    failed_loads: list[FailedLoad] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.flush_req_ids or self.failed_loads)

    def to_wire(self) -> dict[str, Any]:
        plain: dict[str, Any] = to_plain(self)
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> ConnectorMetadata:
        """Rebuild from :meth:`to_wire` output; InvalidArgument for anything malformed."""
        d = as_map(body, "connector metadata")
        return cls(
            ns_id=typed_field(d, "ns_id", str),
            loads=[_transfers_from_wire(t) for t in typed_field(d, "loads", list)],
            stores=[_transfers_from_wire(t) for t in typed_field(d, "stores", list)],
            flush_req_ids=[
                checked(r, str, "flush_req_ids") for r in typed_field(d, "flush_req_ids", list)
            ],
            failed_loads=[
                _failed_load_from_wire(f)
                for f in checked(d.get("failed_loads", []), list, "failed_loads")
            ],
        )


@dataclass(slots=True)
class TransferResult:
    """One rank finished its part of one lease; ``failed_keys`` empty means every chunk copied."""

    req_id: str
    lease_id: int
    failed_keys: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class ConnectorWorkerOutput:
    """What one worker (TP rank ``rank``) finished since its previous report."""

    rank: int
    loads: list[TransferResult] = field(default_factory=list)
    stores: list[TransferResult] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        plain: dict[str, Any] = to_plain(self)
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> ConnectorWorkerOutput:
        """Rebuild from :meth:`to_wire` output; InvalidArgument for anything malformed."""
        d = as_map(body, "connector worker output")
        return cls(
            rank=typed_field(d, "rank", int),
            loads=[_result_from_wire(r) for r in typed_field(d, "loads", list)],
            stores=[_result_from_wire(r) for r in typed_field(d, "stores", list)],
        )


def _extents_from_wire(value: Any) -> RankExtents:
    try:
        return [[(int(off), int(length)) for off, length in rank] for rank in value]
    except (TypeError, ValueError, OverflowError) as exc:  # int(inf): OverflowError
        raise InvalidArgument(f"malformed extents: {exc}") from None


def _failed_load_from_wire(body: Any) -> FailedLoad:
    d = as_map(body, "failed load")
    return FailedLoad(
        req_id=typed_field(d, "req_id", str),
        block_ids=count_list(typed_field(d, "block_ids", list), "block_ids"),
        finished=typed_field(d, "finished", bool),
    )


def _transfers_from_wire(body: Any) -> RequestTransfers:
    d = as_map(body, "request transfers")
    loads = []
    for item in typed_field(d, "loads", list):
        c = as_map(item, "chunk load")
        loads.append(
            ChunkLoad(
                key=typed_field(c, "key", bytes),
                block_ids=count_list(c.get("block_ids"), "block_ids"),
                skip_blocks=count(typed_field(c, "skip_blocks", int), "skip_blocks"),
                extents=_extents_from_wire(c.get("extents", [])),
            )
        )
    stores = []
    for item in typed_field(d, "stores", list):
        c = as_map(item, "chunk store")
        stores.append(
            ChunkStore(
                key=typed_field(c, "key", bytes),
                block_ids=count_list(c.get("block_ids"), "block_ids"),
                extents=_extents_from_wire(c.get("extents", [])),
            )
        )
    return RequestTransfers(
        req_id=typed_field(d, "req_id", str),
        lease_id=typed_field(d, "lease_id", int),
        loads=loads,
        stores=stores,
        granted_by=checked(d.get("granted_by", ""), str, "granted_by"),
        expires_in_s=_expires_from_wire(d.get("expires_in_s")),
    )


def _expires_from_wire(value: Any) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not value >= 0:  # NaN fails too
        raise InvalidArgument("expires_in_s must be a number >= 0", got=value)
    return float(value)


def _result_from_wire(body: Any) -> TransferResult:
    d = as_map(body, "transfer result")
    return TransferResult(
        req_id=typed_field(d, "req_id", str),
        lease_id=typed_field(d, "lease_id", int),
        failed_keys=[checked(k, bytes, "failed_keys") for k in typed_field(d, "failed_keys", list)],
    )
