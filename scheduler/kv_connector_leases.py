"""Transfers under daemon leases, from planned to completed (:class:`LeaseBook`).

Runs in the scheduler process, on the scheduler's thread, as part of
:class:`~scheduler.kv_connector.KVServerSchedulerConnector`; not thread-safe.

A :class:`~scheduler.kv_connector_types.TransferJob` is one request's transfers under one
lease: its load (a lease of its own, added by the load planner) or its share of one step's
store batch (added by the store planner). Life of a job::

    add_load | add_store_jobs ──► ship (into the next metadata)
        ──► apply_outputs (every TP rank has reported it) ──► finish (request counters, report)
        ──► send_completions (one per lease, not waited for; a store's held for the next
            prepare_store to carry, or sent alone by age_held at the end of the
            completion_hold_steps-th build_connector_meta without one)
        ──► collect_completions (the next update_connector_output), or apply_carried (with
            the carrying prepare_store's reply)
    or, shipped and unreported by its lease's deadline: expire ──► finish (no completion)

Invariants:
- ``jobs`` holds every job planned or in flight, keyed by ``TransferJob.id``; ``to_ship``
  the ones not shipped yet; ``loading`` counts, per chunk key, the load jobs in ``jobs``
  that read it; a request's ``num_loads`` / ``num_stores`` count its jobs (plus, for stores,
  its share of the store batch in flight), changed only through the methods of
  :class:`~scheduler.kv_connector_request.RequestState`;
- no job's deadline is earlier than ``_next_deadline`` (so :meth:`expire` is one comparison
  per step until a lease may really have expired);
- a finished request (``request_finished`` returned True) is reported in ``finished_sending``
  and forgotten as soon as it has no job and no share of the store batch left;
- every lease taken is completed, rolled back, or left to expire on the daemon;
- every chunk key this connector last saw change (:meth:`note_changed`: a store of it over,
  answered present to a store batch, found gone at a pin) maps to a change mark above every
  mark taken (:attr:`change_mark`) before that change, unless the mark is below
  ``_changed_floor`` (at most ``MAX_CHANGED`` keys are kept): :meth:`changed_since` never
  misses such a change.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from kvserver.client import Pending
from kvserver.errors import InvalidArgument, KVServerError
from kvserver.events import MEDIUM_DRAM, BlockRemoved, BlockStored, Event
from scheduler.connector_base import TransferReport
from scheduler.kv_connector_link import DaemonLink
from scheduler.kv_connector_request import RequestState
from scheduler.kv_connector_types import (
    Completion,
    ConnectorStats,
    HeldCompletion,
    TransferJob,
)
from step_protocol import ConnectorMetadata, ConnectorWorkerOutput, FailedLoad

logger = logging.getLogger(__name__)


class LeaseBook:
    """Jobs, their completion on the daemon, and what the scheduler is told about them."""

    #: chunk keys :meth:`changed_since` remembers (the oldest are forgotten first).
    MAX_CHANGED = 1 << 16

    def __init__(
        self,
        reqs: dict[str, RequestState],
        link: DaemonLink,
        stats: ConnectorStats,
        clock: Callable[[], float],
    ) -> None:
        """``reqs``: the connector's requests (shared, not copied)."""
        self.ns_id = link.config.spec.ns_id
        self._world = link.config.spec.tp_world_size
        #: ``TransferJob.ranks`` once every TP rank has reported.
        self._all_ranks = (1 << self._world) - 1
        self._reqs = reqs
        self._link = link
        self._stats = stats
        self._clock = clock
        self.jobs: dict[tuple[bool, str, int], TransferJob] = {}
        #: chunk key -> load jobs (planned or in flight) reading it.
        self.loading: dict[bytes, int] = {}
        #: loads planned in this step and stores reserved for the previous one.
        self.to_ship: list[TransferJob] = []
        #: a lower bound of the deadlines of the jobs (only a later clock can expire one).
        self._next_deadline = math.inf
        #: completions sent by update_connector_output, replies not applied yet.
        self.completions: list[Completion] = []
        #: store completions held for the next prepare_store (:meth:`send_completions`).
        self.held: list[HeldCompletion] = []
        #: ends of build_connector_meta the oldest held completion has waited through.
        self._held_steps = 0
        self._max_held_steps = link.config.completion_hold_steps
        self.report = TransferReport()
        #: hits that could not be pinned since the last metadata (shipped as failed_loads).
        self.failed_loads: list[FailedLoad] = []
        #: events for take_events, at most ``max_pending_events`` (the oldest are dropped).
        self.events: deque[Event] = deque()
        self._max_events = link.config.max_pending_events
        self._event_seq = 0
        #: chunk key -> change mark of the last change seen (:meth:`note_changed`).
        self._changed: dict[bytes, int] = {}
        self._change_mark = 0
        #: marks up to this one may have been forgotten.
        self._changed_floor = 0

    def clear(self) -> None:
        """Forget every job and reply still due (replies are dropped: see ``reset``). Held
        completions are sent first (:meth:`flush_held`): every rank wrote their chunks."""
        self.flush_held()
        for completion in self.completions:
            completion.pending.cancel()
        self.completions.clear()
        self.jobs.clear()
        self.loading.clear()
        self.to_ship.clear()
        self._next_deadline = math.inf
        self.failed_loads.clear()
        self.report = TransferReport()

    # ------------------------------------------------------------------ jobs

    @property
    def has_jobs(self) -> bool:
        """A job is planned or in flight."""
        return bool(self.jobs)

    def store_keys(self) -> set[bytes]:
        """The keys of the store jobs planned or in flight."""
        return {k for j in self.jobs.values() if not j.is_load for k in j.keys}

    def add_load(self, job: TransferJob) -> None:
        """A load job (its request counted it: ``RequestState.load_pinned``), shipped by the
        next :meth:`ship`."""
        self.jobs[job.id] = job
        loading = self.loading
        for key in job.keys:
            loading[key] = loading.get(key, 0) + 1
        self.to_ship.append(job)
        if job.deadline < self._next_deadline:
            self._next_deadline = job.deadline

    def pin_failed(
        self, req_id: str, num_valid: int, blocks: list[list[int]], *, finished: bool
    ) -> None:
        """A hit of ``req_id`` could not be pinned from token ``num_valid`` on: ``blocks`` will
        not be filled (a load error now, a failed load in the next metadata). ``finished``:
        nothing of it was pinned, so its load is over (reported as received)."""
        self.load_error(req_id, num_valid, blocks)
        self.failed_loads.append(
            FailedLoad(req_id, [b for ids in blocks for b in ids], finished=finished)
        )
        if finished:
            self.report.finished_recving.add(req_id)

    def add_store_jobs(self, jobs: list[TransferJob], deadline: float) -> None:
        """The store jobs of one grant (lease deadline ``deadline``), shipped by the next
        :meth:`ship`. Each takes the place of its request's share of the store batch, already
        counted in ``num_stores``."""
        self.jobs.update([(job.id, job) for job in jobs])
        self.to_ship += jobs
        if deadline < self._next_deadline:
            self._next_deadline = deadline

    def ship(self, meta: ConnectorMetadata) -> None:
        """Move the jobs not shipped yet, and the failed pins, into ``meta``; every job
        carries the time its lease has left (``RequestTransfers.expires_in_s``: a co-located
        worker does not copy into an expired reservation, nor trust a copy out of an expired
        load's pages)."""
        if self.failed_loads:
            meta.failed_loads, self.failed_loads = self.failed_loads, []
        if self.to_ship:
            to_ship, self.to_ship = self.to_ship, []
            loads, stores = meta.loads, meta.stores
            now = self._clock()
            for job in to_ship:
                job.shipped = True
                job.transfers.expires_in_s = max(0.0, job.deadline - now)
                (loads if job.is_load else stores).append(job.transfers)

    def apply_outputs(self, outputs: Sequence[Any]) -> list[TransferJob]:
        """Count each rank's reports; finish and return the jobs every rank has reported.
        Raises InvalidArgument if an output is not a ConnectorWorkerOutput."""
        jobs, world, all_ranks = self.jobs, self._world, self._all_ranks
        finished: list[TransferJob] = []
        for out in outputs:
            if not isinstance(out, ConnectorWorkerOutput):
                raise InvalidArgument("outputs must be ConnectorWorkerOutput", got=type(out))
            if not 0 <= out.rank < world:
                logger.warning("ignoring a report from rank %s (world %d)", out.rank, world)
                continue
            bit = 1 << out.rank
            for is_load, results in ((True, out.loads), (False, out.stores)):
                for res in results:
                    job = jobs.get((is_load, res.req_id, res.lease_id))
                    if job is None or not job.shipped:
                        logger.debug("ignoring a report of unknown lease %d", res.lease_id)
                        continue
                    job.ranks |= bit
                    if res.failed_keys:
                        job.failed = {*job.failed, *(k for k in res.failed_keys if k in job.keys)}
                    if job.ranks == all_ranks:
                        self.finish(job)
                        finished.append(job)
        return finished

    def finish(self, job: TransferJob, *, expired: bool = False) -> None:
        """Every rank reported (or the lease expired): update the request and the report. The
        daemon calls are :meth:`send_completions`' (none for an expired lease: the daemon
        reclaimed it already)."""
        del self.jobs[job.id]
        if job.is_load:
            loading = self.loading
            for key in job.keys:
                if loading[key] == 1:
                    del loading[key]
                else:
                    loading[key] -= 1
        req_id = job.transfers.req_id
        state = self._reqs.get(req_id)
        if state is None:
            return
        if not job.is_load:
            state.store_finished()
            if state.finished:
                self.release_if_done(state)
            return
        state.load_finished()
        self.report.finished_recving.add(req_id)
        bad = [i for i, k in enumerate(job.keys) if k in job.failed]
        if bad:
            first = min(job.first_tokens[i] for i in bad)
            blocks = [c.block_ids for c in job.transfers.loads if c.key in job.failed]
            self.load_error(req_id, first, blocks)
            # those chunks are recomputed: store them afterwards
            state.load_failed(job.first_chunk + bad[0])
        self.release_if_done(state)

    def release_if_done(self, state: RequestState) -> None:
        """A finished request with nothing planned or in flight: its blocks may be freed."""
        if state.is_done:
            req_id = state.req_id
            self.report.finished_sending.add(req_id)
            self._reqs.pop(req_id, None)

    def expire(self) -> None:
        """Leases no worker completed by their deadline: the workers are presumed dead, the
        daemon has rolled the lease back. Loads fail (recompute), stores are dropped."""
        now = self._clock()
        if now <= self._next_deadline:
            return
        for job in [j for j in self.jobs.values() if j.shipped and j.deadline < now]:
            logger.warning("lease %d of %s expired unreported", job.id[2], job.id[1])
            self._stats.expired_jobs += 1
            job.failed = frozenset(job.keys)
            self.finish(job, expired=True)
        self._next_deadline = min((j.deadline for j in self.jobs.values()), default=math.inf)

    # ------------------------------------------------------------------ completions

    def send_completions(self, jobs: list[TransferJob], *, hold: bool) -> None:
        """Complete the finished leases on the daemon without waiting: one complete_store per
        store lease (its chunks every rank wrote, all jobs of the lease together), one rollback
        per lease with chunks some rank failed, one complete_load per load lease. ``hold``:
        the store completions wait in ``held`` for the next prepare_store to carry them
        (:meth:`take_held`), or for :meth:`flush_held`."""
        stores: dict[int, tuple[list[bytes], list[bytes]]] = {}
        loads: list[int] = []
        for job in jobs:
            lease_id = job.transfers.lease_id
            if job.is_load:
                loads.append(lease_id)
                continue
            if (entry := stores.get(lease_id)) is None:
                entry = stores[lease_id] = ([], [])
            ok, bad = entry
            if not job.failed:
                ok += job.keys
                continue
            for key in job.keys:
                (bad if key in job.failed else ok).append(key)
        for lease_id, (ok, bad) in stores.items():
            self.note_changed(ok + bad)  # made ready or rolled back: lookups look again
            if ok:
                self._complete_store("store", lease_id, ok, hold)
            if bad:
                self._complete_store("rollback", lease_id, bad, hold)
        for lease_id in dict.fromkeys(loads):
            self._send_completion("load", lease_id, [])

    def _complete_store(
        self, kind: Literal["store", "rollback"], lease_id: int, keys: list[bytes], hold: bool
    ) -> None:
        if hold:
            self.held.append(HeldCompletion(kind, lease_id, keys))
        else:
            self._send_completion(kind, lease_id, keys)

    def take_held(self) -> list[HeldCompletion]:
        """The held store completions, for a prepare_store to carry (its reply's results go
        to :meth:`apply_carried`, or its failure to :meth:`carried_failed`)."""
        held, self.held = self.held, []
        self._held_steps = 0
        return held

    def age_held(self) -> None:
        """The end of a ``build_connector_meta`` whose prepare_store (if any) did not carry
        the held completions: send them alone once the oldest has waited
        ``completion_hold_steps`` steps, else keep them for a later prepare_store."""
        if self.held:
            self._held_steps += 1
            if self._held_steps >= self._max_held_steps:
                self.flush_held()

    def flush_held(self) -> None:
        """Send the held store completions alone, one complete_store each (no prepare_store
        carries them: :meth:`age_held`, a lookup or pin, ``drain``, ``reset``)."""
        for c in self.take_held():
            self._send_completion(c.kind, c.lease_id, c.keys)

    def apply_carried(
        self, carried: list[HeldCompletion], results: list[list[bytes] | KVServerError]
    ) -> None:
        """The results of completions a prepare_store carried, as :meth:`collect_completions`
        applies those of complete_store calls."""
        for completion, ready in zip(carried, results, strict=True):
            self._apply(completion.kind, completion.lease_id, ready)

    def carried_failed(self, carried: list[HeldCompletion], exc: KVServerError) -> None:
        """The prepare_store that carried ``carried`` was not sent, or got no result (an error
        or no reply): their chunks count as not stored (the daemon may have applied them)."""
        for completion in carried:
            self._apply(completion.kind, completion.lease_id, exc)

    def _send_completion(
        self, kind: Literal["store", "rollback", "load"], lease_id: int, keys: list[bytes]
    ) -> None:
        pending: Pending[Any] | None
        if kind == "load":
            pending = self._link.send_complete_load(lease_id)
        else:
            pending = self._link.send_complete_store(lease_id, keys, success=kind == "store")
        if pending is None:  # skipped: the daemon reclaims the lease at its deadline
            self._stats.completion_errors += 1
            return
        self.completions.append(Completion(pending, kind, lease_id))

    def collect_completions(self, *, wait: bool) -> None:
        """Apply completion replies: chunks made ready count as stored (a BlockStored event);
        an error is logged and counted, its chunks are not stored. ``wait``: wait for each
        (at most ``op_timeout_s``); else only those that already arrived."""
        left: list[Completion] = []
        for completion in self.completions:
            if not wait and not completion.pending.done():
                left.append(completion)
                continue
            try:
                ready = self._link.result(completion.pending)
            except KVServerError as exc:
                ready = exc
            self._apply(completion.kind, completion.lease_id, ready)
        self.completions = left

    def _apply(self, kind: str, lease_id: int, ready: Any) -> None:
        """One completion's result: the keys made ready (a BlockStored event for a store), or
        its error (logged and counted)."""
        if isinstance(ready, KVServerError):
            self._stats.completion_errors += 1
            logger.info("%s of lease %d failed: %s", kind, lease_id, ready)
        elif kind == "store":
            self._stats.stored_chunks += len(ready)
            self.emit(BlockStored, ready)

    # ------------------------------------------------------------------ report and events

    def take_events(self) -> list[Event]:
        """The events emitted since the last call, at most ``max_pending_events`` (the newest;
        ``seq`` shows the gap of those dropped); applies the completion replies that already
        arrived first, without waiting."""
        if self.completions:
            self.collect_completions(wait=False)
        events = list(self.events)
        self.events.clear()
        return events

    def take_report(self) -> TransferReport:
        report, self.report = self.report, TransferReport()
        return report

    def load_error(self, req_id: str, num_valid: int, blocks: Iterable[list[int]]) -> None:
        """Tell the scheduler: only the first ``num_valid`` tokens of ``req_id`` are valid,
        ``blocks`` were not filled."""
        self._stats.load_errors += 1
        errors = self.report.load_errors
        errors[req_id] = min(num_valid, errors.get(req_id, num_valid))
        for ids in blocks:
            self.report.invalid_block_ids.update(ids)

    def emit(self, kind: type[BlockStored | BlockRemoved], keys: Sequence[bytes]) -> None:
        if keys:
            if kind is BlockRemoved:
                self.note_changed(keys)
            self._event_seq += 1
            events = self.events
            if len(events) >= self._max_events:  # nobody drains them: keep the newest
                events.popleft()
                self._stats.dropped_events += 1
            events.append(kind(self._event_seq, self.ns_id, tuple(keys), MEDIUM_DRAM))

    # ------------------------------------------------------------------ changes seen

    @property
    def change_mark(self) -> int:
        """The mark of the last change seen: take it before a lookup, then
        :meth:`changed_since` tells whether a chunk it looked at changed since."""
        return self._change_mark

    def note_changed(self, keys: Iterable[bytes]) -> None:
        """``keys`` may have changed on the daemon as this connector sees it: a store of them
        is over (made ready, or rolled back), a store batch found them present already, or a
        pin found them gone."""
        self._change_mark += 1
        mark, changed = self._change_mark, self._changed
        for key in keys:
            changed.pop(key, None)  # to the end: the dict stays in mark order
            changed[key] = mark
        while len(changed) > self.MAX_CHANGED:
            self._changed_floor = changed.pop(next(iter(changed)))

    def changed_since(self, keys: Iterable[bytes], mark: int) -> bool:
        """True if one of ``keys`` may have changed since :attr:`change_mark` was ``mark``."""
        if mark < self._changed_floor:
            return True
        changed = self._changed
        return any(changed.get(key, 0) > mark for key in keys)
