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

**Loads** are pinned (``prepare_load``) in ``update_state_after_alloc`` and shipped in this
step's metadata. **Stores** are reserved (``prepare_store``, once per request per step, for the
chunks from the request's cursor to the last chunk full after this step) and shipped in the NEXT
step's metadata (seed 000 §11.2). A lease is completed once every TP rank has reported it.

Invariants:
- a chunk below a request's ``cursor`` is never planned again (after a preemption the cursor
  restarts at 0 and the daemon's presence filter keeps stored chunks from being copied again);
- a request with loads or stores in flight keeps its GPU blocks: ``request_finished`` returns
  True and the request shows up in ``finished_sending`` once they are over; a preempted one is
  named in ``flush_req_ids`` so workers finish reading its blocks before anything rewrites them;
- every lease taken is completed, rolled back, or left to expire on the daemon.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvserver.client import KVClient
from kvserver.connector_messages import (
    ChunkLoad,
    ChunkStore,
    ConnectorMetadata,
    ConnectorWorkerOutput,
    RequestTransfers,
)
from kvserver.engine_types import LoadGrant
from kvserver.errors import InvalidArgument, KVServerError, Unavailable, UnknownKey
from kvserver.events import MEDIUM_DRAM, BlockRemoved, BlockStored, Event
from kvserver.hashing import BlockHash, BlockHasher
from scheduler.connector_base import RequestLike, SchedulerConnector, TransferReport
from scheduler.kv_connector_types import (
    ConnectorStats,
    KVConnectorConfig,
    RequestState,
    ScheduledStep,
    TransferJob,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class KVServerSchedulerConnector(SchedulerConnector):
    """The scheduler-side connector over one kvserver client; see the module docstring."""

    def __init__(
        self, config: KVConnectorConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.spec = spec = config.spec
        self.ns_id = spec.ns_id
        self.stats = ConnectorStats()
        self._clock = clock
        self._hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
        # colocated=False: the scheduler never touches payload, so it never maps the arena.
        self._kv = KVClient(
            config.address, timeout=config.op_timeout_s, client_id=config.client_id,
            auth_token=config.auth_token, colocated=False,
        )  # fmt: skip
        self._lease = config.lease_s
        self._registered = False
        self._down_until = 0.0
        self._reqs: dict[str, RequestState] = {}
        self._jobs: dict[tuple[bool, str, int], TransferJob] = {}
        #: loads planned in this step and stores planned in the previous one.
        self._to_ship: list[TransferJob] = []
        self._preempted: set[str] = set()
        self._keys_storing: dict[bytes, int] = {}
        self._report = TransferReport()
        self._events: list[Event] = []
        self._event_seq = 0

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
        client's reservations are rolled back and its pins released on the daemon."""
        if self._jobs and not self.is_daemon_down:
            try:
                self._op(lambda kv: kv.release())
            except KVServerError as exc:
                logger.info("could not release leases on reset: %s", exc)
        self._reqs.clear()
        self._jobs.clear()
        self._to_ship.clear()
        self._preempted.clear()
        self._keys_storing.clear()
        self._report = TransferReport()

    @property
    def has_pending_transfers(self) -> bool:
        """True while a transfer is planned or in flight: keep stepping (empty steps too)."""
        return bool(self._jobs)

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
            state.block_ids, state.cursor, state.plan = list(block_ids), 0, None
            return
        num_local, start, keys = plan
        end = start + len(keys)
        if num_local + num_external_tokens != end * ct or len(block_ids) < end * cb:
            raise InvalidArgument(
                "num_external_tokens or block_ids do not match the offered hit",
                got=num_external_tokens, offered=end * ct - num_local, blocks=len(block_ids),
            )  # fmt: skip
        state.block_ids, state.cursor, state.plan = list(block_ids), 0, None
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
            self._load_error(req_id, first_tokens[num_ok], [c.block_ids for c in loads[num_ok:]])
        if grant is None or not num_ok:
            self._report.finished_recving.add(req_id)
            return
        for load, location in zip(loads, grant.locations, strict=False):
            load.extents = [list(extents) for extents in location]
        transfers = RequestTransfers(req_id, grant.lease_id, loads=loads[:num_ok])
        job = TransferJob(transfers, True, keys[:num_ok], grant.deadline, first_tokens[:num_ok])
        self._add_job(state, job)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Ships this step's loads and the stores planned in the previous step, names the
        preempted requests that need a store barrier, and plans (reserves) this step's stores,
        which the next call ships."""
        step: ScheduledStep = scheduler_output
        self._expire()
        meta = ConnectorMetadata(ns_id=self.ns_id)
        for job in self._to_ship:
            (meta.loads if job.is_load else meta.stores).append(job.transfers)
            job.shipped = True
        self._to_ship = []
        self.handle_preemptions(getattr(step, "preempted_req_ids", ()))
        meta.flush_req_ids = sorted(
            r for r in self._preempted if (s := self._reqs.get(r)) is not None and s.num_stores
        )
        self._preempted.clear()
        computed: dict[str, int] = {}
        for new in getattr(step, "new_reqs", ()):
            if (state := self._reqs.get(new.req_id)) is not None:
                state.block_ids = list(new.block_ids)
                computed[new.req_id] = new.num_computed_tokens
        for cached in getattr(step, "cached_reqs", ()):
            if (state := self._reqs.get(cached.req_id)) is not None:
                state.block_ids += cached.new_block_ids
                computed[cached.req_id] = cached.num_computed_tokens
        for req_id, num_tokens in step.num_scheduled_tokens.items():
            state = self._reqs.get(req_id)
            if state is not None and not state.finished:
                done = computed.get(req_id, state.request.num_computed_tokens)
                self._plan_stores(state, done + num_tokens)
        return meta

    def update_connector_output(self, outputs: Sequence[Any]) -> TransferReport:
        """Takes each rank's :class:`ConnectorWorkerOutput`. A lease is completed on the daemon
        once every rank reported it: a load is unpinned; a store's chunks become ready, or are
        rolled back when some rank failed them."""
        world = self.spec.tp_world_size
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
                    job.failed.update(k for k in res.failed_keys if k in job.keys)
                    if len(job.ranks) == world:
                        self._finish(job)
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
        found gone; ``seq`` counts this connector's events."""
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
            self.stats.timeouts += 1
            self._down_until = self._clock() + self.config.down_backoff_s
            logger.warning(
                "kvserver at %s unreachable; skipped for %.1fs",
                self.config.address, self.config.down_backoff_s,
            )  # fmt: skip
            raise

    def _op(self, fn: Callable[[KVClient], T]) -> T:
        return self._call(self.config.op_timeout_s, fn)

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

    def _plan_stores(self, state: RequestState, num_tokens: int) -> None:
        """Reserve the chunks from the cursor up to the last one full after ``num_tokens``."""
        req, bs, cb = state.request, self.spec.block_size, self.spec.chunk_blocks
        hashes = self._block_hashes(state)
        num_blocks = min(num_tokens, len(req.all_token_ids)) // bs
        num_chunks = min(num_blocks, len(hashes), len(state.block_ids)) // cb
        first = state.cursor
        if num_chunks <= first:
            return
        keys = list(hashes[first * cb + cb - 1 : num_chunks * cb : cb])
        self.stats.planned_chunks += len(keys)
        try:
            grant = self._op(lambda kv: kv.prepare_store(self.ns_id, keys, lease_s=self._lease))
        except Unavailable:
            return  # retried next step: the blocks stay valid while the request holds them
        except KVServerError as exc:
            logger.warning("prepare_store for %s refused: %s", req.request_id, exc)
            state.cursor = num_chunks  # it would fail again
            return
        if grant is None:
            self.stats.store_rejections += 1
            return  # cache full: retried next step from the same cursor
        state.cursor = num_chunks
        if not grant.keys:
            return  # every chunk present already, or filtered by reuse gating
        index = {key: first + i for i, key in enumerate(keys)}
        stores = [
            ChunkStore(key, state.block_ids[index[key] * cb : (index[key] + 1) * cb],
                       [list(extents) for extents in location])
            for key, location in zip(grant.keys, grant.locations, strict=True)
        ]  # fmt: skip
        transfers = RequestTransfers(req.request_id, grant.lease_id, stores=stores)
        for key in grant.keys:
            self._keys_storing[key] = self._keys_storing.get(key, 0) + 1
        self._add_job(state, TransferJob(transfers, False, list(grant.keys), grant.deadline))

    def _add_job(self, state: RequestState, job: TransferJob) -> None:
        self._jobs[job.id] = job
        self._to_ship.append(job)
        if job.is_load:
            state.num_loads += 1
        else:
            state.num_stores += 1

    def _finish(self, job: TransferJob, *, expired: bool = False) -> None:
        """Every rank reported (or the lease expired): complete it on the daemon, report."""
        del self._jobs[job.id]
        _, req_id, lease_id = job.id
        ok = [k for k in job.keys if k not in job.failed]
        bad = [k for k in job.keys if k in job.failed]
        try:
            if expired:
                pass  # the daemon reclaimed the lease already
            elif job.is_load:
                self._op(lambda kv: kv.complete_load(lease_id))
            else:
                if ok:
                    ready = self._op(lambda kv: kv.complete_store(lease_id, keys=ok))
                    self.stats.stored_chunks += len(ready)
                    self._emit(BlockStored, ready)
                if bad:
                    self._op(lambda kv: kv.complete_store(lease_id, success=False, keys=bad))
        except KVServerError as exc:  # the daemon reclaims the lease at its deadline
            logger.info("completing lease %d of %s failed: %s", lease_id, req_id, exc)
        for key in () if job.is_load else job.keys:
            self._keys_storing[key] -= 1
            if not self._keys_storing[key]:
                del self._keys_storing[key]
        state = self._reqs.get(req_id)
        if state is None:
            return
        if job.is_load:
            state.num_loads -= 1
            self._report.finished_recving.add(req_id)
            if bad:
                first = min(job.first_tokens[job.keys.index(k)] for k in bad)
                blocks = [c.block_ids for c in job.transfers.loads if c.key in job.failed]
                self._load_error(req_id, first, blocks)
        else:
            state.num_stores -= 1
        if state.finished and not state.num_loads and not state.num_stores:
            self._report.finished_sending.add(req_id)
            del self._reqs[req_id]

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
