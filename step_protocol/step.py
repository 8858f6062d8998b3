"""The scheduler's per-step messages (producer: scheduler/scheduler.py + scheduler/workers.py;
consumers: every worker, and scheduler/synthetic.py). Per engine step::

    scheduler ──StepPlan (SchedulerOutput + ConnectorMetadata)──► every worker
    scheduler ◄──StepResult (sampled tokens + ConnectorWorkerOutput)── every worker

Kinds on the wire:

    scheduler → worker   "hello"  WorkerHello     (at start and after a failure; resets state)
                         "step"   StepPlan
                         "stop"   {}               (worker exits)
    worker → scheduler   "hello"  WorkerInfo
                         "result" StepResult
                         "error"  {"step": int, "message": str}   (the step failed on that rank)

Worker contract for a StepPlan, in this order: forget ``finished_req_ids`` and
``preempted_req_ids``; register ``new_reqs`` (their ``block_ids`` replace any block table it
had: a request resumed after preemption comes back as new); append ``new_block_ids`` of
``cached_reqs``; run the connector metadata (loads / stores, step_protocol.connector); compute
``num_scheduled_tokens[req_id]`` tokens of every scheduled request, from position
``num_computed_tokens`` on; sample one token per scheduled request (the scheduler drops the
samples of partial prefill chunks). Every rank gets the same plan; rank 0's samples are used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserver.errors import InvalidArgument
from step_protocol.codec import (
    as_map,
    checked,
    count,
    count_field,
    count_list,
    int_list,
    to_plain,
    typed_field,
)
from step_protocol.connector import ConnectorWorkerOutput

KIND_HELLO = "hello"
KIND_STEP = "step"
KIND_STOP = "stop"
KIND_RESULT = "result"
KIND_ERROR = "error"


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
            self.req_id,
            self.prompt_token_ids,
            self.block_ids,
            self.num_computed_tokens,
            self.max_tokens,
            self.output_token_ids,
            self.greedy,
            self.seed,
        ]

    @classmethod
    def from_wire(cls, body: Any) -> NewRequestData:
        if not isinstance(body, list) or len(body) != 8:
            raise InvalidArgument("new request data must be an 8-item list")
        req_id, prompt, blocks, computed, max_tokens, output, greedy, seed = body
        return cls(
            req_id=checked(req_id, str, "req_id"),
            prompt_token_ids=int_list(prompt, "prompt_token_ids"),
            block_ids=count_list(blocks, "block_ids"),
            num_computed_tokens=count(computed, "num_computed_tokens"),
            max_tokens=count(max_tokens, "max_tokens"),
            output_token_ids=int_list(output, "output_token_ids"),
            greedy=checked(greedy, bool, "greedy"),
            seed=checked(seed, int, "seed"),
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
            req_id=checked(req_id, str, "req_id"),
            new_block_ids=count_list(blocks, "new_block_ids"),
            num_computed_tokens=count(computed, "num_computed_tokens"),
            token_ids=int_list(tokens, "token_ids"),
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
            meta = to_plain(meta)
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
        d = as_map(body, "step plan")
        sched = typed_field(d, "sched", dict)
        for req_id, n in sched.items():
            checked(req_id, str, "num_scheduled_tokens key")
            count(n, "num_scheduled_tokens", 1)
        return cls(
            step=typed_field(d, "step", int),
            new_reqs=[NewRequestData.from_wire(r) for r in typed_field(d, "new", list)],
            cached_reqs=[CachedRequestData.from_wire(r) for r in typed_field(d, "cached", list)],
            num_scheduled_tokens=sched,
            finished_req_ids=[
                checked(r, str, "finished") for r in typed_field(d, "finished", list)
            ],
            preempted_req_ids=[
                checked(r, str, "preempted") for r in typed_field(d, "preempted", list)
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
        d = as_map(body, "step result")
        sampled = typed_field(d, "sampled", dict)
        for req_id, token in sampled.items():
            checked(req_id, str, "sampled key")
            checked(token, int, "sampled token")
        conn = d.get("conn")
        return cls(
            step=typed_field(d, "step", int),
            rank=typed_field(d, "rank", int),
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
        plain: dict[str, Any] = to_plain(self)
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> WorkerHello:
        d = as_map(body, "worker hello")
        return cls(
            rank=count_field(d, "rank"),
            world_size=count_field(d, "world_size", 1),
            block_size=count_field(d, "block_size", 1),
            num_gpu_blocks=count_field(d, "num_gpu_blocks", 1),
            model=typed_field(d, "model", str),
        )


@dataclass(slots=True)
class WorkerInfo:
    """Worker → scheduler answer to a hello. ``kv_layout`` describes the model's KV for the
    kvserver namespace: ``{"num_layers", "num_kv_heads" (the model's, all ranks together),
    "head_dim", "dtype"}``; synthetic workers report a small made-up layout.
    ``max_message_bytes``: the largest step plan the worker takes (``step_protocol/limits.py``;
    set by the serving loop, ``step_protocol/serve.py``; 0: not said, absent on the wire, as
    from a worker before the limit)."""

    rank: int
    pid: int
    vocab_size: int
    kv_layout: dict[str, Any] = field(default_factory=dict)
    max_message_bytes: int = 0

    def to_wire(self) -> dict[str, Any]:
        plain: dict[str, Any] = to_plain(self)
        if not self.max_message_bytes:
            del plain["max_message_bytes"]
        return plain

    @classmethod
    def from_wire(cls, body: Any) -> WorkerInfo:
        d = as_map(body, "worker info")
        return cls(
            rank=typed_field(d, "rank", int),
            pid=typed_field(d, "pid", int),
            vocab_size=typed_field(d, "vocab_size", int),
            kv_layout=typed_field(d, "kv_layout", dict),
            max_message_bytes=count(d.get("max_message_bytes", 0), "max_message_bytes"),
        )
