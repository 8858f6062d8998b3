"""Messages between the scheduler process and the worker processes (defined once, here).

Both ``scheduler/`` and ``worker/`` import this module; it depends on nothing but the standard
library and msgpack, so neither process pulls in the other's dependencies (the scheduler never
imports torch). Each message is a slots dataclass with ``to_wire()`` / ``from_wire()`` over
plain msgpack-able values; :func:`encode` / :func:`decode` frame them with a type tag and the
protocol version.

Per engine step::

    scheduler ──StepPlan (SchedulerOutput + ConnectorMetadata)──► every worker
    scheduler ◄──StepResult (sampled tokens + ConnectorWorkerOutput)── every worker

Chunk transfers (seed 000 §10-§12). A chunk spans ``chunk_blocks`` GPU blocks and is stored
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
    data: bytes = msgpack.packb(
        {"v": STEP_PROTOCOL_VERSION, "kind": kind, "body": _to_plain(message)},
        use_bin_type=True,
    )
    return data


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


# --- connector metadata -------------------------------------------------------------------------
# The KV connector's own messages: ConnectorMetadata (scheduler connector → every worker, inside
# the step plan) and ConnectorWorkerOutput (each worker → scheduler connector, inside the step
# result). Producer: scheduler/kv_connector.py; consumer: the worker-side connector. See
# docs/connector.md.
#
# Part layout: a chunk's part for one rank is its ``chunk_blocks`` GPU blocks in order, block j at
# bytes [j * block_bytes, (j + 1) * block_bytes). ``ChunkStore.block_ids[j]`` is the GPU block of
# sub-block j (exactly ``chunk_blocks`` ids). ``ChunkLoad.block_ids[j]`` receives sub-block
# ``skip_blocks + j`` (``chunk_blocks - skip_blocks`` ids): the skipped leading sub-blocks of a
# partly-cached first chunk are neither read into nor overwritten on the GPU.


@dataclass(slots=True)
class ConnectorMetadata:
    """Everything a worker's connector does in one step (seed 000 §2.1 build_connector_meta).

    Worker contract, in this order:

    1. ``flush_req_ids``: requests preempted in this step. Every store of theirs, in this
       metadata or still running from an earlier step, must have finished reading its GPU
       blocks before any load of this step writes GPU blocks and before this step's forward
       pass: the scheduler may already have given those blocks to another request.
    2. ``stores``: GPU blocks → chunk parts. Their KV was computed in an earlier step (stores
       are deferred one step, seed 000 §11.2). Apart from (1) they may run alongside compute.
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
        plain: dict[str, Any] = _to_plain(self)
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> ConnectorMetadata:
        """Rebuild from :meth:`to_wire` output; InvalidArgument for anything malformed."""
        d = _map(body, "connector metadata")
        return cls(
            ns_id=_typed(d, "ns_id", str),
            loads=[_transfers_from_wire(t) for t in _typed(d, "loads", list)],
            stores=[_transfers_from_wire(t) for t in _typed(d, "stores", list)],
            flush_req_ids=[
                _check(r, str, "flush_req_ids") for r in _typed(d, "flush_req_ids", list)
            ],
            failed_loads=[_failed_load_from_wire(f) for f in _check(
                d.get("failed_loads", []), list, "failed_loads"
            )],
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
        plain: dict[str, Any] = _to_plain(self)
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> ConnectorWorkerOutput:
        """Rebuild from :meth:`to_wire` output; InvalidArgument for anything malformed."""
        d = _map(body, "connector worker output")
        return cls(
            rank=_typed(d, "rank", int),
            loads=[_result_from_wire(r) for r in _typed(d, "loads", list)],
            stores=[_result_from_wire(r) for r in _typed(d, "stores", list)],
        )


def _map(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a map")
    return value


def _check(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgument(f"{name} must be {kind.__name__}", got=type(value).__name__)
    return value


def _typed(d: dict[str, Any], name: str, kind: type) -> Any:
    if name not in d:
        raise InvalidArgument(f"missing field {name}")
    return _check(d[name], kind, name)


def _int_list(value: Any, name: str) -> list[int]:
    return [_check(x, int, name) for x in _check(value, list, name)]


def _extents_from_wire(value: Any) -> RankExtents:
    try:
        return [[(int(off), int(length)) for off, length in rank] for rank in value]
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"malformed extents: {exc}") from None


def _failed_load_from_wire(body: Any) -> FailedLoad:
    d = _map(body, "failed load")
    return FailedLoad(
        req_id=_typed(d, "req_id", str),
        block_ids=_int_list(_typed(d, "block_ids", list), "block_ids"),
        finished=_typed(d, "finished", bool),
    )


def _transfers_from_wire(body: Any) -> RequestTransfers:
    d = _map(body, "request transfers")
    loads = []
    for item in _typed(d, "loads", list):
        c = _map(item, "chunk load")
        loads.append(
            ChunkLoad(
                key=_typed(c, "key", bytes),
                block_ids=_int_list(c.get("block_ids"), "block_ids"),
                skip_blocks=_typed(c, "skip_blocks", int),
                extents=_extents_from_wire(c.get("extents", [])),
            )
        )
    stores = []
    for item in _typed(d, "stores", list):
        c = _map(item, "chunk store")
        stores.append(
            ChunkStore(
                key=_typed(c, "key", bytes),
                block_ids=_int_list(c.get("block_ids"), "block_ids"),
                extents=_extents_from_wire(c.get("extents", [])),
            )
        )
    return RequestTransfers(
        req_id=_typed(d, "req_id", str),
        lease_id=_typed(d, "lease_id", int),
        loads=loads,
        stores=stores,
    )


def _result_from_wire(body: Any) -> TransferResult:
    d = _map(body, "transfer result")
    return TransferResult(
        req_id=_typed(d, "req_id", str),
        lease_id=_typed(d, "lease_id", int),
        failed_keys=[_check(k, bytes, "failed_keys") for k in _typed(d, "failed_keys", list)],
    )


# --- step plan and step result ------------------------------------------------------------------
# The scheduler's per-step messages (producer: scheduler/scheduler.py + scheduler/workers.py;
# consumers: every worker, and scheduler/synthetic.py). Kinds on the wire:
#
#   scheduler → worker   "hello"  WorkerHello     (at start and after a failure; resets state)
#                        "step"   StepPlan
#                        "stop"   {}               (worker exits)
#   worker → scheduler   "hello"  WorkerInfo
#                        "result" StepResult
#                        "error"  {"step": int, "message": str}   (the step failed on that rank)
#
# Worker contract for a StepPlan, in this order: forget ``finished_req_ids`` and
# ``preempted_req_ids``; register ``new_reqs`` (their ``block_ids`` replace any block table it
# had: a request resumed after preemption comes back as new); append ``new_block_ids`` of
# ``cached_reqs``; run the connector metadata (loads / stores, ConnectorMetadata above); compute
# ``num_scheduled_tokens[req_id]`` tokens of every scheduled request, from position
# ``num_computed_tokens`` on; sample one token per scheduled request (the scheduler drops the
# samples of partial prefill chunks). Every rank gets the same plan; rank 0's samples are used.

KIND_HELLO = "hello"
KIND_STEP = "step"
KIND_STOP = "stop"
KIND_RESULT = "result"
KIND_ERROR = "error"


def encode_body(kind: str, body: dict[str, Any]) -> bytes:
    """Like :func:`encode` for a body that is already plain (a ``to_wire()`` result): no walk
    over every token id."""
    data: bytes = msgpack.packb(
        {"v": STEP_PROTOCOL_VERSION, "kind": kind, "body": body}, use_bin_type=True
    )
    return data


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have no state for: first schedule, or resumed after preemption
    (then ``output_token_ids`` holds what it generated before and ``block_ids`` is its whole
    new block table). Tokens computed this step: ``(prompt + output)[num_computed_tokens:
    num_computed_tokens + num_scheduled_tokens[req_id]]``."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    greedy: bool = True
    seed: int = 0

    def to_wire(self) -> list[Any]:
        return [
            self.req_id, self.prompt_token_ids, self.block_ids, self.num_computed_tokens,
            self.max_tokens, self.output_token_ids, self.greedy, self.seed,
        ]

    @classmethod
    def from_wire(cls, body: Any) -> NewRequestData:
        if not isinstance(body, list) or len(body) != 8:
            raise InvalidArgument("new request data must be an 8-item list")
        req_id, prompt, blocks, computed, max_tokens, output, greedy, seed = body
        return cls(
            req_id=_check(req_id, str, "req_id"),
            prompt_token_ids=_int_list(prompt, "prompt_token_ids"),
            block_ids=_int_list(blocks, "block_ids"),
            num_computed_tokens=_check(computed, int, "num_computed_tokens"),
            max_tokens=_check(max_tokens, int, "max_tokens"),
            output_token_ids=_int_list(output, "output_token_ids"),
            greedy=_check(greedy, bool, "greedy"),
            seed=_check(seed, int, "seed"),
        )


@dataclass(slots=True)
class CachedRequestData:
    """A request the workers already hold: ``new_block_ids`` are appended to its block table;
    ``token_ids`` are the tokens computed this step (from position ``num_computed_tokens``),
    typically the one token sampled in the previous step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    token_ids: list[int]

    def to_wire(self) -> list[Any]:
        return [self.req_id, self.new_block_ids, self.num_computed_tokens, self.token_ids]

    @classmethod
    def from_wire(cls, body: Any) -> CachedRequestData:
        if not isinstance(body, list) or len(body) != 4:
            raise InvalidArgument("cached request data must be a 4-item list")
        req_id, blocks, computed, tokens = body
        return cls(
            req_id=_check(req_id, str, "req_id"),
            new_block_ids=_int_list(blocks, "new_block_ids"),
            num_computed_tokens=_check(computed, int, "num_computed_tokens"),
            token_ids=_int_list(tokens, "token_ids"),
        )


@dataclass(slots=True)
class StepPlan:
    """One engine step for every worker (vLLM's SchedulerOutput); see the worker contract
    above. ``connector_meta`` is what the scheduler connector's ``build_connector_meta``
    returned (a :class:`ConnectorMetadata`), ``None`` without a connector; on the worker side
    it arrives as plain values (``ConnectorMetadata.from_wire`` rebuilds it)."""

    step: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    connector_meta: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to tell the workers."""
        meta = self.connector_meta
        return not (
            self.num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids
        ) and (meta is None or bool(getattr(meta, "is_empty", False)))

    def to_wire(self) -> dict[str, Any]:
        meta = self.connector_meta
        if meta is not None and hasattr(meta, "to_wire"):
            meta = meta.to_wire()
        elif meta is not None:
            meta = _to_plain(meta)
        return {
            "step": self.step,
            "new": [r.to_wire() for r in self.new_reqs],
            "cached": [r.to_wire() for r in self.cached_reqs],
            "sched": self.num_scheduled_tokens,
            "finished": self.finished_req_ids,
            "preempted": self.preempted_req_ids,
            "meta": meta,
        }

    @classmethod
    def from_wire(cls, body: Any) -> StepPlan:
        """Rebuild from :meth:`to_wire` output; InvalidArgument for anything malformed."""
        d = _map(body, "step plan")
        sched = _typed(d, "sched", dict)
        for req_id, n in sched.items():
            _check(req_id, str, "num_scheduled_tokens key")
            _check(n, int, "num_scheduled_tokens")
        return cls(
            step=_typed(d, "step", int),
            new_reqs=[NewRequestData.from_wire(r) for r in _typed(d, "new", list)],
            cached_reqs=[CachedRequestData.from_wire(r) for r in _typed(d, "cached", list)],
            num_scheduled_tokens=sched,
            finished_req_ids=[_check(r, str, "finished") for r in _typed(d, "finished", list)],
            preempted_req_ids=[
                _check(r, str, "preempted") for r in _typed(d, "preempted", list)
            ],
            connector_meta=d.get("meta"),
        )


@dataclass(slots=True)
class StepResult:
    """One worker's answer to one :class:`StepPlan`."""

    step: int
    rank: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    connector_output: ConnectorWorkerOutput | None = None

    def to_wire(self) -> dict[str, Any]:
        out = self.connector_output
        return {
            "step": self.step,
            "rank": self.rank,
            "sampled": self.sampled_token_ids,
            "conn": out.to_wire() if out is not None else None,
        }

    @classmethod
    def from_wire(cls, body: Any) -> StepResult:
        """Rebuild from :meth:`to_wire` output; InvalidArgument for anything malformed."""
        d = _map(body, "step result")
        sampled = _typed(d, "sampled", dict)
        for req_id, token in sampled.items():
            _check(req_id, str, "sampled key")
            _check(token, int, "sampled token")
        conn = d.get("conn")
        return cls(
            step=_typed(d, "step", int),
            rank=_typed(d, "rank", int),
            sampled_token_ids=sampled,
            connector_output=None if conn is None else ConnectorWorkerOutput.from_wire(conn),
        )


@dataclass(slots=True)
class WorkerHello:
    """Scheduler → worker at start and after a failure: who you are; drop all request state."""

    rank: int
    world_size: int
    block_size: int
    num_gpu_blocks: int
    model: str = ""

    def to_wire(self) -> dict[str, Any]:
        plain: dict[str, Any] = _to_plain(self)
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> WorkerHello:
        d = _map(body, "worker hello")
        return cls(
            rank=_typed(d, "rank", int),
            world_size=_typed(d, "world_size", int),
            block_size=_typed(d, "block_size", int),
            num_gpu_blocks=_typed(d, "num_gpu_blocks", int),
            model=_typed(d, "model", str),
        )


@dataclass(slots=True)
class WorkerInfo:
    """Worker → scheduler answer to a hello. ``kv_layout`` describes the model's KV for the
    kvserver namespace: ``{"num_layers", "num_kv_heads" (the model's, all ranks together),
    "head_dim", "dtype"}``; synthetic workers report a small made-up layout."""

    rank: int
    pid: int
    vocab_size: int
    kv_layout: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        plain: dict[str, Any] = _to_plain(self)
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> WorkerInfo:
        d = _map(body, "worker info")
        return cls(
            rank=_typed(d, "rank", int),
            pid=_typed(d, "pid", int),
            vocab_size=_typed(d, "vocab_size", int),
            kv_layout=_typed(d, "kv_layout", dict),
        )
