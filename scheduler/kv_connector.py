"""KVServerSchedulerConnector: the scheduler half of the kvserver KV connector.

Runs in the scheduler process, on the scheduler's thread, inside ``schedule()`` and
``update_from_output()``; not thread-safe; holds no tensors: it plans, workers copy bytes. Call
order: :mod:`scheduler.connector_base`; per-step flow, metadata, worker contract, failures:
docs/connector.md and :class:`~step_protocol.ConnectorMetadata`.

Modules (one concept each; imports go one way, from this facade to the parts, which share the
connector's request records by reference and change them only through their methods):

- :mod:`scheduler.kv_connector_link` — ``DaemonLink``: the client, the timeouts, the circuit
  breaker;
- :mod:`scheduler.kv_connector_loads` — ``LoadPlanner``: lookups and pins (admission);
- :mod:`scheduler.kv_connector_stores` — ``StorePlanner``: block tables, the store cursor and
  the one store batch per step (plan, send, read the reply, hand the jobs over);
- :mod:`scheduler.kv_connector_due` — ``StoreCalendar``: which scheduled requests have a chunk
  full after the step, without visiting the others in steady decode;
- :mod:`scheduler.kv_connector_leases` — ``LeaseBook``: jobs under leases, shipping, the
  workers' reports, lease completion, expiry, the report and the events;
- :mod:`scheduler.kv_connector_request` — ``RequestState``: one request's block table, store
  cursor and transfers in flight, changed only through its methods, which enforce its
  invariants;
- :mod:`scheduler.kv_connector_types` — configuration, counters and records.

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
without waiting. Its reply is taken by ``update_connector_output`` if it has arrived by then
(never waiting there: the store jobs are built and queued, nothing the scheduler can observe
changes), and applied at the start of the next ``build_connector_meta`` — read there, waiting
at most ``op_timeout_s``, if it had not arrived — when those stores ship anyway (deferred one
step): the round trip overlaps the workers' step instead of lengthening the
scheduler's. A lease is
completed once every TP rank has reported it: one ``complete_store`` per lease with finished
chunks (plus one rollback when a rank failed some) and one ``complete_load`` per finished load,
sent without waiting from ``update_connector_output``; their replies (events, counters,
errors) are applied by the next ``update_connector_output`` (or earlier by ``take_events`` once
arrived, or :meth:`drain`). The daemon applies one client's requests in order, so this
connector's own later lookups already see completed chunks. Per step that is 1 reservation +
about 1 completion, whatever the number of requests.

**Cost per step** (docs/benchmarks.md, "Scheduler step"): one pass over the cached requests
that appends new block ids where there are some; the requests with a chunk full after the step
are found by the store calendar without looking at the others (steady decode), and only they
do more (keys, one ``PlannedStore``). No per-step index is rebuilt: the set of chunks being
stored (lookups) is built only when a lookup needs it after a change, lease expiry is one
comparison with the earliest deadline, and the store batch's reply is turned into jobs outside
``schedule()`` when it has arrived.

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
from typing import Any

from prometheus_client import Histogram

from kvserver.client import KVClient
from kvserver.errors import KVServerError
from kvserver.events import Event
from kvserver.hashing import BlockHasher
from scheduler.connector_base import RequestLike, SchedulerConnector, TransferReport
from scheduler.kv_connector_leases import LeaseBook
from scheduler.kv_connector_link import DaemonLink
from scheduler.kv_connector_loads import LoadPlanner
from scheduler.kv_connector_request import RequestState
from scheduler.kv_connector_stores import StorePlanner
from scheduler.kv_connector_types import ConnectorStats, KVConnectorConfig, ScheduledStep
from step_protocol import ConnectorMetadata

__all__ = ["KVConnectorConfig", "KVServerSchedulerConnector"]

logger = logging.getLogger(__name__)


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
        hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
        self._link = DaemonLink(config, self.stats, clock, client)
        self._reqs: dict[str, RequestState] = {}
        self._leases = LeaseBook(self._reqs, self._link, self.stats, clock)
        self._stores = StorePlanner(self._reqs, self._link, self._leases, self.stats, hasher)
        self._loads = LoadPlanner(
            self._link, self._leases, self.stats, hasher, self._stores.is_storing, clock
        )
        self._preempted: set[str] = set()
        #: reset(release=False) forgot transfers that held leases: release_forgotten() owes
        #: the daemon a release.
        self._release_due = False

    def probe(self) -> str | None:
        """Reach the daemon now and register the namespace (a start-up check): None when it
        answered, else why not (a daemon that does not answer is then marked down, as on any
        call; the connector keeps trying at every lookup after the back-off)."""
        try:
            self._link.register()
        except KVServerError as exc:
            return str(exc)
        return None

    @property
    def lookup_seconds(self) -> Histogram:
        """Latency of the lookups behind ``get_num_new_matched_tokens`` (for /metrics)."""
        return self._loads.lookup_seconds

    @property
    def client(self) -> KVClient:
        """The kvserver client (its ``sent_by_op`` counts the daemon calls made)."""
        return self._link.kv

    def close(self) -> None:
        """:meth:`reset` (best effort on the daemon), then close the client."""
        self.reset()
        self._link.kv.close()

    def __enter__(self) -> KVServerSchedulerConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self, *, release: bool = True) -> None:
        """Forget every request and transfer (the workers lost their GPU contents): this
        client's reservations are rolled back and its pins released on the daemon (one
        blocking ``release``, skipped while it is marked down: the leases then expire); replies
        still due are dropped (completions already sent stand; held ones are sent first).
        ``release=False``: the ``release`` waits for :meth:`release_forgotten` (a worker that
        is only slow may still copy into the reservation's pages until it answers a hello)."""
        holds_leases = self.has_pending_transfers or self._release_due
        self._stores.cancel()  # the release also rolls this reservation back
        self._leases.clear()
        self._reqs.clear()
        self._preempted.clear()
        self._release_due = holds_leases
        if release:
            self.release_forgotten()

    def release_forgotten(self) -> None:
        """Release on the daemon what the transfers forgotten by ``reset(release=False)``
        held (one blocking ``release``; skipped while the daemon is marked down: the leases
        then expire). REQUIRES: no transfer planned since that reset (the workers answered
        their hello first, before any step)."""
        due, self._release_due = self._release_due, False
        if due and not self.is_daemon_down:
            try:
                self._link.release()
            except KVServerError as exc:
                logger.info("could not release leases on reset: %s", exc)

    @property
    def has_pending_transfers(self) -> bool:
        """True while a transfer is planned or in flight, or a store completion is held for
        the next step: keep stepping (empty steps too). Completions sent but not yet answered
        do not count (see :meth:`drain`)."""
        leases, stores = self._leases, self._stores
        return (
            leases.has_jobs
            or stores.batch is not None
            or stores.deferred is not None
            or bool(leases.held)
        )

    def num_pending(self, req_id: str) -> tuple[int, int]:
        """(loads, stores) of request ``req_id`` planned or in flight; (0, 0) if none."""
        state = self._reqs.get(req_id)
        return (0, 0) if state is None else (state.num_loads, state.num_stores)

    def offered_local_tokens(self, req_id: str) -> int:
        """The local hit (tokens) after which the standing offer of request ``req_id`` starts
        (its last ``get_num_new_matched_tokens``, until allocation); 0 when none stands."""
        state = self._reqs.get(req_id)
        offer = state.offer if state is not None else None
        return offer[0] if offer is not None else 0

    def drain(self) -> None:
        """Send the held store completions, then wait for the replies of every call sent
        without waiting (each at most ``op_timeout_s``) and apply them: the reserved stores
        become jobs (shipped by the next metadata, as always), completed chunks become events
        and counters. The step methods do this when they need the replies; call it to look at
        the daemon through another client right after a step (this client's own calls are
        ordered after them anyway)."""
        self._send_deferred()
        self._leases.flush_held()
        self._stores.collect()
        self._leases.collect_completions(wait=True)

    @property
    def is_daemon_down(self) -> bool:
        return self._link.is_down

    # ------------------------------------------------------------------ the six methods

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Held store completions are sent first: the lookup finds their chunks ready, as if
        nothing were held."""
        self._send_deferred()
        if self._leases.held:
            self._leases.flush_held()
        return self._loads.offer(self._state(request), num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Pins the hit chunks and pairs them with ``block_ids`` (the request's blocks from 0).

        Raises InvalidArgument (nothing changed) if ``num_external_tokens`` is neither 0 nor
        what the last ``get_num_new_matched_tokens`` offered, or the blocks do not cover it. A
        hit that can no longer be pinned is reported by the next ``update_connector_output`` as
        a finished load with a load error (the scheduler recomputes those tokens). Held store
        completions are sent first (the pin needs their chunks ready).
        """
        self._send_deferred()
        if self._leases.held:
            self._leases.flush_held()
        self._loads.pin(self._state(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Applies the reply of the previous step's store reservation (read by
        ``update_connector_output`` when it had arrived by then, else here, waiting at most
        ``op_timeout_s``), ships this step's loads and the stores reserved for the previous
        step, names the preempted requests that need a store barrier, and sends this step's
        store reservation (one ``prepare_store`` for every request, not waited for), which the
        next call ships. That prepare_store carries the store completions
        ``update_connector_output`` held; without one they stay held, and are sent alone at
        the end of the ``completion_hold_steps``-th call without one."""
        step: ScheduledStep = scheduler_output
        self._send_deferred()  # the previous step's, if dispatched() was not called
        self._stores.changed()
        self._stores.collect()
        self._leases.expire()
        meta = ConnectorMetadata(ns_id=self.ns_id)
        self._leases.ship(meta)
        if preempted := getattr(step, "preempted_req_ids", ()):
            self.handle_preemptions(preempted)
        if self._preempted:
            meta.flush_req_ids = sorted(
                r for r in self._preempted if (s := self._reqs.get(r)) is not None and s.num_stores
            )
            self._preempted.clear()
        self._stores.plan(step)
        if self._stores.deferred is None:  # else dispatched() sends it, carrying them
            self._leases.age_held()  # no prepare_store carried them: alone once old enough
        return meta

    def dispatched(self) -> None:
        """The plan went to the workers: send this step's ``prepare_store`` now. From the
        first call on, ``build_connector_meta`` plans the reservation and leaves its send
        (encode, send, the wake-up of the client's I/O thread) to this call, which the
        scheduler makes while it waits for the workers anyway: the step's critical path no
        longer carries it, and the reply still arrives while the workers run. Any other call
        of the connector sends a batch left unsent first (a step whose ``dispatched()`` did
        not come)."""
        self._stores.defer = True
        self._send_deferred()

    def update_connector_output(self, outputs: Sequence[Any]) -> TransferReport:
        """Takes each rank's :class:`ConnectorWorkerOutput`. A lease is completed on the daemon
        once every rank reported it: a load is unpinned; a store's chunks become ready, or are
        rolled back when some rank failed them. The completions are sent without waiting (a
        store's held for a later step's ``prepare_store`` to carry when the daemon takes
        them on one and an unfinished request makes a next step come: it is sent alone by the
        ``completion_hold_steps``-th ``build_connector_meta`` without one);
        the replies of those sent by the previous call are applied first (waiting at most
        ``op_timeout_s`` each: they had a whole step to arrive). Last, the reply of this
        step's store reservation is taken if it has arrived (never waited for here): its store
        jobs are queued for the next ``build_connector_meta``, which applies the rest."""
        self._send_deferred()
        leases = self._leases
        leases.collect_completions(wait=True)
        self._stores.changed()
        finished = leases.apply_outputs(outputs)
        if finished:
            leases.send_completions(finished, hold=self._hold_completions())
        self._stores.prepare()
        return leases.take_report()

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while loads or stores of the request are planned or in flight: its blocks are
        freed once it appears in a report's ``finished_sending``."""
        self._send_deferred()  # its chunks may be in the batch not sent yet
        state = self._reqs.get(request.request_id)
        if state is not None and state.finish_when_idle():
            return True, None
        self._reqs.pop(request.request_id, None)
        if self._leases.held and not self._hold_completions():
            self._leases.flush_held()  # the last request left: maybe no step follows
        return False, None

    def take_events(self) -> list[Event]:
        """BlockStored for chunks this connector made ready, BlockRemoved for hit chunks it
        found gone; ``seq`` counts this connector's events. First takes the reply of the
        step's store reservation if it has arrived since ``update_connector_output`` looked
        (never waiting: its store jobs are queued for the next ``build_connector_meta``, as
        there, which then has less to do), and applies the completion replies that already
        arrived. Both step loops call it once the step is over (``scheduler/process.py``;
        vLLM's ``update_from_output``). At most ``max_pending_events`` are kept between calls
        (the newest; ``stats.dropped_events`` counts the others)."""
        stores = self._stores
        if stores.batch is not None and stores.batch.grant is None:
            stores.prepare()
            stores.changed()  # its jobs are queued: is_storing looks again
        return self._leases.take_events()

    def handle_preemptions(self, req_ids: Iterable[str]) -> set[str]:
        """Notes preempted requests (``build_connector_meta`` also reads the step's
        ``preempted_req_ids``); returns those with stores in flight. The next metadata names
        them in ``flush_req_ids``: workers finish reading their blocks before that step's loads
        and forward pass, so the scheduler may hand the blocks to other requests right away."""
        self._send_deferred()
        barrier = set()
        for req_id in req_ids:
            if (state := self._reqs.get(req_id)) is not None:
                self._preempted.add(req_id)
                state.preempted()
                if state.num_stores:
                    barrier.add(req_id)
        return barrier

    # ------------------------------------------------------------------ internals

    def _hold_completions(self) -> bool:
        """Store completions may wait for a later step's prepare_store: the daemon takes
        them on one (``store_completions``) and a request is unfinished, so a next step
        (``build_connector_meta``, which sends them alone once ``completion_hold_steps``
        steps went by without a prepare_store) comes. Else they are sent at once: nothing
        may strand them until their leases expire."""
        return self._link.carries_completions and any(not s.finished for s in self._reqs.values())

    def _send_deferred(self) -> None:
        """Send the reservation ``build_connector_meta`` left for :meth:`dispatched`, with the
        completions it carries."""
        if self._stores.deferred is not None:
            self._stores.send_deferred()

    def _state(self, request: RequestLike) -> RequestState:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = RequestState(request, self._stores.calendar.moved)
            self._reqs[request.request_id] = state
        state.request = request
        return state
