"""A request as the scheduler sees it, its lifecycle, its orders and the waiting queues.

Runs in the scheduler process; plain objects, no locks (one owner: the scheduler).

Lifecycle (:class:`RequestStatus`; everything after PREEMPTED is finished)::

    WAITING ──admit──► RUNNING ──stop / length / abort / error──► FINISHED_*
       ▲  │                │
       │  └─async load─► WAITING_FOR_REMOTE_KVS ──loads landed──► WAITING
       └──── PREEMPTED ◄─┘ (out of blocks: KV freed, num_computed_tokens = 0)

Token accounting: ``all_token_ids`` = prompt + sampled outputs. ``num_computed_tokens`` counts
the positions whose KV is (or, once this step runs, will be) on the GPU; the scheduler's only
question each step is how far ``num_computed_tokens`` may catch up with ``num_tokens``.

``block_hashes`` holds the chained hash of every *full* block of ``all_token_ids``, made with
:class:`kvserver.hashing.BlockHasher` so the keys are kvserver's keys; it grows as outputs are
appended (one hash call per completed block, never a re-hash of the prefix).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserver.errors import InvalidArgument
from kvserver.hashing import BlockHash, BlockHasher
from step_protocol import NewRequestData


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


#: finish reason reported to clients, per finished status
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

_arrivals = itertools.count()


class Request:
    """One generation request. REQUIRES: ``prompt_token_ids`` non-empty ints >= 0."""

    __slots__ = (
        "_all_token_ids",
        "_hasher",
        "arrival_seq",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "error",
        "greedy",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "seed",
        "status",
        "stop_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        hasher: BlockHasher | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        stop_token_ids: Iterable[int] = (),
        greedy: bool = True,
        seed: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidArgument("a request needs at least one prompt token", req=request_id)
        if type(max_tokens) is not int or max_tokens < 1:
            raise InvalidArgument("max_tokens must be an int >= 1", max_tokens=max_tokens)
        self.request_id = request_id
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self._all_token_ids)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt or None
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        #: tie-break for equal clocks: creation order
        self.arrival_seq = next(_arrivals)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.greedy = greedy
        self.seed = seed
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        #: prompt tokens found on admission: GPU prefix cache + kvserver (-1 = not admitted yet)
        self.num_cached_tokens = -1
        #: prompt tokens kvserver provided on the first admission (after failed loads)
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        self.error: str | None = None
        self._hasher = hasher
        self.block_hashes: list[BlockHash] = (
            hasher.hash_blocks(self._all_token_ids, cache_salt=self.cache_salt) if hasher else []
        )

    # ------------------------------------------------------------------ derived values

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs. Callers must not mutate it (use :meth:`append_output_token`)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self._all_token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._all_token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    # ------------------------------------------------------------------ mutation

    def append_output_token(self, token_id: int) -> None:
        """Append one sampled token and hash the block it completes, if any."""
        tokens = self._all_token_ids
        tokens.append(token_id)
        hasher = self._hasher
        if hasher is None:
            return
        block_size = hasher.block_size
        num_hashed = len(self.block_hashes)
        if len(tokens) >= (num_hashed + 1) * block_size:
            start = num_hashed * block_size
            self.block_hashes += hasher.hash_blocks(
                tokens[start:],
                cache_salt=self.cache_salt,
                parent=self.block_hashes[-1] if num_hashed else None,
                start_block=num_hashed,
            )

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus:
        """Its status after sampling ``token`` (already appended): stopped, capped, or running."""
        if token in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return RequestStatus.RUNNING

    def clamp_external(self, num_local: int, ext: int, load_async: bool) -> int:
        """External (kvserver) hit tokens past ``num_local``, never more than the prompt; a
        synchronous load leaves the last token to compute (an async one is trimmed when it
        lands, ``TransferTracker.land``)."""
        ext = max(0, min(ext, self.num_tokens - num_local))
        if not load_async and num_local + ext >= self.num_tokens:
            ext = self.num_tokens - 1 - num_local
        return max(0, ext)

    def new_request_data(self, block_ids: list[int]) -> NewRequestData:
        """What the workers are told of it when it is scheduled with no state on them (first
        time, or resumed after preemption); ``block_ids`` is its whole block table."""
        return NewRequestData(
            req_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            block_ids=block_ids,
            num_computed_tokens=self.num_computed_tokens,
            max_tokens=self.max_tokens,
            output_token_ids=self.output_token_ids,
            greedy=self.greedy,
            seed=self.seed,
        )

    def usage(self) -> PromptUsage:
        """Where its prompt's KV came from on its first admission."""
        cached = max(0, self.num_cached_tokens)
        return PromptUsage(
            prompt_tokens=self.num_prompt_tokens,
            gpu_cached_tokens=cached - self.num_external_computed_tokens,
            kvserver_tokens=self.num_external_computed_tokens,
            num_preemptions=self.num_preemptions,
        )

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower ``priority`` first, then earlier arrival (creation order on a
        tie)."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        return self.arrival_seq < other.arrival_seq

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


@dataclass(slots=True)
class PromptUsage:
    """Where a prompt's KV came from on its first admission (reported to the client)."""

    prompt_tokens: int
    gpu_cached_tokens: int
    kvserver_tokens: int
    num_preemptions: int = 0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.gpu_cached_tokens - self.kvserver_tokens


@dataclass(slots=True)
class PromptTotals:
    """Monotonic sums of :class:`PromptUsage` over the requests that ended after admission:
    where prompt tokens came from (computed here, this scheduler's GPU prefix cache, kvserver)."""

    requests: int = 0
    computed_tokens: int = 0
    gpu_cached_tokens: int = 0
    kvserver_tokens: int = 0

    def add(self, usage: PromptUsage) -> None:
        self.requests += 1
        self.computed_tokens += usage.computed_tokens
        self.gpu_cached_tokens += usage.gpu_cached_tokens
        self.kvserver_tokens += usage.kvserver_tokens


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens and, at the end, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: PromptUsage | None = None
    error: str | None = None


# ---------------------------------------------------------------------------- waiting queues


class RequestQueue(Protocol):
    """The waiting queue: FCFS (deque) or priority (heap); ``prepend`` = put back at the head."""

    def add(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def prepend(self, request: Request) -> None: ...
    def prepend_all(self, requests: RequestQueue) -> None: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; ``prepend`` puts a preempted request back at the head. All O(1) but
    :meth:`remove` (O(n))."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_all(self, requests: RequestQueue) -> None:
        """Put ``requests`` (in their order) in front of this queue's head."""
        self._q.extendleft(reversed(list(requests)))

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Min-heap on :meth:`Request.__lt__`; ``prepend`` is ``add`` (heap order wins)."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def prepend(self, request: Request) -> None:
        self.add(request)

    def prepend_all(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add(request)

    def remove(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def select_queue(policy: str, waiting: RequestQueue, skipped: RequestQueue) -> RequestQueue:
    """The queue to admit from next (``skipped``: requests deferred in an earlier step). FCFS:
    deferred requests first (they are older); priority: the better head."""
    if policy == "fcfs" or not (waiting and skipped):
        return skipped or waiting
    if waiting.peek() < skipped.peek():
        return waiting
    return skipped


def create_queue(policy: str) -> RequestQueue:
    """The queue type of ``policy`` (``fcfs`` or ``priority``)."""
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise InvalidArgument("unknown policy; valid choices: fcfs, priority", policy=policy)


def arrival_key(request: Request) -> tuple[float, int]:
    """Sort key: earlier arrival first (creation order on a tie)."""
    return (request.arrival_time, request.arrival_seq)


def priority_key(request: Request) -> tuple[int, float, int]:
    """Sort key in :meth:`Request.__lt__`'s order: lower ``priority``, then earlier arrival
    first; the priority policy preempts the largest (lowest priority, latest arrival)."""
    return (request.priority, request.arrival_time, request.arrival_seq)
