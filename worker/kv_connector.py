"""KVServerWorkerConnector: the worker half of the kvserver KV connector.

Runs in each worker process (one per GPU / TP rank), on the worker's thread; not thread-safe.
It executes the :class:`~step_protocol.ConnectorMetadata` that the scheduler
connector (scheduler/kv_connector.py) ships every step, with a transfer engine
(worker/transfer.py: CUDA streams, or threads on CPU; each lease's transfer planned by
worker/transfer_plan.py), and reports per lease what its rank
finished. It never completes leases: the scheduler does, once every rank reported.

Call order, every step (empty metadata included: deferred stores and reports need it)::

    register_kv_caches(kv_caches, num_blocks)    once, before the first step
    bind_connector_metadata(meta)
    start_load_kv()          flush barrier (handle_preemptions), deferred stores, loads
    ... forward pass ...
    wait_for_save()          queue this metadata's stores: submitted by the next start_load_kv
    get_finished()           non-blocking poll → (finished sending, finished receiving) req ids
    build_connector_worker_meta()  → ConnectorWorkerOutput for this rank (what finished)
    clear_connector_metadata()

Stores are deferred to the start of the next step (the copy starts after the
step's sampling, not against it); a store of a request named in ``flush_req_ids`` is never
deferred. Barrier (contract point 1): before this step's loads are submitted (and so before
the forward pass), every store of a flushed request, in this metadata, deferred or in flight,
has finished reading its GPU blocks.

Data paths: **co-located** (the daemon's arena file can be mapped here): copies go straight
between the KV blocks and ``extents[rank]`` of the mapped arena; **remote**: stores copy into a
staging buffer and send it with ``write_parts(lease, keys, rank, complete=False)``, loads fetch
with ``read_parts`` and copy out; that I/O runs on the engine's threads with one client per
direction. Part layout: step_protocol/connector.py (block ``j`` of a part at ``j *
block_bytes``; a load's ``block_ids[j]`` receives sub-block ``skip_blocks + j``); block bytes:
worker/layout.py.

Which daemon: every lease in the metadata names the daemon incarnation that granted it
(``RequestTransfers.granted_by``, its session id). A co-located worker copies only for leases
granted by the incarnation whose arena it has mapped (the ``sid`` of the ``hello`` it mapped
it after); any other lease fails (its extents are offsets in another arena), so a restarted
daemon's arena is never read or written at its predecessor's offsets, whatever the timing.

Leases that run out (worker/lease_deadlines.py): a co-located store or load whose lease has
expired (``RequestTransfers.expires_in_s`` after the metadata arrived) before its copy is
submitted fails without copying: the daemon has rolled that reservation back or dropped the
load's pins, and after a quarantine hands their pages to other keys. A co-located load whose
copies were seen landed only at or after its deadline fails too, whatever it copied (the
blocks may hold another prompt's KV). A failed load's chunks are reported as every failed
load's (``failed_keys``, their blocks in :meth:`take_load_error_block_ids`: vLLM's
``get_block_ids_with_load_errors``), and the scheduler recomputes the tokens. The check runs
here, on what either engine reports, so the CUDA engine's path is the CPU engine's.

Failures never raise into the caller's step: a daemon that cannot be reached fails the chunks
of the transfers it is given (reported per lease; vLLM recomputes them), and so does a
co-located daemon that removed its arena file (stopped with SIGTERM, or restarted after a
crash): the worker unmaps it, connects again at once and maps the new arena, and the leases
the old daemon granted fail by the rule above. A lease granted by an incarnation other than
the mapped one while the mapped arena file is still in place (a restart that did not reap
it) makes the worker ask the daemon which incarnation it is, and map again if it changed.
The session with the daemon (clients, mapped arena, its incarnation) is
:class:`~worker.daemon_session.DaemonSession`'s; this class decides when to connect, map
again or fail a lease.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from kvserver.errors import InvalidArgument, InvalidState, KVServerError
from step_protocol import (
    ConnectorMetadata,
    ConnectorWorkerOutput,
    RequestTransfers,
    TransferResult,
)
from worker.config import WorkerConnectorConfig
from worker.daemon_session import DaemonSession
from worker.host import MappedArena
from worker.layout import CanonicalKVCaches, canonicalize
from worker.lease_deadlines import JobId, LeaseDeadlines
from worker.transfer import Transfer, TransferEngine
from worker.transfer_factory import make_engine
from worker.transfer_plan import TransferPlanner, unreachable

logger = logging.getLogger(__name__)


class KVServerWorkerConnector:
    """The worker-side connector of one TP rank; see the module docstring."""

    def __init__(self, config: WorkerConnectorConfig) -> None:
        self.config = config
        self.spec = config.spec
        self.rank = config.rank
        self.caches: CanonicalKVCaches | None = None
        self.engine: TransferEngine | None = None
        self._planner: TransferPlanner | None = None
        #: the clients, the data path and the daemon incarnation they are with
        self.session = DaemonSession(config)
        self._meta: ConnectorMetadata | None = None
        self._saved = True  # wait_for_save ran for the bound metadata
        self._submitted_now: set[JobId] = set()
        #: stores of the next metadata submitted early by :meth:`flush`.
        self._flushed: set[JobId] = set()
        self._deferred: list[RequestTransfers] = []
        #: loads in flight: chunk key -> GPU blocks it fills (for load_error_block_ids).
        self._load_blocks: dict[JobId, dict[bytes, list[int]]] = {}
        self._load_errors: set[int] = set()
        self._inflight: dict[JobId, Transfer] = {}
        self._stores_left: dict[str, int] = {}
        #: the deadlines of the leases copied under (expired_stores, expired_loads)
        self.deadlines = LeaseDeadlines()
        self._output = ConnectorWorkerOutput(self.rank)

    # ------------------------------------------------------------------ lifetime

    @property
    def arena(self) -> MappedArena | None:
        """The daemon's arena, mapped (co-located), or None (remote, or not connected)."""
        return self.session.arena

    @property
    def is_colocated(self) -> bool:
        return self.arena is not None

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        num_blocks: int,
        *,
        block_dim: int | None = None,
    ) -> CanonicalKVCaches:
        """Canonicalize the paged KV tensors (worker/layout.py), check them against the
        namespace, start the transfer engine and choose the data path. Once.

        Raises InvalidArgument if a block's bytes on this rank differ from the namespace's
        ``block_bytes``; InvalidState if called twice or ``colocated=True`` cannot map. A
        daemon that cannot be reached is not an error (unless ``colocated=True``): the worker
        connects before the first transfer it is given, and fails that transfer's chunks
        if it still cannot."""
        if self.caches is not None:
            raise InvalidState("register_kv_caches was called already")
        caches = canonicalize(kv_caches, num_blocks, block_dim=block_dim)
        want = self.spec.part_bytes // self.spec.chunk_blocks
        if caches.block_bytes != want or self.spec.part_bytes % self.spec.chunk_blocks:
            raise InvalidArgument("KV caches do not match the namespace",
                                  block_bytes=caches.block_bytes, want=want)  # fmt: skip
        self.caches = caches
        self.engine = make_engine(caches.device, host_kernels=self.config.host_kernels)
        self._planner = TransferPlanner(self.spec, self.rank, caches)
        try:
            self._connect()
        except KVServerError as exc:
            if self.config.colocated:
                raise
            logger.warning("kvserver at %s unreachable (%s); will connect on first transfer",
                           self.config.address, exc)  # fmt: skip
        return caches

    def _connect(self) -> None:
        """Connect the session (DaemonSession.connect). Raises KVServerError if the daemon
        cannot be reached."""
        assert self.caches is not None
        self.session.connect(self.spec, self.caches.device)

    def close(self) -> None:
        """Finish in-flight copies, stop the engine, unmap the arena, close clients."""
        if self.engine is not None:
            self.engine.close()
        self.session.close()

    def __enter__(self) -> KVServerWorkerConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ per step

    def bind_connector_metadata(self, meta: ConnectorMetadata | Mapping[str, Any]) -> None:
        """This step's metadata (a ConnectorMetadata or its wire form). InvalidArgument for a
        foreign namespace; stores of a previous metadata not yet saved are queued first."""
        if not isinstance(meta, ConnectorMetadata):
            meta = ConnectorMetadata.from_wire(meta)
        if meta.ns_id and meta.ns_id != self.spec.ns_id:
            raise InvalidArgument("metadata of another namespace", ns_id=meta.ns_id)
        self.deadlines.note(meta)
        if not self._saved:
            self.wait_for_save()
        self._meta, self._saved = meta, False
        self._submitted_now, self._flushed = self._flushed, set()

    def clear_connector_metadata(self) -> None:
        if not self._saved:
            self.wait_for_save()
        self._meta = None

    def start_load_kv(self) -> None:
        """Submit, in this order: stores of flushed requests in this metadata, stores deferred
        from the previous step, the flush barrier, then this metadata's loads (and, with
        ``defer_stores=False``, its other stores). The engine gets them together
        (``TransferEngine.batched``): a step's many one-chunk stores run as one group."""
        with self.engine.batched() if self.engine is not None else nullcontext():
            self._start_load_kv()

    def _start_load_kv(self) -> None:
        meta = self._meta or ConnectorMetadata()
        flush = set(meta.flush_req_ids)
        for t in meta.stores:
            job: JobId = (False, t.req_id, t.lease_id)
            if (t.req_id in flush or not self.config.defer_stores) and (
                job not in self._submitted_now
            ):
                self._submit(t, is_load=False)
                self._submitted_now.add(job)
        deferred, self._deferred = self._deferred, []
        for t in deferred:
            self._submit(t, is_load=False, counted=True)
        self.handle_preemptions(flush)
        for t in meta.loads:
            self._submit(t, is_load=True)
        if (
            meta.loads
            and self.engine is not None
            and self.arena is not None
            and (not self.caches_on_cuda)
        ):
            # CPU caches and the daemon's arena mapped: a load is a memcpy by the cores the
            # forward pass uses anyway. Finished here, it is reported by this step's
            # get_finished and the request runs in the next step, instead of idling in
            # WAITING_FOR_REMOTE_KVS for as many steps as the copy thread needs.
            self.engine.wait([self._inflight[(True, t.req_id, t.lease_id)] for t in meta.loads])

    def wait_for_save(self) -> None:
        """Queue this metadata's stores for the next ``start_load_kv`` (never blocks)."""
        self._saved = True
        if self._meta is None:
            return
        for t in self._meta.stores:
            if (False, t.req_id, t.lease_id) not in self._submitted_now:
                self._deferred.append(t)
                self._stores_left[t.req_id] = self._stores_left.get(t.req_id, 0) + 1

    def flush(self, meta: ConnectorMetadata | Mapping[str, Any]) -> None:
        """The barrier of ``meta`` ahead of binding it (vLLM calls ``handle_preemptions``
        with the next step's metadata before the forward pass and before binding): submit
        its stores of ``flush_req_ids`` and wait until every store of those requests has
        finished reading its GPU blocks. ``start_load_kv`` of ``meta`` does not submit them
        again."""
        if not isinstance(meta, ConnectorMetadata):
            meta = ConnectorMetadata.from_wire(meta)
        flush = set(meta.flush_req_ids)
        if not flush:
            return
        self.deadlines.note(meta)
        for t in meta.stores:
            job: JobId = (False, t.req_id, t.lease_id)
            if t.req_id in flush and job not in self._flushed:
                self._submit(t, is_load=False)
                self._flushed.add(job)
        self.handle_preemptions(flush)

    def stores_pending(self, req_id: str) -> bool:
        """True while a store of ``req_id`` is deferred or in flight on this rank, or is in
        the bound metadata and not queued yet (asked before ``wait_for_save``: vLLM's model
        runners with a speculator collect the results first)."""
        if req_id in self._stores_left:
            return True
        meta = self._meta
        return meta is not None and not self._saved and any(t.req_id == req_id for t in meta.stores)

    def take_load_error_block_ids(self) -> set[int]:
        """GPU blocks that loads finished since the last call failed to fill (vLLM's
        ``get_block_ids_with_load_errors``); their requests are in ``get_finished``."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def handle_preemptions(self, req_ids: Sequence[str] | set[str]) -> None:
        """Barrier: every store of ``req_ids`` (deferred or in flight) has finished reading
        its GPU blocks when this returns, so the blocks may be overwritten."""
        wanted = set(req_ids)
        if not wanted:
            return
        keep: list[RequestTransfers] = []
        for t in self._deferred:
            if t.req_id in wanted:
                self._submit(t, is_load=False, counted=True)
            else:
                keep.append(t)
        self._deferred = keep
        if self.engine is not None:
            self.engine.wait(
                tr for (is_load, req_id, _), tr in self._inflight.items()
                if not is_load and req_id in wanted
            )  # fmt: skip

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Non-blocking poll. Returns (requests whose stores are all over, requests whose load
        is over) among what finished since the last call; results go to the next report."""
        sending: set[str] = set()
        recving: set[str] = set()
        if self.engine is None:
            return sending, recving
        for tr in self.engine.poll():
            if self._inflight.pop(tr.tag, None) is None:
                continue  # not one of ours (submitted to the engine by someone else)
            is_load, req_id, lease_id = tr.tag
            failed = list(tr.failed_keys)
            if is_load and self.deadlines.landed_late(tr):
                logger.warning("load lease %d of %s expired before its copies landed; it "
                               "fails", lease_id, req_id)  # fmt: skip
                failed = list(tr.keys)
            result = TransferResult(req_id, lease_id, failed)
            blocks = self._load_blocks.pop(tr.tag, None)
            if blocks is not None:
                for key in failed:
                    self._load_errors.update(blocks.get(key, ()))
            if is_load:
                self._output.loads.append(result)
                recving.add(req_id)
            else:
                self._output.stores.append(result)
                self._stores_left[req_id] -= 1
                if not self._stores_left[req_id]:
                    del self._stores_left[req_id]
                    sending.add(req_id)
        return sending, recving

    def build_connector_worker_meta(self) -> ConnectorWorkerOutput:
        """Everything this rank finished since the previous report (polls first)."""
        self.get_finished()
        out, self._output = self._output, ConnectorWorkerOutput(self.rank)
        return out

    def drain(self) -> None:
        """Blocking: submit the deferred stores and wait for every transfer in flight (worker
        shutdown, tests). Their results go to the next report."""
        deferred, self._deferred = self._deferred, []
        with self.engine.batched() if self.engine is not None else nullcontext():
            for t in deferred:
                self._submit(t, is_load=False, counted=True)
        self.wait_inflight()

    def forget(self) -> None:
        """The scheduler forgot every transfer (its hello after a failed step, which follows
        its ``reset``: the leases were released on the daemon, their pages may hold other
        chunks already). Blocking: the deferred stores are dropped, never copied; the
        transfers in flight (their copies cannot be recalled) are waited for; nothing of
        either is reported."""
        self._deferred = []
        self.wait_inflight()
        self.get_finished()
        self._output = ConnectorWorkerOutput(self.rank)
        self._stores_left.clear()
        self._load_blocks.clear()
        self._load_errors.clear()
        self.deadlines.clear()
        self._flushed, self._submitted_now = set(), set()
        self._meta, self._saved = None, True

    def wait_inflight(self) -> None:
        """Blocking: wait for the transfers already submitted (not the deferred stores)."""
        if self.engine is not None:
            self.engine.wait(list(self._inflight.values()))

    @property
    def num_pending(self) -> int:
        """Transfers deferred or in flight."""
        return len(self._deferred) + len(self._inflight)

    # ------------------------------------------------------------------ submitting

    def _submit(self, t: RequestTransfers, *, is_load: bool, counted: bool = False) -> None:
        """Plan and submit one lease's transfer (``counted``: a deferred store, already in
        ``_stores_left``)."""
        if self.engine is None or self._planner is None:
            raise InvalidState("register_kv_caches first")
        job: JobId = (is_load, t.req_id, t.lease_id)
        deadline = self.deadlines.take(job)
        if job in self._inflight:
            logger.warning("lease %d of %s shipped twice; ignored", t.lease_id, t.req_id)
            if counted:
                self._stores_left[t.req_id] -= 1
            return
        if not is_load and not counted:
            self._stores_left[t.req_id] = self._stores_left.get(t.req_id, 0) + 1
        if self.arena is not None and (
            self.arena.is_stale
            or (t.granted_by != self.session.arena_sid and self.session.restarted())
        ):
            self._arena_gone()
        if not self.session.connected:
            try:
                self._connect()
            except (KVServerError, OSError) as exc:
                logger.warning("kvserver unreachable; lease %d of %s fails: %s",
                               t.lease_id, t.req_id, exc)  # fmt: skip
        if not self.session.connected:
            transfer = unreachable(t, is_load)
        elif self.arena is not None and self.deadlines.expired(job, deadline):
            kind = "load" if is_load else "store"
            logger.warning("%s lease %d of %s expired before its copy started; it fails",
                           kind, t.lease_id, t.req_id)  # fmt: skip
            transfer = unreachable(t, is_load, f"its {kind} lease expired before the copy")
        elif self.arena is not None and t.granted_by != self.session.arena_sid:
            logger.info("lease %d of %s was granted by another daemon instance (%r, mapped: "
                        "%r); it fails", t.lease_id, t.req_id, t.granted_by,
                        self.session.arena_sid)  # fmt: skip
            transfer = unreachable(t, is_load, "granted by another daemon instance")
        else:
            transfer = self._planner.plan(t, is_load, self.arena, self.session.io)
            if is_load and self.arena is not None:
                self.deadlines.watch(job, deadline)  # checked when its copies have landed
        if is_load:
            self._load_blocks[job] = {c.key: c.block_ids for c in t.loads}
        self._inflight[job] = transfer
        self.engine.submit(transfer)

    @property
    def caches_on_cuda(self) -> bool:
        return self.caches is not None and self.caches.device.type == "cuda"

    # ------------------------------------------------------------------ session

    def _arena_gone(self) -> None:
        """The mapped arena is not the daemon's any more (its file was removed: the daemon
        stopped, or restarted after a crash): wait for the copies into the old mapping, unmap
        it and close the clients (their sessions went with that daemon). The caller connects
        again, mapping the daemon's new arena; leases the old daemon granted then fail by
        their ``granted_by`` (vLLM recomputes them)."""
        logger.warning("the daemon's arena is gone (it stopped or restarted); leases it "
                       "granted fail, the next transfer maps its new arena")  # fmt: skip
        if self.engine is not None:
            self.engine.wait(list(self._inflight.values()))
        # the daemon's sessions went with it: start over with new clients
        self.session.drop_arena()
