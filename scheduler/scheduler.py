"""The scheduler: which requests compute how many tokens in each engine step.

Runs in the scheduler process, called by its step loop (``scheduler/process.py``); plain and
synchronous, no I/O, not thread-safe. Per step::

    plan = scheduler.schedule()                       # StepPlan for every worker
    results = <every worker runs plan>                # StepResult per rank
    outputs = scheduler.update_from_output(plan, results)

There is no prefill or decode phase: each request has ``num_computed_tokens`` and
``num_tokens``, and every step hands out one token budget (``max_num_batched_tokens``) so that
the first catches up with the second — first to the running requests in admission order, then,
only if nobody was preempted, to waiting requests (FCFS or priority), each capped by
``long_prefill_token_threshold`` (chunked prefill). When a running request cannot get a block,
the scheduler preempts (FCFS: the tail of the running list; priority: the lowest-priority
request), freeing all its KV; the victim goes back to the head of the waiting queue and is
recomputed, mostly from the prefix cache, when readmitted.

Connector touchpoints, when a connector is configured:
``get_num_new_matched_tokens`` and ``update_state_after_alloc`` at admission,
``build_connector_meta`` at the end of ``schedule()``, ``update_connector_output`` at the start of
``update_from_output()``, ``request_finished`` when a request ends. A request whose external
tokens load asynchronously waits in WAITING_FOR_REMOTE_KVS holding its blocks until the report
says the load is over; a failed load rewinds it to the valid prefix and the rest is computed.
A finished request whose blocks the connector still reads (``request_finished`` → True) keeps
them until the report lists it in ``finished_sending``.

Invariants between calls: every unfinished request is in exactly one of ``running``,
``waiting``, ``skipped_waiting``; running requests and WAITING_FOR_REMOTE_KVS requests hold
blocks, waiting/preempted ones hold none; ``requests`` holds exactly the unfinished requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvserver.errors import CapacityError, InvalidArgument
from kvserver.hashing import BlockHasher
from scheduler.block_pool import BlockPool, KVCacheBlock
from scheduler.config import SchedulerConfig
from scheduler.connector_base import SchedulerConnector
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.kv_transfers import TransferTracker
from scheduler.request import (
    PromptTotals,
    Request,
    RequestOutput,
    RequestQueue,
    RequestStatus,
    arrival_key,
    create_queue,
    priority_key,
    select_queue,
)
from scheduler.step_decisions import StepDecisions
from scheduler.trace import StepTrace
from step_protocol import StepPlan, StepResult

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Queues, token budget, block allocation and preemption; see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        connector: SchedulerConnector | None = None,
        trace: StepTrace | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        if trace is None and config.trace_path:
            trace = StepTrace(config.trace_path, header={"config": asdict(config)})
        self.trace = trace
        self.block_size = config.block_size
        self.max_model_len = config.model_len
        self.hasher = BlockHasher(config.hash_algo, config.block_size, config.hash_seed)
        self.pool = BlockPool(config.num_gpu_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = KVCacheManager(
            self.pool,
            config.block_size,
            self.max_model_len,
            enable_caching=config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.prompt_totals = PromptTotals()
        self.waiting: RequestQueue = create_queue(config.policy)
        #: requests deferred in an earlier step: loading from kvserver, or connector undecided
        self.skipped_waiting: RequestQueue = create_queue(config.policy)
        self.running: list[Request] = []
        self.step = 0
        self._finished_req_ids: list[str] = []
        self.transfers = TransferTracker(self.kv)
        self._connector_name = type(connector).__name__ if connector is not None else None

    # ------------------------------------------------------------------ requests in and out

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], **kw: Any) -> Request:
        """A :class:`Request` hashed with this scheduler's block hasher (kvserver's keys).
        CapacityError, before any hashing, for a prompt :meth:`check_prompt_tokens` refuses
        (a 15M-token prompt was hashed block by block, ~1 GB and 12.7 s of the step loop,
        before ``add_request`` refused it)."""
        self.check_prompt_tokens(len(prompt_token_ids))
        return Request(request_id, prompt_token_ids, hasher=self.hasher, **kw)

    def check_prompt_tokens(self, num_tokens: int) -> None:
        """CapacityError for a prompt that leaves no room for an output token within
        ``max_model_len``."""
        if num_tokens >= self.max_model_len:
            raise CapacityError(
                "prompt too long: it must be shorter than max_model_len",
                prompt_tokens=num_tokens,
                max_model_len=self.max_model_len,
            )

    def add_request(self, request: Request) -> None:
        """Queue a new request. InvalidArgument for a duplicate id; CapacityError for a prompt
        that leaves no room for an output token within ``max_model_len``."""
        if request.request_id in self.requests:
            raise InvalidArgument("duplicate request id", req=request.request_id)
        self.check_prompt_tokens(request.num_prompt_tokens)
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise InvalidArgument("only a fresh request can be added", req=request.request_id)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: Sequence[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """End unfinished requests from outside (client gone: ABORTED); returns those ended."""
        if not status.is_finished:
            raise InvalidArgument("finish_requests needs a finished status", status=status.name)
        ended = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == _RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            else:
                self.skipped_waiting.remove(request)
            request.status = status
            self._free_request(request, was_loading=was_loading)
            ended.append(request)
        return ended

    def fail_all(self, reason: str, *, release: bool = True) -> list[RequestOutput]:
        """The workers lost their KV (a worker died or timed out): every request holding
        blocks ends FINISHED_ERROR with ``reason``, every block is released and the prefix cache
        is forgotten. Requests still waiting without blocks stay queued. ``release=False``:
        the connector gives back its leases only at ``connector.release_forgotten()`` (the
        caller's, once every worker answered a hello)."""
        failed = [
            r
            for r in self.requests.values()
            if r.status in (_RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)
        ]
        for request in failed:
            request.error = reason
        self.finish_requests([r.request_id for r in failed], RequestStatus.FINISHED_ERROR)
        self.transfers.release_all()
        if self.connector is not None:
            self.connector.reset(release=release)  # the GPU contents are gone
        self.kv.reset_prefix_cache()
        return [
            RequestOutput(r.request_id, [], True, "error", r.usage(), error=reason) for r in failed
        ]

    def close(self) -> None:
        """Flush and close the trace (if any). The scheduler is not used afterwards."""
        if self.trace is not None:
            self.trace.close()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        """True while a step has something to do or to tell the workers (connector transfers
        planned or in flight count too: their reports come back with step results)."""
        return bool(
            self.requests
            or self.transfers.has_pending
            or self._finished_req_ids
            or (self.connector is not None and self.connector.has_pending_transfers)
        )

    def stats(self) -> dict[str, Any]:
        loading = sum(
            1 for r in self.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )
        return {
            "step": self.step,
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self.skipped_waiting) - loading,
            "waiting_for_remote_kvs": loading,
            "delayed_free": len(self.transfers.delayed_free),
            "free_blocks": self.pool.num_free_blocks,
            "total_blocks": self.pool.num_blocks,
            "gpu_cached_blocks": self.pool.num_cached_blocks,
            "usage": round(self.pool.usage, 6),
            "evicted_blocks": self.pool.num_evicted,
        }

    # ------------------------------------------------------------------ schedule()

    def schedule(self) -> StepPlan:
        """Decide this step; advances ``num_computed_tokens`` of every scheduled request."""
        self.step += 1
        step, cfg, kv, trace = self.step, self.config, self.kv, self.trace
        if trace is not None:
            state = self.stats()
            del state["step"]
            trace.snapshot(
                step,
                **state,
                max_num_seqs=cfg.max_num_seqs,
                token_budget=cfg.max_num_batched_tokens,
            )
        threshold = cfg.long_prefill_token_threshold
        decisions = StepDecisions(cfg.max_num_batched_tokens)

        # 1. running requests, in admission order
        running = self.running
        i = 0
        while i < len(running) and decisions.budget > 0:
            request = running[i]
            n = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, decisions.budget, self.max_model_len - request.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = kv.allocate_slots(request, n)
                if blocks is not None:
                    break
                if cfg.policy == "priority":
                    victim = max(running, key=priority_key)  # lowest priority, latest arrival
                    index = running.index(victim)
                    del running[index]
                    if index < i:  # already visited: roll back what it got this step
                        i -= 1
                        decisions.unschedule_running(victim)
                else:
                    victim = running.pop()
                self._preempt(victim)
                decisions.preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                # It preempted itself. FCFS: it was the tail, the loop ends. Priority: later
                # requests may use the blocks it freed (vLLM stops the loop here instead).
                continue
            decisions.schedule_running(request, n, blocks)
            i += 1

        # 2. waiting requests, only when nobody was preempted (no admit → preempt churn)
        if not decisions.preempted:
            self._admit(decisions)

        plan = decisions.plan(step, kv, self._finished_req_ids)
        self._finished_req_ids = []
        if self.connector is not None:
            plan.connector_meta = self.connector.build_connector_meta(plan)
        requests = self.requests
        for req_id, n in decisions.num_scheduled.items():
            requests[req_id].num_computed_tokens += n
        if trace is not None:
            decisions.trace(trace, step)
        return plan

    def _admit(self, decisions: StepDecisions) -> None:
        """The waiting half of ``schedule()``: admits into ``decisions`` while its budget
        lasts."""
        cfg, kv, connector, trace = self.config, self.kv, self.connector, self.trace
        threshold = cfg.long_prefill_token_threshold
        deferred = create_queue(cfg.policy)  # skipped in this step; rejoin skipped_waiting after
        # Loads that landed go first: they hold blocks, and waiting behind a request that
        # needs those very blocks would deadlock.
        landed = sorted((self.requests[r] for r in self.transfers.landed), key=arrival_key)
        for request in reversed(landed):  # the earliest ends up at the head
            self.transfers.land(request)
            self.skipped_waiting.remove(request)
            self.skipped_waiting.prepend(request)
        while (self.waiting or self.skipped_waiting) and decisions.budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            queue = select_queue(cfg.policy, self.waiting, self.skipped_waiting)
            request = queue.peek()
            req_id = request.request_id
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                deferred.add(queue.pop())  # its load is in flight
                continue
            hits: list[KVCacheBlock] = []
            num_external = 0
            load_async = False
            if not kv.has_blocks(req_id):  # new or preempted: look the prefix up
                hits, num_local = kv.get_computed_blocks(request)
                if connector is not None:
                    ext, load_async = connector.get_num_new_matched_tokens(request, num_local)
                    if ext is None:  # connector undecided: ask again next step
                        deferred.add(queue.pop())
                        continue
                    num_external = request.clamp_external(num_local, ext, load_async)
                    load_async = load_async and num_external > 0
                if trace is not None:
                    trace.prefix_cache(
                        self.step,
                        req_id=req_id,
                        local_hit_tokens=num_local,
                        external_hit_tokens=num_external,
                        prompt_tokens=request.num_prompt_tokens,
                        num_tokens=request.num_tokens,
                        connector=self._connector_name,
                        load_async=load_async,
                    )
                num_computed = num_local + num_external
            else:  # its async load has landed: blocks held, num_computed_tokens set
                num_local = 0
                num_computed = request.num_computed_tokens
            n = 0
            if not load_async:
                n = request.num_tokens - num_computed
                if cfg.enable_chunked_prefill and 0 < threshold < n:
                    n = threshold
                if not cfg.enable_chunked_prefill and n > decisions.budget:
                    break
                n = min(n, decisions.budget)
            blocks = kv.allocate_slots(
                request,
                n,
                new_computed_blocks=hits,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=load_async,
            )
            if blocks is None:
                # Pool full: running requests are not preempted to admit waiting ones. Waiting
                # requests holding blocks (their loads landed) must not deadlock the pool:
                if kv.has_blocks(req_id):
                    # the rest of it does not fit: give the blocks back rather than hold them
                    # (they stay prefix-cached; its next admission hits them if still there)
                    self._preempt(queue.pop(), requeue=False)
                    decisions.preempted.append(request)
                    deferred.add(request)
                    continue
                if any(kv.has_blocks(r.request_id) for r in self.skipped_waiting):
                    deferred.add(queue.pop())  # let one that holds blocks go first
                    continue
                break
            if connector is not None:  # every admission, as in vLLM (0 external after a load)
                connector.update_state_after_alloc(request, kv.get_block_ids(req_id), num_external)
            queue.pop()
            if request.num_cached_tokens < 0:  # first admission: where the prompt came from
                request.num_cached_tokens = num_computed
                request.num_external_computed_tokens = num_external
            request.num_computed_tokens = num_computed
            if load_async:
                self.transfers.start_load(request, num_local)
                deferred.add(request)
                continue
            decisions.schedule_waiting(
                request, n, resumed=request.status == RequestStatus.PREEMPTED
            )
            request.status = _RUNNING
            self.running.append(request)
        if deferred:
            self.skipped_waiting.prepend_all(deferred)

    def _preempt(self, request: Request, *, requeue: bool = True) -> None:
        """Free all its KV; it is recomputed (prefix cache permitting) when readmitted."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if requeue:
            self.waiting.prepend(request)

    # ------------------------------------------------------------------ update_from_output()

    def dispatched(self) -> None:
        """Call once the plan ``schedule()`` returned went to the workers (before waiting for
        them): the connector sends its daemon call of the step then, off the step's critical
        path (:meth:`SchedulerConnector.dispatched`)."""
        if self.connector is not None:
            self.connector.dispatched()

    def update_from_output(
        self, plan: StepPlan, results: Sequence[StepResult]
    ) -> list[RequestOutput]:
        """Apply the workers' answers to ``plan``: transfer reports first, then one sampled
        token per request that finished its prompt or decoded; stops finished requests."""
        rewound: set[str] = set()
        if self.connector is not None:
            outputs_by_rank = [r.connector_output for r in results if r.connector_output]
            report = self.connector.update_connector_output(outputs_by_rank)
            rewound = self.transfers.apply(report, self.requests)
        sampled = results[0].sampled_token_ids if results else {}
        outputs: list[RequestOutput] = []
        stopped: list[Request] = []
        requests = self.requests
        for req_id in plan.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING or req_id in rewound:
                continue  # aborted meanwhile, or its loaded KV turned out invalid
            if request.num_computed_tokens < request.num_tokens:
                continue  # a partial prefill chunk: its sample is meaningless
            token = sampled.get(req_id)
            if token is None:
                request.error = f"the workers returned no token for step {plan.step}"
                request.status = RequestStatus.FINISHED_ERROR
            else:
                request.append_output_token(token)
                request.status = request.stop_status(token, self.max_model_len)
            first = request.num_output_tokens == 1
            if request.status.is_finished:
                stopped.append(request)
            outputs.append(
                RequestOutput(
                    req_id,
                    [token] if token is not None else [],
                    request.status.is_finished,
                    request.finish_reason,
                    request.usage() if first or request.status.is_finished else None,
                    request.error,
                )
            )
        if stopped:
            gone = set(map(id, stopped))
            self.running = [r for r in self.running if id(r) not in gone]
            for request in stopped:
                self._free_request(request)
        return outputs

    def _free_request(self, request: Request, *, was_loading: bool = False) -> None:
        """A request ended: tell the workers and the connector; release or park its blocks
        (``was_loading``: it ended in WAITING_FOR_REMOTE_KVS)."""
        req_id = request.request_id
        del self.requests[req_id]
        self._finished_req_ids.append(req_id)
        if request.num_cached_tokens >= 0:  # it was admitted: count where its prompt came from
            self.prompt_totals.add(request.usage())
        delay = False
        if self.connector is not None:
            delay, _ = self.connector.request_finished(request, self.kv.get_block_ids(req_id))
        self.transfers.finished(request, was_loading, delay)
