"""KVServerSchedulerConnector: the scheduler half of the kvserver KV connector (seed 000 §2.1).

Runs in the scheduler process, on the scheduler's thread, inside ``schedule()`` and
``update_from_output()``; not thread-safe; holds no tensors: it plans, workers copy bytes. Call
order: :mod:`scheduler.connector_base`; per-step flow, metadata, worker contract, failures:
docs/connector.md and :class:`~kvserver.connector_messages.ConnectorMetadata`.

**Lookups never stall a step.** They are synchronous with a tight timeout (``lookup_timeout_s``,
100 ms; a loopback lookup takes ~0.2 ms) behind a circuit breaker: an ``Unavailable`` marks the
daemon down for ``down_backoff_s``, during which every call is skipped at once (a lookup answers
"no external hit", no store is planned, a load fails over to recomputation). A dead daemon costs
one timeout per backoff period, not one per request per step. Not a background lookup thread
answering None until the reply arrives: every new request would wait an extra scheduling step
although the daemon answers in 0.2 ms (TTFT), and the sync client is not thread-safe. None ("ask
again") is answered only while an earlier transfer of the request is in flight, or while the
first missing chunk is being stored by this connector (the hit grows once that store lands).

**Loads** are pinned (``prepare_load``, synchronous: only requests with a hit) in
``update_state_after_alloc`` and shipped in this step's metadata. **Stores** are planned at the
end of ``build_connector_meta``: the chunks of every scheduled request from its cursor to the
last chunk full after this step go out in ONE ``prepare_store`` (one lease per step), sent
without waiting. Its reply is collected at the start of the next ``build_connector_meta`` —
when those stores ship anyway (deferred one step, seed 000 §11.2) — so the round trip overlaps
the workers' step instead of lengthening the scheduler's. A lease is completed once every TP
rank has reported it: one ``complete_store`` per lease with finished chunks (plus one rollback
when a rank failed some) and one ``complete_load`` per finished load, sent without waiting from
``update_connector_output``; their replies (events, counters, errors) are applied by the next
``update_connector_output`` (or earlier by ``take_events`` once arrived, or :meth:`drain`).
The daemon applies one client's requests in order, so this connector's own later lookups
already see completed chunks. Per step that is 1 reservation + about 1 completion, whatever
the number of requests.

Invariants:
- a chunk below a request's ``cursor`` is never planned again (after a preemption the cursor
  restarts at 0 and the daemon's presence filter keeps stored chunks from being copied again;
  after a load it starts past the loaded chunks, and goes back to a chunk a rank failed);
- at most one store batch is in flight; its requests count it in ``num_stores``;
- a request with loads or stores planned or in flight keeps its GPU blocks: ``request_finished``
  returns True and the request shows up in ``finished_sending`` once they are over; a preempted
  one is named in ``flush_req_ids`` so workers finish reading its blocks before anything
  rewrites them;
- every lease taken is completed, rolled back, or left to expire on the daemon.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

from kvserver.client import KVClient, Pending
from kvserver.connector_messages import (
    ChunkLoad,
    ChunkStore,
    ConnectorMetadata,
    ConnectorWorkerOutput,
    FailedLoad,
    RequestTransfers,
)
from kvserver.engine_types import LoadGrant
from kvserver.errors import InvalidArgument, KVServerError, Unavailable, UnknownKey
from kvserver.events import MEDIUM_DRAM, BlockRemoved, BlockStored, Event
from kvserver.hashing import BlockHash, BlockHasher
from scheduler.connector_base import RequestLike, SchedulerConnector, TransferReport
from scheduler.kv_connector_types import (
    Completion,
    ConnectorStats,
    KVConnectorConfig,
    PlannedStore,
    RequestState,
    ScheduledStep,
    StoreBatch,
    TransferJob,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class KVServerSchedulerConnector(SchedulerConnector):
    """The scheduler-side connector over one kvserver client; see the module docstring."""

    def __init__(
        self,
        config: KVConnectorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        client: KVClient | None = None,
    ) -> None:
        """``client``: the kvserver client to use (tests pass an instrumented one); by default
        one for ``config.address`` that never maps the arena (the scheduler moves no bytes)."""
        self.config = config
        self.spec = spec = config.spec
        self.ns_id = spec.ns_id
        self.stats = ConnectorStats()
        self._clock = clock
        self._hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
        self._kv = client or KVClient(
            config.address, timeout=config.op_timeout_s, client_id=config.client_id,
            auth_token=config.auth_token, colocated=False,
        )  # fmt: skip
        self._lease = config.lease_s
        self._registered = False
        self._down_until = 0.0
        self._reqs: dict[str, RequestState] = {}
        self._jobs: dict[tuple[bool, str, int], TransferJob] = {}
        #: loads planned in this step and stores reserved for the previous one.
        self._to_ship: list[TransferJob] = []
        self._preempted: set[str] = set()
        #: chunk key -> planned or in-flight stores of it (lookups answer "ask again").
        self._keys_storing: dict[bytes, int] = {}
        #: this step's prepare_store, sent at the end of build_connector_meta.
        self._batch: StoreBatch | None = None
        self._batch_limit = config.max_store_batch_chunks
        #: completions sent by update_connector_output, replies not applied yet.
        self._completions: list[Completion] = []
        self._report = TransferReport()
        #: hits that could not be pinned since the last metadata (shipped as failed_loads).
        self._failed_loads: list[FailedLoad] = []
        self._events: list[Event] = []
        self._event_seq = 0

    @property
    def client(self) -> KVClient:
        """The kvserver client (its ``sent_by_op`` counts the daemon calls made)."""
        return self._kv

    def close(self) -> None:
        """:meth:`reset` (best effort on the daemon), then close the client."""
        self.reset()
        self._kv.close()

    def __enter__(self) -> KVServerSchedulerConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Forget every request and transfer (the workers lost their GPU contents): this
        client's reservations are rolled back and its pins released on the daemon (one
        blocking ``release``, skipped while it is marked down: the leases then expire); replies
        still due are dropped (completions already sent stand)."""
        holds_leases = bool(self._jobs) or self._batch is not None
        if self._batch is not None:
            self._batch.pending.cancel()  # release() below also rolls this reservation back
            self._batch = None
        for completion in self._completions:
            completion.pending.cancel()
        self._completions.clear()
        if holds_leases and not self.is_daemon_down:
            try:
                self._op(lambda kv: kv.release())
            except KVServerError as exc:
                logger.info("could not release leases on reset: %s", exc)
        self._reqs.clear()
        self._jobs.clear()
        self._to_ship.clear()
        self._preempted.clear()
        self._keys_storing.clear()
        self._failed_loads.clear()
        self._report = TransferReport()

    @property
    def has_pending_transfers(self) -> bool:
        """True while a transfer is planned or in flight: keep stepping (empty steps too).
        Completions sent but not yet answered do not count (see :meth:`drain`)."""
        return bool(self._jobs) or self._batch is not None

    def num_pending(self, req_id: str) -> tuple[int, int]:
        """(loads, stores) of request ``req_id`` planned or in flight; (0, 0) if none."""
        state = self._reqs.get(req_id)
        return (0, 0) if state is None else (state.num_loads, state.num_stores)

    def drain(self) -> None:
        """Wait for the replies of every call sent without waiting (each at most
        ``op_timeout_s``) and apply them: the reserved stores become jobs (shipped by the next
        metadata, as always), completed chunks become events and counters. The step methods
        do this when they need the replies; call it to look at the daemon through another
        client right after a step (this client's own calls are ordered after them anyway)."""
        self._collect_store_batch()
        self._collect_completions(wait=True)

    @property
    def is_daemon_down(self) -> bool:
        return self._clock() < self._down_until

    # ------------------------------------------------------------------ the six methods

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        state.plan = None
        if state.num_loads or state.num_stores:
            return None, False  # an earlier transfer of this request is in flight
        ct, cb = self.spec.chunk_tokens, self.spec.chunk_blocks
        hashes = self._block_hashes(state)
        # Only chunks within the first num_tokens - 1 tokens: one token is left to compute.
        max_chunks = min(len(hashes) // cb, (len(request.all_token_ids) - 1) // ct)
        start = num_computed_tokens // ct
        if max_chunks <= start:
            return 0, False
        keys = list(hashes[start * cb + cb - 1 : max_chunks * cb : cb])
        self.stats.lookups += 1
        try:
            hits = self._call(
                self.config.lookup_timeout_s,
                lambda kv: kv.lookup(self.ns_id, keys, record=True, touch=True).hit_chunks,
            )
        except KVServerError as exc:
            self.stats.lookups_failed += 1
            logger.debug("lookup for %s failed, no external hit: %s", request.request_id, exc)
            return 0, False
        if hits < len(keys) and keys[hits] in self._keys_storing:
            return None, False  # the next chunk is being stored right now: ask again
        if hits == 0:
            return 0, False
        num_external = (start + hits) * ct - num_computed_tokens
        state.plan = (num_computed_tokens, start, keys[:hits])
        self.stats.hit_tokens += num_external
        return num_external, True

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Pins the hit chunks and pairs them with ``block_ids`` (the request's blocks from 0).

        Raises InvalidArgument (nothing changed) if ``num_external_tokens`` is neither 0 nor
        what the last ``get_num_new_matched_tokens`` offered, or the blocks do not cover it. A
        hit that can no longer be pinned is reported by the next ``update_connector_output`` as
        a finished load with a load error (the scheduler recomputes those tokens).
        """
        state = self._state(request)
        req_id, plan = request.request_id, state.plan
        bs, ct, cb = self.spec.block_size, self.spec.chunk_tokens, self.spec.chunk_blocks
        if num_external_tokens and plan is None:
            raise InvalidArgument("no external tokens were offered", request=req_id)
        if not num_external_tokens or plan is None:
            # A request without a block table is new or preempted: store from chunk 0. One
            # that holds blocks is admitted after its load landed: keep its cursor (past the
            # loaded chunks), or the stored chunks would be planned again.
            if not state.block_ids:
                state.cursor = 0
            state.block_ids, state.plan = list(block_ids), None
            return
        num_local, start, keys = plan
        end = start + len(keys)
        if num_local + num_external_tokens != end * ct or len(block_ids) < end * cb:
            raise InvalidArgument(
                "num_external_tokens or block_ids do not match the offered hit",
                got=num_external_tokens, offered=end * ct - num_local, blocks=len(block_ids),
            )  # fmt: skip
        state.block_ids, state.plan = list(block_ids), None
        loads: list[ChunkLoad] = []
        first_tokens: list[int] = []
        for i, key in enumerate(keys, start):
            skip = max(0, num_local // bs - i * cb)  # leading sub-blocks already on the GPU
            loads.append(ChunkLoad(key, state.block_ids[i * cb + skip : (i + 1) * cb], skip))
            first_tokens.append(max(num_local, (i * cb + skip) * bs))
        self.stats.loads += 1
        grant: LoadGrant | None = None
        try:
            grant = self._op(lambda kv: kv.prepare_load(self.ns_id, keys, lease_s=self._lease))
        except UnknownKey:  # evicted since the lookup: pin what is left of the prefix
            grant = self._pin_prefix(keys)
        except KVServerError as exc:
            logger.info("cannot pin the hit of %s, recomputing it: %s", req_id, exc)
        num_ok = len(grant.keys) if grant is not None else 0
        if num_ok < len(keys):
            failed = [c.block_ids for c in loads[num_ok:]]
            self._load_error(req_id, first_tokens[num_ok], failed)
            self._failed_loads.append(
                FailedLoad(req_id, [b for ids in failed for b in ids], finished=not num_ok)
            )
        if grant is None or not num_ok:
            self._report.finished_recving.add(req_id)
            return
        # kvserver has the loaded chunks, the GPU prefix cache the ones before: store after.
        state.cursor = start + num_ok
        for load, location in zip(loads, grant.locations, strict=False):
            load.extents = [list(extents) for extents in location]
        transfers = RequestTransfers(req_id, grant.lease_id, loads=loads[:num_ok])
        job = TransferJob(
            transfers, True, keys[:num_ok], grant.deadline, first_tokens[:num_ok], start
        )
        self._add_job(state, job)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Applies the reply of the previous step's store reservation (waiting at most
        ``op_timeout_s``; it normally arrived during the workers' step), ships this step's
        loads and the stores reserved for the previous step, names the preempted requests that
        need a store barrier, and sends this step's store reservation (one ``prepare_store``
        for every request, not waited for), which the next call ships."""
        step: ScheduledStep = scheduler_output
        self._collect_store_batch()
        self._expire()
        meta = ConnectorMetadata(ns_id=self.ns_id, failed_loads=self._failed_loads)
        self._failed_loads = []
        for job in self._to_ship:
            (meta.loads if job.is_load else meta.stores).append(job.transfers)
            job.shipped = True
        self._to_ship = []
        self.handle_preemptions(getattr(step, "preempted_req_ids", ()))
        meta.flush_req_ids = sorted(
            r for r in self._preempted if (s := self._reqs.get(r)) is not None and s.num_stores
        )
        self._preempted.clear()
        # One pass: block tables (new_reqs replace, cached_reqs append), then the chunks full
        # after this step, planned only past the cursor (an integer check for most requests).
        reqs, sched, ct = self._reqs, step.num_scheduled_tokens, self.spec.chunk_tokens
        planned: list[PlannedStore] = []
        room = self._batch_limit
        scheduled: list[tuple[RequestState, int]] = []
        for new in getattr(step, "new_reqs", ()):
            if (state := reqs.get(new.req_id)) is not None:
                state.block_ids = list(new.block_ids)
                scheduled.append((state, new.num_computed_tokens + sched.get(new.req_id, 0)))
        for cached in getattr(step, "cached_reqs", ()):
            if (state := reqs.get(cached.req_id)) is not None:
                if cached.new_block_ids:
                    state.block_ids += cached.new_block_ids
                done = cached.num_computed_tokens + sched.get(cached.req_id, 0)
                if done // ct > state.cursor:
                    scheduled.append((state, done))
        for state, done in scheduled:
            if room <= 0 or state.finished or done // ct <= state.cursor:
                continue
            if (p := self._plan_stores(state, done, room)) is not None:
                planned.append(p)
                room -= len(p.keys)
        if planned:
            self._send_store_batch(planned)
        return meta

    def update_connector_output(self, outputs: Sequence[Any]) -> TransferReport:
        """Takes each rank's :class:`ConnectorWorkerOutput`. A lease is completed on the daemon
        once every rank reported it: a load is unpinned; a store's chunks become ready, or are
        rolled back when some rank failed them. The completions are sent without waiting;
        the replies of those sent by the previous call are applied first (waiting at most
        ``op_timeout_s`` each: they had a whole step to arrive)."""
        self._collect_completions(wait=True)
        world = self.spec.tp_world_size
        finished: list[TransferJob] = []
        for out in outputs:
            if not isinstance(out, ConnectorWorkerOutput):
                raise InvalidArgument("outputs must be ConnectorWorkerOutput", got=type(out))
            if not 0 <= out.rank < world:
                logger.warning("ignoring a report from rank %s (world %d)", out.rank, world)
                continue
            for is_load, results in ((True, out.loads), (False, out.stores)):
                for res in results:
                    job = self._jobs.get((is_load, res.req_id, res.lease_id))
                    if job is None or not job.shipped:
                        logger.debug("ignoring a report of unknown lease %d", res.lease_id)
                        continue
                    job.ranks.add(out.rank)
                    if res.failed_keys:
                        job.failed.update(k for k in res.failed_keys if k in job.keys)
                    if len(job.ranks) == world:
                        self._finish(job)
                        finished.append(job)
        if finished:
            self._send_completions(finished)
        report, self._report = self._report, TransferReport()
        return report

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while loads or stores of the request are planned or in flight: its blocks are
        freed once it appears in a report's ``finished_sending``."""
        state = self._reqs.get(request.request_id)
        if state is not None and (state.num_loads or state.num_stores):
            state.finished, state.plan = True, None
            return True, None
        self._reqs.pop(request.request_id, None)
        return False, None

    def take_events(self) -> list[Event]:
        """BlockStored for chunks this connector made ready, BlockRemoved for hit chunks it
        found gone; ``seq`` counts this connector's events. Applies the completion replies
        that already arrived first (without waiting)."""
        if self._completions:
            self._collect_completions(wait=False)
        events, self._events = self._events, []
        return events

    def handle_preemptions(self, req_ids: Iterable[str]) -> set[str]:
        """Notes preempted requests (``build_connector_meta`` also reads the step's
        ``preempted_req_ids``); returns those with stores in flight. The next metadata names
        them in ``flush_req_ids``: workers finish reading their blocks before that step's loads
        and forward pass, so the scheduler may hand the blocks to other requests right away."""
        barrier = set()
        for req_id in req_ids:
            if (state := self._reqs.get(req_id)) is not None:
                self._preempted.add(req_id)
                state.block_ids, state.plan = [], None
                if state.num_stores:
                    barrier.add(req_id)
        return barrier

    # ------------------------------------------------------------------ internals

    def _call(self, timeout: float, fn: Callable[[KVClient], T]) -> T:
        """One client call under ``timeout``, skipped at once while the daemon is marked down."""
        if self.is_daemon_down:
            raise Unavailable("daemon marked down", address=self.config.address)
        self._kv.timeout = timeout
        try:
            if not self._registered:
                self._kv.register_namespace(self.spec)
                self._registered = True
            return fn(self._kv)
        except Unavailable:
            self._mark_down()
            raise

    def _mark_down(self) -> None:
        self.stats.timeouts += 1
        self._down_until = self._clock() + self.config.down_backoff_s
        logger.warning(
            "kvserver at %s unreachable; skipped for %.1fs",
            self.config.address, self.config.down_backoff_s,
        )  # fmt: skip

    def _op(self, fn: Callable[[KVClient], T]) -> T:
        return self._call(self.config.op_timeout_s, fn)

    def _submit(self, fn: Callable[[KVClient], Pending[T]]) -> Pending[T] | None:
        """Send one call without waiting; None (logged) when it could not be sent: the daemon
        is marked down, or unreachable now (which marks it down)."""
        try:
            return self._op(fn)
        except KVServerError as exc:
            logger.debug("not sent: %s", exc)
            return None

    def _result(self, pending: Pending[T]) -> T:
        """The reply of a call sent earlier, waited for at most ``op_timeout_s``. Unavailable
        (no reply in time, or the socket was replaced by a timeout meanwhile) marks the daemon
        down unless it already is."""
        try:
            return pending.result(self.config.op_timeout_s)
        except Unavailable:
            if not self.is_daemon_down:
                self._mark_down()
            raise

    def _state(self, request: RequestLike) -> RequestState:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = RequestState(request)
        state.request = request
        return state

    def _block_hashes(self, state: RequestState) -> Sequence[bytes]:
        """The request's own block hashes, else ones computed (and extended) here."""
        req = state.request
        if req.block_hashes:
            return req.block_hashes
        bs, done, tokens = self.spec.block_size, len(state.hashes), req.all_token_ids
        if len(tokens) // bs > done:
            state.hashes += self._hasher.hash_blocks(
                tokens[done * bs : len(tokens) // bs * bs],
                cache_salt=req.cache_salt,
                lora=_lora(req),
                parent=BlockHash(state.hashes[-1]) if done else None,
                start_block=done,
            )
        return state.hashes

    def _pin_prefix(self, keys: list[bytes]) -> LoadGrant | None:
        """Pin the leading run of ``keys`` still ready; announce the first one that is gone."""
        try:
            hits = self._op(lambda kv: kv.lookup(self.ns_id, keys).hit_chunks)
            self._emit(BlockRemoved, keys[hits : hits + 1])
            if hits:
                return self._op(
                    lambda kv: kv.prepare_load(self.ns_id, keys[:hits], lease_s=self._lease)
                )
        except KVServerError as exc:
            logger.info("cannot pin what is left of a hit: %s", exc)
        return None

    def _plan_stores(self, state: RequestState, num_tokens: int, room: int) -> PlannedStore | None:
        """The chunks from the cursor up to the last one full after ``num_tokens`` (at most
        ``room`` of them), or None if there are none."""
        req, bs, cb = state.request, self.spec.block_size, self.spec.chunk_blocks
        hashes = self._block_hashes(state)
        num_blocks = min(num_tokens, len(req.all_token_ids)) // bs
        num_chunks = min(num_blocks, len(hashes), len(state.block_ids)) // cb
        first = state.cursor
        end = min(num_chunks, first + room)
        if end <= first:
            return None
        keys = list(hashes[first * cb + cb - 1 : end * cb : cb])
        return PlannedStore(state, first, end, keys, state.block_ids[first * cb : end * cb])

    def _send_store_batch(self, planned: list[PlannedStore]) -> None:
        """One prepare_store for every planned chunk, not waited for. Unsent (daemon down or
        unreachable): the cursors stay, so the chunks are planned again next step."""
        keys = list(dict.fromkeys(key for p in planned for key in p.keys))
        self.stats.planned_chunks += sum(len(p.keys) for p in planned)
        pending = self._submit(
            lambda kv: kv.submit_prepare_store(self.ns_id, keys, lease_s=self._lease)
        )
        if pending is None:
            return
        storing = self._keys_storing
        for p in planned:
            p.state.num_stores += 1
            for key in p.keys:
                storing[key] = storing.get(key, 0) + 1
        self._batch = StoreBatch(pending, planned, keys)

    def _collect_store_batch(self) -> None:
        """Apply the reply of the store batch in flight: each granted chunk becomes a
        ChunkStore of the first request that planned it, one job per request (all in the
        batch's one lease), shipped by the next metadata; cursors move past what was planned.
        Unreachable or a full cache: cursors stay (a full cache halves the next batch)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        try:
            grant = self._result(batch.pending)
        except Unavailable:
            self._drop_batch(batch, skip=False)
            return
        except KVServerError as exc:
            logger.warning("prepare_store of %d chunks refused: %s", len(batch.keys), exc)
            self._drop_batch(batch, skip=True)  # it would fail again
            return
        if grant is None:
            self.stats.store_rejections += 1
            self._batch_limit = max(1, len(batch.keys) // 2)
            self._drop_batch(batch, skip=False)
            return
        self._batch_limit = min(self._batch_limit * 2, self.config.max_store_batch_chunks)
        locations = dict(zip(grant.keys, grant.locations, strict=True))
        lease_id, deadline, cb = grant.lease_id, grant.deadline, self.spec.chunk_blocks
        for p in batch.planned:
            state, blocks = p.state, p.block_ids
            state.num_stores -= 1
            if state.cursor < p.end:
                state.cursor = p.end
            stores: list[ChunkStore] = []
            for i, key in enumerate(p.keys):
                location = locations.pop(key, None)
                if location is None:  # present already, filtered, or another request's
                    self._unmark_storing(key)
                else:  # stays marked until the job is over
                    extents = [list(rank_extents) for rank_extents in location]
                    stores.append(ChunkStore(key, blocks[i * cb : (i + 1) * cb], extents))
            if not stores:
                self._release_if_done(state)
                continue
            transfers = RequestTransfers(state.request.request_id, lease_id, stores=stores)
            job = TransferJob(transfers, False, [c.key for c in stores], deadline)
            self._add_job(state, job)

    def _drop_batch(self, batch: StoreBatch, *, skip: bool) -> None:
        """Nothing reserved: the chunks are planned again next step, or never (``skip``)."""
        for p in batch.planned:
            p.state.num_stores -= 1
            for key in p.keys:
                self._unmark_storing(key)
            if skip and p.state.cursor < p.end:
                p.state.cursor = p.end
            self._release_if_done(p.state)

    def _add_job(self, state: RequestState, job: TransferJob) -> None:
        self._jobs[job.id] = job
        self._to_ship.append(job)
        if job.is_load:
            state.num_loads += 1
        else:
            state.num_stores += 1

    def _finish(self, job: TransferJob, *, expired: bool = False) -> None:
        """Every rank reported (or the lease expired): update the request and the report. The
        daemon calls are :meth:`_send_completions`' (none for an expired lease: the daemon
        reclaimed it already)."""
        del self._jobs[job.id]
        _, req_id, _ = job.id
        if not job.is_load:
            for key in job.keys:
                self._unmark_storing(key)
        state = self._reqs.get(req_id)
        if state is None:
            return
        if job.is_load:
            state.num_loads -= 1
            self._report.finished_recving.add(req_id)
            bad = [i for i, k in enumerate(job.keys) if k in job.failed]
            if bad:
                first = min(job.first_tokens[i] for i in bad)
                blocks = [c.block_ids for c in job.transfers.loads if c.key in job.failed]
                self._load_error(req_id, first, blocks)
                # those chunks are recomputed: store them afterwards
                state.cursor = min(state.cursor, job.first_chunk + bad[0])
        else:
            state.num_stores -= 1
        self._release_if_done(state)

    def _release_if_done(self, state: RequestState) -> None:
        """A finished request with nothing planned or in flight: its blocks may be freed."""
        if state.finished and not state.num_loads and not state.num_stores:
            req_id = state.request.request_id
            self._report.finished_sending.add(req_id)
            self._reqs.pop(req_id, None)

    def _unmark_storing(self, key: bytes) -> None:
        left = self._keys_storing[key] - 1
        if left:
            self._keys_storing[key] = left
        else:
            del self._keys_storing[key]

    def _send_completions(self, jobs: list[TransferJob]) -> None:
        """Complete the finished leases on the daemon without waiting: one complete_store per
        store lease (its chunks every rank wrote, all jobs of the lease together), one rollback
        per lease with chunks some rank failed, one complete_load per load lease."""
        stores: dict[int, tuple[list[bytes], list[bytes]]] = {}
        loads: list[int] = []
        for job in jobs:
            lease_id = job.transfers.lease_id
            if job.is_load:
                loads.append(lease_id)
                continue
            ok, bad = stores.setdefault(lease_id, ([], []))
            if not job.failed:
                ok += job.keys
                continue
            for key in job.keys:
                (bad if key in job.failed else ok).append(key)
        for lease_id, (ok, bad) in stores.items():
            if ok:
                self._send_completion("store", lease_id, ok)
            if bad:
                self._send_completion("rollback", lease_id, bad)
        for lease_id in dict.fromkeys(loads):
            self._send_completion("load", lease_id, [])

    def _send_completion(
        self, kind: Literal["store", "rollback", "load"], lease_id: int, keys: list[bytes]
    ) -> None:
        if kind == "load":
            pending: Pending[Any] | None = self._submit(
                lambda kv: kv.submit_complete_load(lease_id)
            )
        else:
            pending = self._submit(
                lambda kv: kv.submit_complete_store(lease_id, success=kind == "store", keys=keys)
            )
        if pending is None:  # skipped: the daemon reclaims the lease at its deadline
            self.stats.completion_errors += 1
            return
        self._completions.append(Completion(pending, kind, lease_id))

    def _collect_completions(self, *, wait: bool) -> None:
        """Apply completion replies: chunks made ready count as stored (a BlockStored event);
        an error is logged and counted, its chunks are not stored. ``wait``: wait for each
        (at most ``op_timeout_s``); else only those that already arrived."""
        left: list[Completion] = []
        for completion in self._completions:
            if not wait and not completion.pending.done():
                left.append(completion)
                continue
            try:
                ready = self._result(completion.pending)
            except KVServerError as exc:
                self.stats.completion_errors += 1
                logger.info("%s of lease %d failed: %s", completion.kind, completion.lease_id, exc)
                continue
            if completion.kind == "store":
                self.stats.stored_chunks += len(ready)
                self._emit(BlockStored, ready)
        self._completions = left

    def _load_error(self, req_id: str, num_valid: int, blocks: Iterable[list[int]]) -> None:
        self.stats.load_errors += 1
        errors = self._report.load_errors
        errors[req_id] = min(num_valid, errors.get(req_id, num_valid))
        for ids in blocks:
            self._report.invalid_block_ids.update(ids)

    def _expire(self) -> None:
        """Leases no worker completed by their deadline: the workers are presumed dead, the
        daemon has rolled the lease back. Loads fail (recompute), stores are dropped."""
        now = self._clock()
        for job in [j for j in self._jobs.values() if j.shipped and j.deadline < now]:
            logger.warning("lease %d of %s expired unreported", job.id[2], job.id[1])
            self.stats.expired_jobs += 1
            job.failed.update(job.keys)
            self._finish(job, expired=True)

    def _emit(self, kind: type[BlockStored | BlockRemoved], keys: Sequence[bytes]) -> None:
        if keys:
            self._event_seq += 1
            self._events.append(kind(self._event_seq, self.ns_id, tuple(keys), MEDIUM_DRAM))


def _lora(request: RequestLike) -> tuple[str, str] | None:
    """(name, path) of vLLM's ``request.lora_request`` when the request has one."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else (str(lora.lora_name), str(lora.lora_path))
