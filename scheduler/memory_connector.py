"""An in-memory stand-in for the kvserver scheduler connector (tests and the benchmark).

It keeps the real connector's planning bookkeeping — chunk keys from the request's block
hashes, one lease per load and per step's stores, stores deferred one step behind a per-request
cursor, a lease completed once every rank reported it, ``request_finished`` → True while
transfers are in flight — over a Python set of stored chunk keys instead of a daemon. Every
touchpoint call is logged in :attr:`MemoryConnector.calls`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.connector_base import RequestLike, SchedulerConnector, TransferReport
from step_protocol import (
    ChunkLoad,
    ChunkStore,
    ConnectorMetadata,
    ConnectorWorkerOutput,
    RequestTransfers,
)


@dataclass(slots=True, eq=False)
class _Job:
    transfers: RequestTransfers
    is_load: bool
    keys: list[bytes]
    first_tokens: list[int]
    ranks: set[int] = field(default_factory=set)
    failed: set[bytes] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class _State:
    request: RequestLike
    block_ids: list[int] = field(default_factory=list)
    cursor: int = 0
    plan: tuple[int, int, list[bytes]] | None = None
    jobs: int = 0
    finished: bool = False


class MemoryConnector(SchedulerConnector):
    """See the module docstring. ``load_async=False`` makes loads synchronous (they land in
    the step that schedules the request); keys in ``failing_keys`` fail when loaded;
    ``undecided`` request ids get ``None`` from ``get_num_new_matched_tokens``."""

    def __init__(
        self,
        block_size: int,
        chunk_blocks: int = 1,
        world_size: int = 1,
        *,
        load_async: bool = True,
        log_calls: bool = True,
    ) -> None:
        self.block_size = block_size
        self.chunk_blocks = chunk_blocks
        self.world_size = world_size
        self.load_async = load_async
        self.log_calls = log_calls
        self.stored: set[bytes] = set()
        self.failing_keys: set[bytes] = set()
        self.undecided: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self._reqs: dict[str, _State] = {}
        self._jobs: dict[tuple[bool, int], _Job] = {}
        self._to_ship: list[_Job] = []
        self._report = TransferReport()
        self._leases = itertools.count(1)

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.chunk_blocks

    @property
    def has_pending_transfers(self) -> bool:
        return bool(self._jobs)

    def _log(self, method: str, req_id: str) -> None:
        if self.log_calls:
            self.calls.append((method, req_id))

    def _state(self, request: RequestLike) -> _State:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _State(request)
        return state

    # ------------------------------------------------------------------ the touchpoints

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._log("get_num_new_matched_tokens", request.request_id)
        state = self._state(request)
        state.plan = None
        if state.jobs or request.request_id in self.undecided:
            return None, False
        ct, cb = self.chunk_tokens, self.chunk_blocks
        hashes = request.block_hashes
        max_chunks = min(len(hashes) // cb, (len(request.all_token_ids) - 1) // ct)
        start = num_computed_tokens // ct
        keys = []
        for c in range(start, max_chunks):
            key = hashes[c * cb + cb - 1]
            if key not in self.stored:
                break
            keys.append(key)
        if not keys:
            return 0, False
        state.plan = (num_computed_tokens, start, keys)
        return (start + len(keys)) * ct - num_computed_tokens, self.load_async

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self._log("update_state_after_alloc", request.request_id)
        state = self._state(request)
        state.block_ids, state.cursor = list(block_ids), 0
        plan, state.plan = state.plan, None
        if not num_external_tokens or plan is None:
            return
        num_local, start, keys = plan
        bs, cb = self.block_size, self.chunk_blocks
        loads, first_tokens = [], []
        for i, key in enumerate(keys, start):
            skip = max(0, num_local // bs - i * cb)
            loads.append(ChunkLoad(key, state.block_ids[i * cb + skip : (i + 1) * cb], skip))
            first_tokens.append(max(num_local, (i * cb + skip) * bs))
        transfers = RequestTransfers(request.request_id, next(self._leases), loads=loads)
        self._add(state, _Job(transfers, True, keys, first_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        plan = scheduler_output
        meta = ConnectorMetadata(ns_id="memory")
        for job in self._to_ship:
            (meta.loads if job.is_load else meta.stores).append(job.transfers)
        self._to_ship = []
        meta.flush_req_ids = [
            r for r in plan.preempted_req_ids if (s := self._reqs.get(r)) is not None and s.jobs
        ]
        for req_id in plan.preempted_req_ids:
            if (state := self._reqs.get(req_id)) is not None:
                state.block_ids = []
        # one pass over the scheduled requests; stores only where a chunk became full
        reqs, sched, ct = self._reqs, plan.num_scheduled_tokens, self.chunk_tokens
        for new in plan.new_reqs:
            if (state := reqs.get(new.req_id)) is not None:
                state.block_ids = list(new.block_ids)
                if not state.finished:
                    self._plan_stores(state, new.num_computed_tokens + sched[new.req_id])
        for cached in plan.cached_reqs:
            state = reqs.get(cached.req_id)
            if state is None or state.finished:
                continue
            if cached.new_block_ids:
                state.block_ids += cached.new_block_ids
            done = cached.num_computed_tokens + sched[cached.req_id]
            if done // ct > state.cursor:
                self._plan_stores(state, done)
        return meta

    def update_connector_output(self, outputs: Sequence[Any]) -> TransferReport:
        for out in outputs:
            assert isinstance(out, ConnectorWorkerOutput)
            for is_load, results in ((True, out.loads), (False, out.stores)):
                for res in results:
                    job = self._jobs.get((is_load, res.lease_id))
                    if job is None:
                        continue
                    job.ranks.add(out.rank)
                    job.failed.update(res.failed_keys)
                    if len(job.ranks) == self.world_size:
                        self._finish(job)
        report, self._report = self._report, TransferReport()
        return report

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._log("request_finished", request.request_id)
        state = self._reqs.get(request.request_id)
        if state is not None and state.jobs:
            state.finished = True
            return True, None
        self._reqs.pop(request.request_id, None)
        return False, None

    def take_events(self) -> list[Any]:
        return []

    # ------------------------------------------------------------------ internals

    def _add(self, state: _State, job: _Job) -> None:
        self._jobs[(job.is_load, job.transfers.lease_id)] = job
        self._to_ship.append(job)
        state.jobs += 1

    def _plan_stores(self, state: _State, num_tokens: int) -> None:
        req, bs, cb = state.request, self.block_size, self.chunk_blocks
        hashes = req.block_hashes
        num_blocks = min(num_tokens, len(req.all_token_ids)) // bs
        num_chunks = min(num_blocks, len(hashes), len(state.block_ids)) // cb
        if num_chunks <= state.cursor:
            return
        first, state.cursor = state.cursor, num_chunks
        stores = [
            ChunkStore(hashes[c * cb + cb - 1], state.block_ids[c * cb : (c + 1) * cb])
            for c in range(first, num_chunks)
            if hashes[c * cb + cb - 1] not in self.stored
        ]
        if stores:
            transfers = RequestTransfers(req.request_id, next(self._leases), stores=stores)
            self._add(state, _Job(transfers, False, [s.key for s in stores], []))

    def _finish(self, job: _Job) -> None:
        del self._jobs[(job.is_load, job.transfers.lease_id)]
        req_id = job.transfers.req_id
        failed = job.failed | (self.failing_keys & set(job.keys) if job.is_load else set())
        if job.is_load:
            self._report.finished_recving.add(req_id)
            bad = [i for i, key in enumerate(job.keys) if key in failed]
            if bad:
                self._report.load_errors[req_id] = job.first_tokens[bad[0]]
                for load in job.transfers.loads[bad[0] :]:
                    self._report.invalid_block_ids.update(load.block_ids)
        else:
            self.stored.update(k for k in job.keys if k not in failed)
        state = self._reqs.get(req_id)
        if state is None:
            return
        state.jobs -= 1
        if state.finished and not state.jobs:
            del self._reqs[req_id]
            self._report.finished_sending.add(req_id)
