"""``ClusterNode``: this daemon as a member of the fleet (membership + its part of the index).

Runs on the daemon's event loop; created and started by ``kvserver/daemon/process.py`` after
the front ends are up (it advertises their addresses), stopped before they close. One task
does every Redis write, in order; a second one follows the daemon's ``EventLog``.

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
from dataclasses import dataclass, replace
from typing import Any

from kvserver.cluster import record, schema
from kvserver.cluster.config import ClusterConfig, connect
from kvserver.cluster.full import OOM_HINT, FullRedis, check, first_refused, is_oom
from kvserver.cluster.pacing import Pacing
from kvserver.cluster.reader import FleetReader
from kvserver.cluster.schema import HostInfo
from kvserver.cluster.writer import KEEP_SCRIPT, Batch, IndexWriter, SetId
from kvserver.eventlog import EventGap, EventLog

logger = logging.getLogger(__name__)

#: pending index changes that are written at once, without waiting for the batch linger;
#: also the most index keys one pipeline carries (a larger batch, a resync, goes out as
#: several, one after another: a pipeline is encoded in one go on the event loop, ~0.3 s for
#: 1 M keys, which the daemon's other work would wait for).
MAX_BATCH_KEYS = 65_536
#: time allowed per index key of a pipeline, on top of the call timeout (seconds).
KEY_WRITE_S = 1e-5


#: what the daemon holds: chunk keys per (namespace id, tier).
Snapshot = Callable[[], Mapping[SetId, Sequence[bytes]]]
#: the daemon's namespace specs as JSON, by namespace id.
Specs = Callable[[], Mapping[str, str]]


async def _drive(steps: Generator[None, None, Batch]) -> Batch:
    """Run ``steps`` to its value, letting the event loop run between two steps."""
    while True:
        await asyncio.sleep(0)
        try:
            next(steps)
        except StopIteration as done:
            batch: Batch = done.value
            return batch


@dataclass(slots=True)
class NodeCounters:
    registrations: int = 0
    resyncs: int = 0
    heartbeats: int = 0
    batches: int = 0
    commands: int = 0
    indexed_keys: int = 0
    errors: int = 0
    dropped_keys: int = 0
    #: Redis found to have lost index writes or entries without a call failing (the fence
    #: moved or gone, a set evicted); each followed by a resync.
    index_losses: int = 0


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
        self.info = replace(identity, incarnation=uuid.uuid4().hex[:16], started_at=time.time())
        self.events = events
        self.snapshot = snapshot
        self.namespace_specs = namespace_specs
        self.reader = FleetReader(self.redis, config)
        self.writer = IndexWriter(self.info.host_id, self.info.incarnation, config.ttl_ms)
        self.counters = NodeCounters()
        self.condition = "connecting"
        self.condition_detail = ""
        self._registered = False
        #: the resync's delay and the retries' pauses (``rng``: a seeded one in tests)
        self.pacing = Pacing(config, rng)
        #: whether Redis refuses index adds for memory (``writer.deferred`` holds them)
        self.full = FullRedis(self.pacing)
        #: whether started_at is Redis's time (set at the first registration)
        self._clocked = False
        self._wake = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._ns_specs: dict[str, str] = {}
        self._last_write = 0.0
        #: the newest storage event reflected in Redis.
        self.written_seq = 0
        self._written_changed = asyncio.Event()

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
        """Start following events and writing; tries to register once before returning."""
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
                await asyncio.wait_for(self._leave(), self.config.timeout_s)
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
        refused = None if batch is None else await self._write_part(batch)
        if not self._registered:  # the fence found writes lost: a resync instead
            return
        if refused is not None:
            self._full_refused(refused)
        elif self.writer.deferred_keys:  # the next part at once
            self.condition_detail = self.full.detail(self.writer.deferred_keys)
        else:
            self.full.cleared()
            self.condition, self.condition_detail = "ok", ""

    # ------------------------------------------------------------------ Redis writes

    async def _bounded(self, pipe: Any, num_keys: int = 0) -> list[Any]:
        """Execute ``pipe`` within 4 timeouts plus 10 us per index key it carries (a resync of
        1 M chunks sends 8 MB: it must not time out, and then retry, forever)."""
        limit = self.config.timeout_s * 4 + num_keys * KEY_WRITE_S
        result: list[Any] = await asyncio.wait_for(pipe.execute(raise_on_error=False), limit)
        for reply in result:  # refused adds (Redis full) are the writer's: IndexWriter.count
            if isinstance(reply, Exception) and not is_oom(reply):
                raise reply
        return result

    async def _register_and_resync(self) -> None:
        r = self.redis
        urgent = self.pacing.urgent()  # this incarnation's first try: kvserver start waits
        if not self._clocked:  # started_at by Redis's clock (record.taken_by compares them)
            started = await record.redis_time(r, self.config.timeout_s)
            self.info = replace(self.info, started_at=started)
            self._clocked = True
        old_keys = await record.predecessor(r, self.info, self.config.timeout_s)
        if not urgent:  # Redis answers: the bulk after a random delay (pacing.py)
            await self.pacing.spread()
        # A new fence number first: a late tail of an earlier pipeline that runs after it
        # writes nothing (writer.py, fenced writes). Alone, before the bulk: a Redis that
        # refuses writes (out of memory under noeviction) refuses this one SET, not a
        # resync's megabytes sent again at every retry. As long as a pipeline: it waits
        # out a write pause.
        fence = self.writer.next_fence()
        await asyncio.wait_for(record.set_px(r, self.writer.fence_key, fence, self.config.ttl_ms),
                               self.config.timeout_s * 4)  # fmt: skip
        snap = self.snapshot()  # no await between this and the resync's start: events after
        self._ns_specs = dict(self.namespace_specs())  # it follow, and stay pending
        steps = self.writer.resync(snap, self.events.last_seq)
        next(steps)  # its first step: pending changes dropped
        self._registered = True  # events from here on go to the writer
        batch = await _drive(steps)  # the fingerprints, in steps: the loop runs between
        parts = batch.split(MAX_BATCH_KEYS)  # the record last: a new incarnation appears whole
        commands = 2 + len(old_keys)
        refused: BaseException | None = None  # an add Redis refused for memory
        for i, part in enumerate(parts):
            pipe = r.pipeline(transaction=False)
            for key in old_keys if i == 0 else ():
                pipe.execute_command("UNLINK", key)
            at = len(old_keys) if i == 0 else 0
            writes = self.writer.apply(pipe, part)
            commands += writes
            if i == len(parts) - 1:
                commands += self._queue_record(pipe, exists=False)
                commands += self.writer.queue_fence(pipe)
            replies = await self._bounded(pipe, part.num_keys)
            refused = refused or first_refused(replies)
            if not self._counted(part, replies[at : at + writes]):  # once more
                return
        check(replies[at + writes :])
        if not self._fenced(replies[-1]):  # Redis lost some of the resync: once more
            return
        self._written(batch.last_seq)
        self.counters.registrations += 1
        self.counters.resyncs += 1
        self.pacing.succeeded()
        self.counters.commands += commands
        self.counters.indexed_keys += batch.num_keys
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

    def _queue_record(self, pipe: Any, *, exists: bool) -> int:
        """Queue the record with the current namespaces (``record.queue``; ``exists``: renewed
        only while it names this incarnation, :meth:`_renewed` checks the reply)."""
        self.info = replace(self.info, namespaces=tuple(sorted(self.writer.namespaces)))
        return record.queue(pipe, self.info, self.config.ttl_ms, self._ns_specs, exists=exists)

    def _fenced(self, reply: Any) -> bool:
        """Whether the fence's value before this pipeline's move (``reply``) was the number
        of the pipeline before: else Redis lost or reordered writes; the index is resynced."""
        if self.writer.fence_read(reply):
            return True
        self.counters.index_losses += 1
        self._lost(f"Redis lost index writes (its write fence read {reply!r}, "
                   f"not {self.writer.fence - 1})")  # fmt: skip
        return False

    async def _write(self, batch: Batch) -> None:
        for part in batch.split(MAX_BATCH_KEYS):  # the fence in each: checked in each
            refused = await self._write_part(part)
            if not self._registered:  # the fence found writes lost: resync instead
                return
            if refused is not None:  # Redis full: its adds deferred, the rest go on
                self._full_refused(refused)
        self._written(batch.last_seq)

    async def _write_part(self, batch: Batch) -> BaseException | None:
        """Write ``batch`` in one pipeline; the error of an add Redis refused for memory
        (deferred by the writer), or None."""
        pipe = self.redis.pipeline(transaction=False)
        commands = at = self.writer.apply(pipe, batch)
        if batch.new_namespaces:
            self._ns_specs.update(self.namespace_specs())
            commands += self._queue_record(pipe, exists=True)
        commands += self.writer.queue_fence(pipe)
        replies = await self._bounded(pipe, batch.num_keys)
        self.counters.batches += 1
        self.counters.commands += commands
        self.counters.indexed_keys += batch.num_keys
        if not self._counted(batch, replies[:at]):
            return None
        check(replies[at:])
        if not batch.new_namespaces or self._renewed(replies[at]):
            self._fenced(replies[-1])
        return first_refused(replies[:at])

    def _counted(self, batch: Batch, replies: Sequence[Any]) -> bool:
        """Count ``batch``'s write replies (:meth:`IndexWriter.count`); False, and a resync
        ahead, when the fence refused some: Redis ran them out of order, after the fence
        moved (a Redis Cluster client retries a write that met a slot in migration, TRYAGAIN
        or ASK, after the rest of the pipeline, its fence move included)."""
        refused = self.writer.count(batch, replies)
        if not refused:
            return True
        self.counters.index_losses += 1
        self._lost(f"Redis ran {refused} index write(s) after their pipeline's fence move "
                   "(a slot migrating?): their changes are lost")  # fmt: skip
        return False

    def _renewed(self, reply: Any) -> bool:
        """Whether the record was renewed (``reply``: :data:`record.RENEW_SCRIPT`'s); else
        register again (the record was gone, or an earlier incarnation's was there), or
        step down (:class:`record.HostIdTaken`: a later daemon has the host id)."""
        if reply == 1:
            return True
        if reply is not None:
            other = record.taken_by(self.info, reply)
            if other is not None:
                raise record.taken(self.info, other)
        logger.warning("cluster: membership record was gone or replaced; re-registering")
        self._registered = False
        return False

    async def _heartbeat(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        at = self._queue_record(pipe, exists=True)
        sets = self.writer.index_keys()
        for key in sets:  # renewed, and counted: a set Redis evicted is found here. One key
            # a call: a slot migrating between Redis Cluster nodes answers a script of two
            # keys there TRYAGAIN (a failed heartbeat, a resync), one of one key ASK
            pipe.execute_command("EVAL", KEEP_SCRIPT, 1, key, self.config.ttl_ms)
        self.writer.queue_fence(pipe)
        replies = await self._bounded(pipe)
        check(replies)
        self.counters.heartbeats += 1
        self.counters.commands += len(replies)
        # the record gone (Redis lost it, or we stalled past the TTL) or another's
        if not self._renewed(replies[0]) or not self._fenced(replies[-1]):
            return
        lost = self.writer.lost_sets([n for (n,) in replies[at : at + len(sets)]])
        if lost:
            self.counters.index_losses += 1
            self._lost(
                f"Redis lost index entries without a write failing ({'; '.join(lost[:2])}): "
                "evicted? the fleet's Redis needs maxmemory-policy noeviction"
            )
            return
        await self.reader.hosts(refresh=True)  # self.members

    async def _leave(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key in [*self.writer.index_keys(), schema.fence_key(self.host_id, self.incarnation)]:
            pipe.execute_command("UNLINK", key)
        keys = (schema.host_key(self.host_id), schema.hosts_key())  # while it names us
        pipe.execute_command("EVAL", record.LEAVE_SCRIPT, 2, *keys, self.host_id,
                             record.field(self.incarnation))  # fmt: skip
        await pipe.execute()

