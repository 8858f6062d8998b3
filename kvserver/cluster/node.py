"""``ClusterNode``: this daemon as a member of the fleet (membership + its part of the index).

Runs on the daemon's event loop; created and started by ``kvserver/daemon/process.py`` after
the front ends are up (it advertises their addresses), stopped before they close. One task
does every Redis write, in order; a second one follows the daemon's ``EventLog``. This class
decides when each write runs and holds the member's condition; the writes themselves, each
one pipeline, and their checks are ``pipelines.py``'s (``Pipelines``).

Call order: ``ClusterNode(config, identity, events, snapshot, namespace_specs)`` →
``await start()`` (never fails for Redis: an unreachable Redis leaves the node
``unavailable`` and retried) → ``reader`` / ``stats()`` any time → ``await stop()``
(leaves the fleet: record and index sets removed, best effort, bounded by the timeout).

Lifecycle of the member (docs/cluster.md):

1. **Register**: a new ``incarnation`` id per start; the previous incarnation's record (same
   host id, if still alive) names its index sets, which are unlinked; the record is written
   with ``PX ttl`` and the host id added to the hosts set.
2. **Resync**: the daemon's own tiers (``snapshot()``: chunk keys per (namespace, tier)) replace
   every index set of this incarnation; namespace specs are published.
3. **Steady state**: storage events (BlockStored / BlockRemoved / AllBlocksCleared, medium CPU
   → dram, STORAGE → ssd) are coalesced by the ``IndexWriter`` and written as one pipeline
   at most every ``batch_linger_s`` (default 10 ms); a heartbeat every
   ``heartbeat_interval_s`` renews the record while it names this incarnation (``record.py``;
   a later daemon with this host id has taken it: step down) and the TTL of
   the index sets.
4. **Degraded**: any Redis error or timeout → condition ``unavailable`` (with the error),
   pending changes dropped, the client's pooled connections closed (the next call connects
   anew: a failover behind a DNS name or a moved address is followed); the daemon keeps
   serving its own tiers. Retried after a pause
   that backs off; on success → back to 1 (register, full resync) → ``ok``. A heartbeat
   that finds its record gone (Redis restarted or evicted it, or this daemon stalled past
   the TTL) does the same. Every registration but an incarnation's first waits a random
   delay before its fence and resync, so a fleet that found Redis back at one moment
   spreads its resyncs (``pacing.py``: the pauses, the delay). Meanwhile the index lacks
   this member (never a false holder) and ``stats()`` says ``resync_pending``.
5. **Fenced**: every pipeline of index writes, and every heartbeat, ends by moving the
   incarnation's fence (``schema.fence_key``) from the number of the previous one to its own
   (``writer.FENCE_SCRIPT``, only from that number). Another number back means Redis lost or
   reordered writes of this incarnation without a call failing (restarted from an older
   snapshot between two calls, the client retrying its connection at once): pending changes
   are dropped and the index resynced, as in 4, staying ``ok``. So are a write of the
   pipeline that the fence refused (Redis ran it after the fence move: a Redis Cluster client
   retrying a redirected write) and an index set whose member count, which the heartbeat
   reads, is not what this incarnation's writes left there (evicted by Redis). Every index
   write is done only while the fence reads its pipeline's number (``writer.py``, fenced
   writes), and a resync first sets a new number: a timed-out pipeline's tail that Redis
   runs during the resync changes nothing the resync does not replace.

6. **Redis full** (``maxmemory`` under ``noeviction``): Redis refuses the index's adds and
   nothing else (the membership's writes and the fence's are ``allow-oom`` scripts, removes
   free memory): the member stays in the fleet, ``degraded`` ("Redis is full" and the adds
   deferred in ``condition_detail``, ``redis_full`` in ``stats()``); the adds refused, and
   those of the batches after, are deferred (``writer.py``) and retried on their own after
   a pause that backs off as the retries of 4 do; once all are in: ``ok``. Before, the
   heartbeat's first command (the record's renewal, a ``SET``) was refused: the member went
   ``unavailable``, its record expired, its sets with it (freeing memory), it registered
   again and filled Redis again: members left and rejoined, over and over.

Conditions: ``connecting`` (not registered yet), ``ok``, ``degraded`` (a member, its newest
index entries deferred: Redis full), ``unavailable``, ``stopped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvserver.cluster import record
from kvserver.cluster.config import ClusterConfig, connect
from kvserver.cluster.full import OOM_HINT, FullRedis, is_oom
from kvserver.cluster.pacing import Pacing
from kvserver.cluster.pipelines import (
    MAX_BATCH_KEYS,
    IndexLost,
    NodeCounters,
    Pipelines,
    RecordGone,
    Specs,
)
from kvserver.cluster.reader import FleetReader
from kvserver.cluster.schema import HostInfo
from kvserver.cluster.writer import Batch, IndexWriter, SetId
from kvserver.eventlog import EventGap, EventLog

logger = logging.getLogger(__name__)

#: what the daemon holds: chunk keys per (namespace id, tier).
Snapshot = Callable[[], Mapping[SetId, Sequence[bytes]]]


async def _drive(steps: Generator[None, None, Batch]) -> Batch:
    """Run ``steps`` to its value, letting the event loop run between two steps."""
    while True:
        await asyncio.sleep(0)
        try:
            next(steps)
        except StopIteration as done:
            batch: Batch = done.value
            return batch


class ClusterNode:
    """This daemon's membership and index writing (module docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        identity: HostInfo,
        events: EventLog,
        snapshot: Snapshot,
        namespace_specs: Specs,
        *,
        redis: Any = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.redis = redis if redis is not None else connect(config)
        info = replace(identity, incarnation=uuid.uuid4().hex[:16], started_at=time.time())
        self.events = events
        self.snapshot = snapshot
        self.namespace_specs = namespace_specs
        self.reader = FleetReader(self.redis, config)
        self.writer = IndexWriter(info.host_id, info.incarnation, config.ttl_ms)
        self.counters = NodeCounters()
        #: every write to Redis, and the record as written (``info``)
        self.pipes = Pipelines(self.redis, config, info, self.writer, self.counters,
                               namespace_specs)  # fmt: skip
        self.condition = "connecting"
        self.condition_detail = ""
        self._registered = False
        #: the resync's delay and the retries' pauses (``rng``: a seeded one in tests)
        self.pacing = Pacing(config, rng)
        #: whether Redis refuses index adds for memory (``writer.deferred`` holds them)
        self.full = FullRedis(self.pacing)
        self._wake = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._last_write = 0.0
        #: the newest storage event reflected in Redis.
        self.written_seq = 0
        self._written_changed = asyncio.Event()

    @property
    def info(self) -> HostInfo:
        """This member's record as last written (read only)."""
        return self.pipes.info

    @property
    def host_id(self) -> str:
        return self.info.host_id

    @property
    def incarnation(self) -> str:
        return self.info.incarnation

    @property
    def readable(self) -> bool:
        """Whether the fleet state is read and this daemon a member (``ok``, or ``degraded``:
        Redis full, its newest index entries deferred)."""
        return self.condition in ("ok", "degraded")

    @property
    def members(self) -> list[HostInfo]:
        """The live members (this daemon included), by host id order, as the reader last read
        them: at every heartbeat, and at every lookup through :attr:`reader` older than
        ``members_max_age_s`` (so the network tier fetches from the incarnations the index
        it just read names, not from those of the last heartbeat). No I/O; read only."""
        return self.reader.known_hosts

    async def start(self) -> None:
        """Start following events and writing; returns once the first registration attempt
        has ended (``condition`` no longer ``connecting``: ``ok``, ``degraded`` or
        ``unavailable``), or after 3 cluster timeouts, whichever comes first: a slow Redis
        holds up the daemon's start no longer than that. So the member may not be registered
        yet when this returns; one that must be waits for :attr:`readable`."""
        self._tasks = [
            asyncio.create_task(self._follow(), name="cluster-events"),
            asyncio.create_task(self._run(), name="cluster-writer"),
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_attempt(), self.config.timeout_s * 3)

    async def _first_attempt(self) -> None:
        while self.condition == "connecting":
            await asyncio.sleep(0.01)  # bounded by start()'s wait_for

    async def stop(self) -> None:
        """Leave the fleet (best effort, bounded) and close the client."""
        self._stopping = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._registered:
            try:
                await asyncio.wait_for(self.pipes.leave(), self.config.timeout_s)
            except Exception as exc:
                logger.warning("cluster: could not leave cleanly (%s); entries expire by TTL", exc)
        self.condition = "stopped"
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "condition": self.condition,
            "condition_detail": self.condition_detail,
            "url": self.config.target().describe(),
            "host_id": self.host_id,
            "incarnation": self.incarnation,
            "namespaces": len(self.writer.namespaces),
            "live_hosts": len(self.members),
            "pending_keys": self.writer.pending_keys,
            # a resync owed (the index not kept: waiting for its delay, or a retry), and how
            # long until it starts when it waits for its delay
            "resync_pending": int(not self._registered and self.condition != "stopped"),
            "resync_in_s": self.pacing.resync_in_s(),
            # Redis refuses index adds for memory: this member's adds wait, deferred
            "redis_full": int(self.full.active),
            "deferred_keys": self.writer.deferred_keys,
            "registrations": c.registrations,
            "resyncs": c.resyncs,
            "heartbeats": c.heartbeats,
            "batches": c.batches,
            "commands": c.commands,
            "indexed_keys": c.indexed_keys,
            "errors": c.errors,
            "dropped_keys": c.dropped_keys,
            "index_losses": c.index_losses,
            # what Redis holds that no daemon of this version writes (reader.py): entries
            # skipped at the last read of the members, index sets of another type met
            "bad_records": self.reader.bad_records,
            "unreadable_sets": self.reader.unreadable_sets,
        }

    async def wait_written(self, seq: int | None = None, timeout_s: float = 10.0) -> bool:
        """Until the index reflects event ``seq`` (default: the newest so far); False if that
        did not happen within ``timeout_s``. For tests, benchmarks and orderly hand-offs."""
        target = self.events.last_seq if seq is None else seq
        deadline = time.monotonic() + timeout_s
        while self.written_seq < target:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            waiter = self._written_changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), left)
        return True

    def _written(self, seq: int) -> None:
        self.written_seq = max(self.written_seq, seq)
        self._written_changed.set()
        self._written_changed = asyncio.Event()

    # ------------------------------------------------------------------ tasks

    async def _follow(self) -> None:
        """Feed the event log into the writer (drops them while Redis is unreachable)."""
        next_seq = self.events.last_seq + 1
        while not self._stopping:
            try:
                async for ev in self.events.follow(next_seq):
                    next_seq = ev.seq + 1
                    if self._registered:
                        self.writer.add((ev,))
                        if self.writer.pending_keys > self.config.max_pending_keys:
                            self._lost("too many pending index changes")
                    self._wake.set()
                return
            except EventGap:
                next_seq = self.events.last_seq + 1
                self._lost("missed storage events")

    def _lost(self, why: str) -> None:
        """Pending changes cannot be written: drop them and resync from the tiers."""
        self.counters.dropped_keys += self.writer.pending_keys
        self.writer.drop()
        if self._registered:
            logger.warning("cluster: %s; resyncing the index from this daemon's tiers", why)
        self._registered = False

    async def _run(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_beat = 0.0
        while not self._stopping:
            try:
                if not self._registered:
                    await self._register_and_resync()
                    next_beat = time.monotonic() + interval
                if time.monotonic() >= next_beat:
                    await self._heartbeat()
                    next_beat = time.monotonic() + interval
                    continue
                if self.full.due():
                    await self._retry_deferred()
                    continue
                if self.writer.pending_keys:
                    linger = self._last_write + self.config.batch_linger_s - time.monotonic()
                    if linger > 0 and self.writer.pending_keys < MAX_BATCH_KEYS:
                        await asyncio.sleep(min(linger, next_beat - time.monotonic()))
                batch = self.writer.take_batch(defer_adds=self.full.active)
                if batch is not None:
                    await self._write(batch)
                    self._last_write = time.monotonic()
                    continue
                self._wake.clear()
                until = self.full.wake_at(next_beat)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), until - time.monotonic())
            except asyncio.CancelledError:
                raise
            except IndexLost as exc:  # Redis lost writes without a call failing: resync
                self.counters.index_losses += 1
                self._lost(str(exc))
            except RecordGone:  # register again
                logger.warning("cluster: membership record was gone or replaced; re-registering")
                self._registered = False
            except Exception as exc:
                self._failed(exc)
                await self._reconnect()
                # retry after a pause that events do not cut short (a refused connection
                # fails at once: retrying per event would spin while Redis is down)
                await asyncio.sleep(self.pacing.retry_pause())
                self._wake.clear()

    def _failed(self, exc: BaseException) -> None:
        self.counters.errors += 1
        detail = f"{type(exc).__name__}: {str(exc) or 'Redis did not answer in time'}"
        full = is_oom(exc)
        if full:
            detail += f" ({OOM_HINT})"
        if isinstance(exc, record.HostIdTaken):
            if self.condition_detail != detail:
                logger.error("cluster: %s", exc)
        elif self.condition != "unavailable":
            logger.warning(
                "cluster: Redis %s (%s); serving local tiers only, retrying",
                "refuses writes, out of memory" if full else "unreachable or failing",
                detail,
            )
        self.condition, self.condition_detail = "unavailable", detail
        self.pacing.failed()
        self.counters.dropped_keys += self.writer.pending_keys + self.writer.deferred_keys
        self.writer.drop()
        self._registered = False
        self.full.reset()

    async def _reconnect(self) -> None:
        """After a failure, close the client's pooled connections (one Redis; a Redis Cluster
        client follows its topology itself), so that the next call connects anew, resolving
        the URL's host name again. Before, a pooled connection outlived a failover: the old
        master, demoted to a replica at its old address (Sentinel, a managed Redis's
        failover behind a DNS name or a virtual IP), answered every write ``READONLY`` for
        as long as the connection stayed open, the member ``unavailable`` all along."""
        pool = getattr(self.redis, "connection_pool", None)
        if pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.disconnect(), self.config.timeout_s)

    def _full_refused(self, refused: BaseException) -> None:
        """Redis refused index adds for memory (``refused``): ``degraded``, the deferred adds
        (``writer.deferred``) retried after a pause that backs off as 4's retries do."""
        self.condition = "degraded"
        self.condition_detail = self.full.refused(refused, self.writer.deferred_keys)

    async def _retry_deferred(self) -> None:
        """Try the deferred adds again (Redis full), a batch of at most MAX_BATCH_KEYS; the
        rest follow at once when Redis took them all, else after the next pause; none left:
        ``ok`` again."""
        batch = self.writer.take_deferred(MAX_BATCH_KEYS)
        refused = None if batch is None else await self.pipes.write_part(batch)
        if refused is not None:
            self._full_refused(refused)
        elif self.writer.deferred_keys:  # the next part at once
            self.condition_detail = self.full.detail(self.writer.deferred_keys)
        else:
            self.full.cleared()
            self.condition, self.condition_detail = "ok", ""

    # ------------------------------------------------------------------ Redis writes

    async def _register_and_resync(self) -> None:
        urgent = self.pacing.urgent()  # this incarnation's first try: kvserver start waits
        old_keys = await self.pipes.predecessor()
        if not urgent:  # Redis answers: the bulk after a random delay (pacing.py)
            await self.pacing.spread()
        await self.pipes.new_fence()
        snap = self.snapshot()  # no await between this and the resync's start: events after
        self.pipes.read_specs()  # it follow, and stay pending
        steps = self.writer.resync(snap, self.events.last_seq)
        next(steps)  # its first step: pending changes dropped
        self._registered = True  # events from here on go to the writer
        batch = await _drive(steps)  # the fingerprints, in steps: the loop runs between
        refused = await self.pipes.resync(batch, old_keys)  # IndexLost: once more
        self._written(batch.last_seq)
        self.counters.registrations += 1
        self.counters.resyncs += 1
        self.pacing.succeeded()
        if self.condition != "ok":
            logger.info(
                "cluster: registered %s (incarnation %s) at %s; %d chunk(s) indexed%s",
                self.host_id,
                self.incarnation,
                self.config.target().describe(),
                batch.num_keys,
                f", {len(old_keys)} stale set(s) of a previous incarnation removed"
                if old_keys
                else "",
            )
        self.condition, self.condition_detail = "ok", ""
        self.full.reset()
        if refused is not None or self.writer.deferred_keys:  # Redis is full
            self._full_refused(refused or MemoryError("index adds refused"))
        await self.reader.hosts(refresh=True)  # self.members

    async def _write(self, batch: Batch) -> None:
        for part in batch.split(MAX_BATCH_KEYS):  # the fence in each: checked in each
            refused = await self.pipes.write_part(part)
            if refused is not None:  # Redis full: its adds deferred, the rest go on
                self._full_refused(refused)
        self._written(batch.last_seq)

    async def _heartbeat(self) -> None:
        await self.pipes.heartbeat()
        await self.reader.hosts(refresh=True)  # self.members
