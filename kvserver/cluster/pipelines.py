"""``Pipelines``: a fleet member's writes to Redis, each one bounded, fenced, checked pipeline.

Runs on the daemon's event loop, owned by one ``ClusterNode`` (``node.py``), which decides
when each runs (register and resync, a batch, the deferred adds, a heartbeat, leaving) and
acts on what they find: a call that fails raises, as Redis's client does (→ ``unavailable``);
Redis found to have lost this incarnation's writes or entries without a call failing raises
:class:`IndexLost` (→ pending changes dropped, a resync); the record found gone or replaced
raises :class:`RecordGone` (→ register again), or :class:`record.HostIdTaken` (a later
daemon has this host id: step down). Neither signal leaves the node.

Call order per registration: :meth:`Pipelines.predecessor` (started_at by Redis's clock at
the first, then the previous incarnation's index sets) → :meth:`Pipelines.new_fence` →
:meth:`Pipelines.resync`; then any number of :meth:`Pipelines.write_part` and
:meth:`Pipelines.heartbeat`; :meth:`Pipelines.leave` at the end.

State (this class alone): the member's record as written (``info``: the incarnation, its
Redis-clock start, its namespaces) and the namespace specs it publishes. The index's
bookkeeping is the ``IndexWriter``'s (``writer.py``: the fence's number, the deferred adds),
the counters the node's (``NodeCounters``), both shared with the node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvserver.cluster import record, schema
from kvserver.cluster.config import ClusterConfig
from kvserver.cluster.full import check, first_refused, is_oom
from kvserver.cluster.schema import HostInfo
from kvserver.cluster.writer import KEEP_SCRIPT, Batch, IndexWriter

#: pending index changes that are written at once, without waiting for the batch linger;
#: also the most index keys one pipeline carries (a larger batch, a resync, goes out as
#: several, one after another: a pipeline is encoded in one go on the event loop, ~0.3 s for
#: 1 M keys, which the daemon's other work would wait for).
MAX_BATCH_KEYS = 65_536
#: time allowed per index key of a pipeline, on top of the call timeout (seconds).
KEY_WRITE_S = 1e-5

#: the daemon's namespace specs as JSON, by namespace id.
Specs = Callable[[], Mapping[str, str]]


class IndexLost(Exception):
    """Redis lost or reordered this incarnation's index writes, or evicted a set, without a
    call failing (the message says which): the node drops pending changes and resyncs."""


class RecordGone(Exception):
    """The membership record was gone or an earlier incarnation's: the node registers
    again."""


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


class Pipelines:
    """The member's Redis writes (module docstring)."""

    def __init__(
        self,
        redis: Any,
        config: ClusterConfig,
        info: HostInfo,
        writer: IndexWriter,
        counters: NodeCounters,
        namespace_specs: Specs,
    ) -> None:
        self.redis = redis
        self.config = config
        #: the record this member writes (started_at: Redis's clock once ``_clocked``)
        self.info = info
        self.writer = writer
        self.counters = counters
        self.namespace_specs = namespace_specs
        self._clocked = False
        self._specs: dict[str, str] = {}

    async def bounded(self, pipe: Any, num_keys: int = 0) -> list[Any]:
        """Execute ``pipe`` within 4 timeouts plus 10 us per index key it carries (a resync of
        1 M chunks sends 8 MB: it must not time out, and then retry, forever)."""
        limit = self.config.timeout_s * 4 + num_keys * KEY_WRITE_S
        result: list[Any] = await asyncio.wait_for(pipe.execute(raise_on_error=False), limit)
        for reply in result:  # refused adds (Redis full) are the writer's: IndexWriter.count
            if isinstance(reply, Exception) and not is_oom(reply):
                raise reply
        return result

    # ------------------------------------------------------------------ registration

    async def predecessor(self) -> list[str]:
        """The index sets of this host's previous incarnation, to unlink (``record.py``);
        first, once, started_at by Redis's clock (``record.taken_by`` compares them)."""
        r, timeout_s = self.redis, self.config.timeout_s
        if not self._clocked:
            self.info = replace(self.info, started_at=await record.redis_time(r, timeout_s))
            self._clocked = True
        return await record.predecessor(r, self.info, timeout_s)

    async def new_fence(self) -> None:
        """Set a new fence number, before a resync: a late tail of an earlier pipeline that
        runs after it writes nothing (``writer.py``, fenced writes). Alone, before the bulk:
        a Redis that refuses writes (out of memory under noeviction) refuses this one SET, not
        a resync's megabytes sent again at every retry. As long as a pipeline: it waits out a
        write pause."""
        fence = self.writer.next_fence()
        await asyncio.wait_for(
            record.set_px(self.redis, self.writer.fence_key, fence, self.config.ttl_ms),
            self.config.timeout_s * 4,
        )

    def read_specs(self) -> None:
        """Take the daemon's namespace specs as they are now (a resync publishes them)."""
        self._specs = dict(self.namespace_specs())

    async def resync(self, batch: Batch, old_keys: Sequence[str]) -> BaseException | None:
        """Write the resync ``batch`` (the writer's, every index set replaced) in pipelines of
        at most :data:`MAX_BATCH_KEYS` keys, ``old_keys`` unlinked in the first, the record
        in the last (a new incarnation appears whole); the error of an add Redis refused for
        memory (deferred by the writer), or None. :class:`IndexLost`: once more."""
        parts = batch.split(MAX_BATCH_KEYS)
        commands = 2 + len(old_keys)
        refused: BaseException | None = None  # an add Redis refused for memory
        for i, part in enumerate(parts):
            pipe = self.redis.pipeline(transaction=False)
            for key in old_keys if i == 0 else ():
                pipe.execute_command("UNLINK", key)
            at = len(old_keys) if i == 0 else 0
            writes = self.writer.apply(pipe, part)
            commands += writes
            if i == len(parts) - 1:
                commands += self._queue_record(pipe, exists=False)
                commands += self.writer.queue_fence(pipe)
            replies = await self.bounded(pipe, part.num_keys)
            refused = refused or first_refused(replies)
            self._counted(part, replies[at : at + writes])
        check(replies[at + writes :])
        self._fenced(replies[-1])  # Redis lost some of the resync: once more
        self.counters.commands += commands
        self.counters.indexed_keys += batch.num_keys
        return refused

    # ------------------------------------------------------------------ steady state

    async def write_part(self, batch: Batch) -> BaseException | None:
        """Write ``batch`` in one pipeline; the error of an add Redis refused for memory
        (deferred by the writer), or None."""
        pipe = self.redis.pipeline(transaction=False)
        commands = at = self.writer.apply(pipe, batch)
        if batch.new_namespaces:
            self._specs.update(self.namespace_specs())
            commands += self._queue_record(pipe, exists=True)
        commands += self.writer.queue_fence(pipe)
        replies = await self.bounded(pipe, batch.num_keys)
        self.counters.batches += 1
        self.counters.commands += commands
        self.counters.indexed_keys += batch.num_keys
        self._counted(batch, replies[:at])
        check(replies[at:])
        if batch.new_namespaces:
            self._renewed(replies[at])
        self._fenced(replies[-1])
        return first_refused(replies[:at])

    async def heartbeat(self) -> None:
        """Renew the record (while it names this incarnation) and the TTL of the index sets,
        counting their members: a set Redis evicted is found here."""
        pipe = self.redis.pipeline(transaction=False)
        at = self._queue_record(pipe, exists=True)
        sets = self.writer.index_keys()
        for key in sets:  # One key a call: a slot migrating between Redis Cluster nodes
            # answers a script of two keys there TRYAGAIN (a failed heartbeat, a resync), one
            # of one key ASK
            pipe.execute_command("EVAL", KEEP_SCRIPT, 1, key, self.config.ttl_ms)
        self.writer.queue_fence(pipe)
        replies = await self.bounded(pipe)
        check(replies)
        self.counters.heartbeats += 1
        self.counters.commands += len(replies)
        # the record gone (Redis lost it, or we stalled past the TTL) or another's
        self._renewed(replies[0])
        self._fenced(replies[-1])
        lost = self.writer.lost_sets([n for (n,) in replies[at : at + len(sets)]])
        if lost:
            raise IndexLost(
                f"Redis lost index entries without a write failing ({'; '.join(lost[:2])}): "
                "evicted? the fleet's Redis needs maxmemory-policy noeviction"
            )

    async def leave(self) -> None:
        """Remove the index sets, the fence, and the record while it names this incarnation."""
        host_id, incarnation = self.info.host_id, self.info.incarnation
        pipe = self.redis.pipeline(transaction=False)
        for key in [*self.writer.index_keys(), schema.fence_key(host_id, incarnation)]:
            pipe.execute_command("UNLINK", key)
        keys = (schema.host_key(host_id), schema.hosts_key())  # while it names us
        pipe.execute_command("EVAL", record.LEAVE_SCRIPT, 2, *keys, host_id,
                             record.field(incarnation))  # fmt: skip
        await pipe.execute()

    # ------------------------------------------------------------------ replies

    def _queue_record(self, pipe: Any, *, exists: bool) -> int:
        """Queue the record with the current namespaces (``record.queue``; ``exists``: renewed
        only while it names this incarnation, :meth:`_renewed` checks the reply)."""
        self.info = replace(self.info, namespaces=tuple(sorted(self.writer.namespaces)))
        return record.queue(pipe, self.info, self.config.ttl_ms, self._specs, exists=exists)

    def _fenced(self, reply: Any) -> None:
        """:class:`IndexLost` unless the fence's value before this pipeline's move (``reply``)
        was the number of the pipeline before (else Redis lost or reordered writes)."""
        if not self.writer.fence_read(reply):
            raise IndexLost(f"Redis lost index writes (its write fence read {reply!r}, "
                            f"not {self.writer.fence - 1})")  # fmt: skip

    def _counted(self, batch: Batch, replies: Sequence[Any]) -> None:
        """Count ``batch``'s write replies (:meth:`IndexWriter.count`); :class:`IndexLost`
        when the fence refused some: Redis ran them out of order, after the fence moved (a
        Redis Cluster client retries a write that met a slot in migration, TRYAGAIN or ASK,
        after the rest of the pipeline, its fence move included)."""
        refused = self.writer.count(batch, replies)
        if refused:
            raise IndexLost(f"Redis ran {refused} index write(s) after their pipeline's fence "
                            "move (a slot migrating?): their changes are lost")  # fmt: skip

    def _renewed(self, reply: Any) -> None:
        """Nothing if the record was renewed (``reply``: :data:`record.RENEW_SCRIPT`'s); else
        :class:`RecordGone` (the record was gone, or an earlier incarnation's was there), or
        :class:`record.HostIdTaken` (a later daemon has the host id: step down)."""
        if reply == 1:
            return
        if reply is not None:
            other = record.taken_by(self.info, reply)
            if other is not None:
                raise record.taken(self.info, other)
        raise RecordGone("membership record was gone or replaced")
