"""The store side of the scheduler connector: one store batch per step (:class:`StorePlanner`).

Runs in the scheduler process, on the scheduler's thread; not thread-safe; part of
:class:`~scheduler.kv_connector.KVServerSchedulerConnector`.

Call order, per step::

    build_connector_meta:    collect()   apply the previous batch's reply: cursors, store jobs
                             ... the connector ships the jobs ...
                             plan(step)  block tables, the chunks full after the step, and
                                         ONE prepare_store, sent without waiting, carrying
                                         the store completions the previous
                                         update_connector_output held (LeaseBook.take_held)
    update_connector_output: prepare()   if that reply has arrived, take it: store jobs
                                         queued for the next metadata, cursors moved

``collect`` reads the reply itself (waiting at most ``op_timeout_s``) when ``prepare`` did not
find it, so the outcome is the same either way; the round trip overlaps the workers' step.
``prepare`` changes nothing the scheduler can observe: the jobs it queues ship with the next
metadata either way, the cursors are read only by the next ``plan``, and the requests left
without a job are let go only by ``collect``.
``drain`` and ``reset`` go through ``collect`` / ``cancel``.

Cost per step (256 decoding requests): one pass over the cached requests that appends new
block ids where there are some; the requests whose next chunk boundary is reached are found
by the calendar (:mod:`scheduler.kv_connector_due`) without looking at the others; only they
do more.

Invariants:
- at most one batch is in flight; each request with chunks in it counts it once in
  ``num_stores``: as its share of the batch until the reply is taken, then as its store job
  (or, without one, until ``collect``);
- :meth:`is_storing` is true exactly for the keys of the batch in flight and of the store
  jobs not finished (lookups answer "ask again" for them). The set is built on demand, by a
  lookup, and dropped whenever the batch or the store jobs may change: by ``collect``,
  ``cancel``, the send of a batch, and :meth:`changed`, which the connector calls at the
  start of ``build_connector_meta`` and ``update_connector_output`` (nothing looks up while
  they run);
- a chunk below a request's ``cursor`` is never planned again (``RequestState.store_planned``
  enforces it): the cursor moves past the planned chunks when the reservation is granted (or
  refused for good), and stays when it could not be made (daemon unreachable, cache full:
  planned again next step);
- a full cache halves the next batch (down to 1 chunk); each granted batch doubles the limit
  back up to ``max_store_batch_chunks``.
"""

from __future__ import annotations

import logging
from typing import Any

from kvserver.errors import KVServerError, Unavailable
from kvserver.grants import StoreGrant
from kvserver.hashing import BlockHasher
from scheduler.kv_connector_due import StoreCalendar
from scheduler.kv_connector_leases import LeaseBook
from scheduler.kv_connector_link import DaemonLink
from scheduler.kv_connector_request import RequestState
from scheduler.kv_connector_types import (
    ConnectorStats,
    PlannedStore,
    ScheduledStep,
    StoreBatch,
    TransferJob,
)
from step_protocol import ChunkStore, RequestTransfers

logger = logging.getLogger(__name__)


class StorePlanner:
    """Plans, reserves and hands over (as jobs) the stores of every scheduled request."""

    def __init__(
        self,
        reqs: dict[str, RequestState],
        link: DaemonLink,
        leases: LeaseBook,
        stats: ConnectorStats,
        hasher: BlockHasher,
    ) -> None:
        """``reqs``: the connector's requests (shared, not copied)."""
        self.spec = link.config.spec
        self._reqs = reqs
        self._link = link
        self._leases = leases
        self._stats = stats
        self._hasher = hasher
        self._max_batch = link.config.max_store_batch_chunks
        #: this step's prepare_store, sent at the end of build_connector_meta.
        self.batch: StoreBatch | None = None
        self._batch_limit = self._max_batch
        #: keys with a store planned or in flight; None: to be built again.
        self._storing: set[bytes] | None = None
        #: which requests to look at in each step.
        self.calendar = StoreCalendar(self.spec.chunk_tokens)
        #: plan() leaves the step's prepare_store to send_deferred() (the scheduler calls
        #: ``dispatched()``); ``deferred``: that batch, planned and not sent yet.
        self.defer = False
        self.deferred: tuple[list[PlannedStore], list[bytes]] | None = None

    def cancel(self) -> None:
        """Forget the batch in flight (its reply is dropped; the caller releases its lease), a
        batch not sent yet, and every request's place in the calendar (the connector forgets
        its requests)."""
        self.deferred = None
        if self.batch is not None:
            self.batch.pending.cancel()  # completions it carried stand, results unknown
            if self.batch.grant is None:
                self._stats.unreserved_chunks += len(self.batch.keys)
            self.batch = None
        self._storing = None
        self.calendar.clear()

    def is_storing(self, key: bytes) -> bool:
        """True while a store of chunk ``key`` is planned or in flight (in the batch or in a
        store job of this connector)."""
        storing = self._storing
        if storing is None:
            storing = self._leases.store_keys()
            if self.batch is not None:
                storing.update(self.batch.keys)
            self._storing = storing
        return key in storing

    def changed(self) -> None:
        """The batch or the store jobs may have changed: :meth:`is_storing` looks again."""
        self._storing = None

    def plan(self, step: ScheduledStep) -> None:
        """Take the step's block tables (new_reqs replace, cached_reqs append) and send one
        prepare_store for the chunks from each request's cursor to the last one full after
        this step (at most the batch limit, new requests first, then in step order), without
        waiting. Which requests have a chunk full is the calendar's answer
        (:mod:`scheduler.kv_connector_due`): in steady decode only those whose next chunk
        boundary is reached are looked at. REQUIRES: the previous batch was collected."""
        due = self.calendar.take(step, self._reqs)
        if due:
            self.calendar.recheck(self._plan(due))

    def _plan(self, due: list[tuple[RequestState, int]]) -> list[RequestState]:
        """For each (request, tokens after this step), in order while the batch has room: the
        chunks from its cursor up to the last one full after the step; then send them.
        Returns the requests none of whose stores went out."""
        bs, cb = self.spec.block_size, self.spec.chunk_blocks
        room = self._batch_limit
        planned: list[PlannedStore] = []
        keys: list[bytes] = []
        left: list[RequestState] = []
        planned_at = self.calendar.planned  # filed for the cursor a grant gives it
        for i, (state, done) in enumerate(due):
            if room <= 0:
                left += [s for s, _ in due[i:]]
                break
            req, blocks, first = state.request, state.block_ids, state.cursor
            hashes = req.block_hashes or state.block_hashes(self._hasher)
            # the last chunk full after the step: bounded by the tokens, hashes and blocks known
            num_tokens = len(req.all_token_ids)
            end = (done if done < num_tokens else num_tokens) // bs
            if len(hashes) < end:
                end = len(hashes)
            if len(blocks) < end:
                end = len(blocks)
            end //= cb
            if end > first + room:
                end = first + room
            if end <= first:
                left.append(state)
                continue
            chunk_keys = hashes[first * cb + cb - 1 : end * cb : cb]
            keys += chunk_keys
            planned.append(
                PlannedStore(state, first, end, chunk_keys, blocks[first * cb : end * cb])
            )
            planned_at(state, end, done)
            room -= end - first
        if planned:
            if self.defer:
                self.deferred = (planned, keys)
            elif not self._send(planned, keys):
                left += [p.state for p in planned]
        return left

    def send_deferred(self) -> None:
        """Send the batch :meth:`plan` left for later, if any, as :meth:`plan` would have
        (its requests are checked again next step if it could not be sent)."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None and not self._send(*deferred):
            self.calendar.recheck([p.state for p in deferred[0]])

    def _send(self, planned: list[PlannedStore], keys: list[bytes]) -> bool:
        """One prepare_store for every planned chunk (``keys``, in plan order), not waited for;
        False when unsent (daemon down or unreachable): the cursors stay, so the chunks are
        planned again next step."""
        stats = self._stats
        stats.planned_chunks += len(keys)
        unique = list(dict.fromkeys(keys))
        stats.shared_chunks += len(keys) - len(unique)
        carried = self._leases.take_held()
        pending = self._link.send_prepare_store(unique, carried)
        if pending is None:
            stats.unreserved_chunks += len(unique)
            if carried:
                self._leases.carried_failed(carried, Unavailable("not sent"))
            return False
        stats.carried_completions += len(carried)
        for p in planned:
            p.state.store_planned(p.first, p.end)
        self.batch = StoreBatch(pending, planned, unique, carried)
        self._storing = None
        return True

    def prepare(self) -> None:
        """Take the reply of the batch in flight if it has arrived (never waits): the store
        jobs are built and queued for the next metadata (:meth:`_take`), leaving to
        :meth:`collect` only what the scheduler can see — the requests none of whose chunks
        was granted stop counting the batch, and are released if finished — exactly as if it
        had read the reply itself. Called once the workers' step is over, so that
        ``build_connector_meta`` has little left to do."""
        batch = self.batch
        if batch is None or batch.grant is not None or not batch.pending.done():
            return
        try:
            grant = self._result(batch)
        except KVServerError:
            return  # collect() gets the same outcome again and handles it
        if grant is not None:
            self._take(batch, grant)

    def _result(self, batch: StoreBatch) -> StoreGrant | None:
        """The batch's grant (waiting at most ``op_timeout_s``); the results of the
        completions it carried are applied on the first read, success or not."""
        try:
            reservation = self._link.result(batch.pending)
        except KVServerError as exc:
            if batch.carried:
                self._leases.carried_failed(batch.carried, exc)
                batch.carried = []
            raise
        if batch.carried:
            self._leases.apply_carried(batch.carried, reservation.completed)
            batch.carried = []
        return reservation.grant

    def collect(self) -> None:
        """Apply the reply of the store batch in flight (waiting at most ``op_timeout_s`` unless
        :meth:`prepare` took it already): each granted chunk becomes a ChunkStore of the first
        request that planned it, one job per request (all in the batch's one lease), shipped
        by the next metadata; cursors move past what was planned. Unreachable or a full cache:
        cursors stay (a full cache halves the next batch)."""
        batch, self.batch = self.batch, None
        self._storing = None
        if batch is None:
            return
        if batch.grant is None:
            try:
                grant = self._result(batch)
            except Unavailable:
                self._drop(batch, skip=False)
                return
            except KVServerError as exc:
                logger.warning("prepare_store of %d chunks refused: %s", len(batch.keys), exc)
                self._drop(batch, skip=True)  # it would fail again
                return
            if grant is None:
                self._stats.store_rejections += 1
                self._batch_limit = max(1, len(batch.keys) // 2)
                self._drop(batch, skip=False)
                return
            self._take(batch, grant)
        for p in batch.ungranted:  # present already, filtered, or another request's
            p.state.store_share_over()
            self._leases.release_if_done(p.state)

    def _take(self, batch: StoreBatch, grant: StoreGrant) -> None:
        """Turn ``grant`` into one store job per request with granted chunks (a key's location
        goes to the first request that planned it), queued for the next metadata; move every
        planned request's cursor past its chunks; note in ``batch.ungranted`` the requests
        left without a job, for :meth:`collect`. A request's share of the batch, counted once
        in ``num_stores``, is its job's count from here on."""
        batch.grant = grant
        stats = self._stats
        stats.granted_chunks += len(grant.keys)
        stats.present_chunks += len(grant.present)
        stats.filtered_chunks += len(grant.filtered)
        if grant.present:  # ready already, stored by another request or client
            self._leases.note_changed(grant.present)
        self._batch_limit = min(self._batch_limit * 2, self._max_batch)
        locations: dict[bytes, Any] = dict(zip(grant.keys, grant.locations, strict=True))
        take, lease_id, deadline = locations.pop, grant.lease_id, grant.deadline
        granted_by, ungranted = grant.granted_by, batch.ungranted
        cb = self.spec.chunk_blocks
        jobs: list[TransferJob] = []
        for p in batch.planned:
            state, blocks, keys = p.state, p.block_ids, p.keys
            state.store_reserved(p.end)
            if len(keys) == 1:  # one chunk (decode): its blocks are the planned ones
                if (location := take(keys[0], None)) is None:
                    ungranted.append(p)
                    continue
                stores = [ChunkStore(keys[0], blocks, location)]
            else:
                stores = []
                for i, key in enumerate(keys):
                    if (location := take(key, None)) is not None:
                        stores.append(ChunkStore(key, blocks[i * cb : (i + 1) * cb], location))
                if not stores:
                    ungranted.append(p)
                    continue
                if len(stores) < len(keys):
                    keys = [c.key for c in stores]
            req_id = state.request.request_id
            transfers = RequestTransfers(req_id, lease_id, [], stores, granted_by)
            jobs.append(TransferJob(transfers, False, keys, deadline, (False, req_id, lease_id)))
        if jobs:
            self._leases.add_store_jobs(jobs, deadline)

    def _drop(self, batch: StoreBatch, *, skip: bool) -> None:
        """Nothing reserved: the chunks are planned again next step, or never (``skip``)."""
        self._stats.unreserved_chunks += len(batch.keys)
        for p in batch.planned:
            p.state.store_refused(p.end, for_good=skip)
            self._leases.release_if_done(p.state)
