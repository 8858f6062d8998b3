"""One step's decisions while ``Scheduler.schedule()`` makes them, and the ``StepPlan`` they
become.

Runs in the scheduler process, made and dropped inside one ``schedule()`` call (plain, not
thread-safe). The scheduler decides; this class only records, in order: running requests
scheduled (each with the blocks it newly got), a running request unscheduled again when a
later one preempts it (priority policy: its tokens go back to the budget), waiting requests
admitted (new or resumed), and every request preempted. ``plan()`` turns the record into the
workers' ``StepPlan``, and ``trace()`` into the step trace's decision record.

Invariants: ``budget`` plus the tokens in ``num_scheduled`` is the step's token budget;
``num_scheduled`` names exactly the requests of ``running``, ``new`` and ``resumed``, in the
order they were scheduled (running ones first); ``new_block_ids`` names exactly those of
``running``. The requests' own fields (``num_computed_tokens``, status) are the scheduler's
to change, never this class's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.block_pool import KVCacheBlock
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request
from scheduler.trace import StepTrace
from step_protocol import CachedRequestData, StepPlan


@dataclass(slots=True)
class StepDecisions:
    """See the module docstring. ``budget``: the tokens this step may still hand out."""

    budget: int
    #: request id -> tokens scheduled this step
    num_scheduled: dict[str, int] = field(default_factory=dict)
    #: running request id -> the ids of the blocks it got this step
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def schedule_running(self, request: Request, n: int, blocks: Sequence[KVCacheBlock]) -> None:
        """Running ``request`` computes ``n`` tokens, in ``blocks`` newly allocated to it."""
        self.running.append(request)
        self.num_scheduled[request.request_id] = n
        self.new_block_ids[request.request_id] = [b.block_id for b in blocks]
        self.budget -= n

    def unschedule_running(self, request: Request) -> None:
        """Running ``request``, preempted after it was visited, gets nothing this step (its
        tokens go back to the budget); nothing happens if it was not scheduled."""
        if request.request_id in self.num_scheduled:
            self.running.remove(request)
            self.budget += self.num_scheduled.pop(request.request_id)
            self.new_block_ids.pop(request.request_id)

    def schedule_waiting(self, request: Request, n: int, *, resumed: bool) -> None:
        """Waiting ``request`` is admitted and computes ``n`` tokens (``resumed``: it was
        preempted before; else it is new to the workers)."""
        (self.resumed if resumed else self.new).append(request)
        self.num_scheduled[request.request_id] = n
        self.budget -= n

    def plan(self, step: int, kv: KVCacheManager, finished_req_ids: list[str]) -> StepPlan:
        """The workers' plan of step ``step`` (before the requests' ``num_computed_tokens``
        advance): admitted requests whole, running ones by their new blocks and tokens;
        ``finished_req_ids``: the requests that ended since the last plan."""
        num_scheduled = self.num_scheduled
        return StepPlan(
            step=step,
            new_reqs=[
                r.new_request_data(kv.get_block_ids(r.request_id))
                for r in (*self.new, *self.resumed)
            ],
            cached_reqs=[
                CachedRequestData(
                    r.request_id,
                    self.new_block_ids[r.request_id],
                    r.num_computed_tokens,
                    r.all_token_ids[
                        r.num_computed_tokens : r.num_computed_tokens + num_scheduled[r.request_id]
                    ],
                )
                for r in self.running
            ],
            num_scheduled_tokens=num_scheduled,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=[r.request_id for r in self.preempted],
        )

    def trace(self, trace: StepTrace, step: int) -> None:
        """Write the decisions as step ``step``'s decision record (its records flushed)."""
        trace.decision(
            step,
            new=[r.request_id for r in self.new],
            resumed=[r.request_id for r in self.resumed],
            running=[r.request_id for r in self.running],
            preempted=[r.request_id for r in self.preempted],
            num_scheduled_tokens=self.num_scheduled,
        )
