"""``IndexWriter``: a daemon's own storage events → batches of Redis commands on its index sets.

Runs on the daemon's event loop, owned by ``ClusterNode`` (single owner, no locks). Pure
bookkeeping: it never awaits; ``apply`` only queues commands on a pipeline the node executes.

Call order: ``add(events)`` any number of times (coalesces) → ``take_batch()`` → ``apply(pipe,
batch)`` → the node executes the pipeline. ``drop()`` forgets pending changes (Redis is
unreachable; the node will resync); ``full_batch(snapshot)`` builds a resync that replaces
every index set of this incarnation with the daemon's true contents (``resync(snapshot)``:
the same in steps, a generator the node drives with the loop running between steps).

Invariant: after a batch is applied, each index set equals the keys the daemon's tier held
when the last event of the batch was emitted (events of one key coalesce, last wins; an
``AllBlocksCleared`` empties the set first). A set never exists without a TTL: its members
are added by one script (:data:`WRITE_SCRIPT`) that runs ``SADD`` and ``PEXPIRE .. NX``
atomically, so a daemon killed (or a connection cut) between the two cannot leave a set
that outlives its host; the node's heartbeat renews the TTL.

Fenced writes: every write (unlink, remove, add) is that script, which does nothing unless
the incarnation's write fence (``schema.fence_key``) reads the value the node gave
``apply``: the number of the pipeline before. A resync first sets the fence to a new number,
then writes: a write of a timed-out pipeline that Redis runs late (after the client gave up
on it) either runs before that (and the resync's unlink of its set, after it, replaces it)
or after (and finds another number: nothing done). So no late tail leaves a stale entry.
A write of the node's current pipeline that the fence refuses ran after that pipeline's
fence move (a Redis Cluster client retrying a redirected write at the end): its change is
lost, and :meth:`IndexWriter.count` reports it so that the node resyncs.

Redis full (``maxmemory`` under ``noeviction``): Redis refuses an add (``SADD`` needs memory)
and nothing else a pipeline does (removes and unlinks free memory; the fence's move is a
script flagged ``allow-oom``, as the membership's writes are: ``record.ALLOW_OOM``). The
refused adds are kept, **deferred** (:meth:`IndexWriter.count`), not sent again with every
batch: a later event of the key (removed, stored again, the set cleared) forgets it, so a
deferred key is always one the tier holds, and the node retries them, paced, in batches of
their own (:meth:`IndexWriter.take_deferred`). Meanwhile the index lacks them: fewer holders,
never a false one.

Cost: per batch and per (namespace, tier) touched, at most one ``SREM`` and one ``EVAL`` per
``MAX_ARGS`` keys (inside it one ``SADD`` per ``SADD_ARGS`` keys and one ``PEXPIRE``):
commands per stored chunk fall as batches grow.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserver.cluster import schema
from kvserver.cluster.full import is_oom
from kvserver.cluster.record import ALLOW_OOM
from kvserver.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

#: most fingerprints in one WRITE_SCRIPT call.
MAX_ARGS = 8192
#: most fingerprints in one SADD / SREM inside WRITE_SCRIPT (Lua's unpack stops at about
#: 8,000 values).
SADD_ARGS = 4096
#: most keys a resync fingerprints between two yields to the event loop (``resync``).
RESYNC_STEP = 8192

# KEYS[1]: an index set, KEYS[2]: its incarnation's write fence. ARGV[1]: the fence value the
# write expects (else it does nothing and returns -1: a late pipeline's tail, see the module
# docstring), ARGV[2]: the set's TTL (ms), ARGV[3]: 'u' unlink the set, 'r' remove or 'a' add
# ARGV[4..] (an add gives the set the TTL if it has none, atomically: a script runs whole or
# not at all); returns the number of members removed or added (:meth:`IndexWriter.count`).
# Both keys on the set's slot (``{h:<host_id>}``): one Redis Cluster node runs it.
WRITE_SCRIPT = f"""
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if ARGV[3] == 'u' then return redis.call('UNLINK', KEYS[1]) end
local op = ARGV[3] == 'a' and 'SADD' or 'SREM'
local n, changed = #ARGV, 0
for i = 4, n, {SADD_ARGS} do
  changed = changed + redis.call(op, KEYS[1], unpack(ARGV, i, math.min(i + {SADD_ARGS - 1}, n)))
end
if op == 'SADD' then redis.call('PEXPIRE', KEYS[1], ARGV[2], 'NX') end
return changed
"""

# KEYS: index sets of an incarnation (one slot; the heartbeat passes one). ARGV[1]: their
# TTL (ms). Renews each set's TTL and returns each set's number of members (the heartbeat
# compares them with what the writes left there: :attr:`IndexWriter.sizes`).
KEEP_SCRIPT = """
local out = {}
for i = 1, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
  out[i] = redis.call('SCARD', KEYS[i])
end
return out
"""

# KEYS[1]: an incarnation's write fence. ARGV: the number it should read, the next, its TTL
# (ms). Moves it only from the number before (a late tail's move, after a resync set a new
# one, changes nothing); returns what it read (nil: none). Done while Redis is full.
FENCE_SCRIPT = (
    ALLOW_OOM
    + """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return v
"""
)

SetId = tuple[str, str]  # (ns_id, tier)


@dataclass(slots=True)
class _SetChanges:
    cleared: bool = False
    #: fingerprint -> True (add) / False (remove); last event wins.
    ops: dict[bytes, bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Batch:
    #: per set: (unlink first, fingerprints to add, fingerprints to remove)
    sets: dict[SetId, tuple[bool, list[bytes], list[bytes]]]
    #: namespaces this batch writes for the first time (the record must list them).
    new_namespaces: tuple[str, ...]
    #: the newest event seq the batch reflects.
    last_seq: int = 0

    @property
    def num_keys(self) -> int:
        return sum(len(a) + len(r) for _, a, r in self.sets.values())

    def split(self, max_keys: int) -> list[Batch]:
        """This batch as batches of at most ``max_keys`` keys each, which applied in order
        do what it does (a set's unlink goes in the first that names it; a key is added or
        removed, never both, so the order of the rest is free); the new namespaces are the
        first one's. One batch, this one, when it is no larger."""
        if self.num_keys <= max_keys:
            return [self]
        parts: list[dict[SetId, tuple[bool, list[bytes], list[bytes]]]] = [{}]
        room = max_keys
        for set_id, (unlink, adds, removes) in self.sets.items():
            first = True
            r = a = 0  # removes and adds taken (each key copied once: no slice of the rest)
            while first or a < len(adds) or r < len(removes):
                if room <= 0:
                    parts.append({})
                    room = max_keys
                gone = removes[r : r + room]
                new = adds[a : a + room - len(gone)]
                r, a = r + len(gone), a + len(new)
                parts[-1][set_id] = (unlink and first, new, gone)
                room -= len(gone) + len(new)
                first = False
        news = [self.new_namespaces] + [()] * (len(parts) - 1)
        return [Batch(p, n, self.last_seq) for p, n in zip(parts, news, strict=True)]


class IndexWriter:
    """Coalesces events into batches for one incarnation's index sets (module docstring)."""

    def __init__(self, host_id: str, incarnation: str, ttl_ms: int) -> None:
        self.host_id = host_id
        self.incarnation = incarnation
        self.ttl_ms = ttl_ms
        #: namespaces with index sets in this incarnation (listed in the host record).
        self.namespaces: set[str] = set()
        self._pending: dict[SetId, _SetChanges] = {}
        self.pending_keys = 0
        #: the newest event seq added.
        self.last_seq = 0
        #: the number of the last write pipeline queued: the fence's value once it has run.
        self.fence = 0
        #: members of each set in Redis, as the replies of this incarnation's writes left it
        #: (:meth:`count`); the heartbeat checks Redis still holds them (:meth:`lost_sets`).
        self.sizes: dict[SetId, int] = {}
        #: adds Redis refused for memory, per set, to retry (module docstring): each a key
        #: the tier holds (a later event of it removes it from here).
        self.deferred: dict[SetId, set[bytes]] = {}

    @property
    def deferred_keys(self) -> int:
        """Adds Redis refused for memory, still to be written (the index lacks them)."""
        return sum(len(d) for d in self.deferred.values())

    def add(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.last_seq = max(self.last_seq, ev.seq)
            tier = schema.MEDIUM_TIER.get(ev.medium)
            if tier is None:
                continue
            changes = self._pending.get((ev.ns_id, tier))
            if changes is None:
                changes = self._pending[(ev.ns_id, tier)] = _SetChanges()
            deferred = self.deferred.get((ev.ns_id, tier))
            if isinstance(ev, AllBlocksCleared):
                if deferred:
                    deferred.clear()
                self.pending_keys -= len(changes.ops)
                changes.ops.clear()
                changes.cleared = True
                continue
            added = isinstance(ev, BlockStored)
            assert added or isinstance(ev, BlockRemoved)
            before = len(changes.ops)
            for key in ev.keys:
                fp = schema.fingerprint(key)
                changes.ops[fp] = added
                if deferred:  # this event is newer: it decides
                    deferred.discard(fp)
            self.pending_keys += len(changes.ops) - before

    def drop(self) -> None:
        """Forget pending and deferred changes (the node resyncs instead)."""
        self._pending.clear()
        self.pending_keys = 0
        self.deferred.clear()

    def take_batch(self, *, defer_adds: bool = False) -> Batch | None:
        """The pending changes as one batch (and none pending after), or None. ``defer_adds``
        (Redis is full): the adds go to :attr:`deferred` instead, the batch carries the
        removes and unlinks (which Redis does while full: they free memory)."""
        if not self._pending:
            return None
        sets: dict[SetId, tuple[bool, list[bytes], list[bytes]]] = {}
        for set_id, ch in self._pending.items():
            adds = [fp for fp, add in ch.ops.items() if add]
            removes = [] if ch.cleared else [fp for fp, add in ch.ops.items() if not add]
            if defer_adds and adds:
                self.deferred.setdefault(set_id, set()).update(adds)
                adds = []
            sets[set_id] = (ch.cleared, adds, removes)
        self._pending.clear()
        self.pending_keys = 0
        return Batch(sets, self._claim({ns for ns, _ in sets}), self.last_seq)

    def take_deferred(self, max_keys: int) -> Batch | None:
        """At most ``max_keys`` of the :attr:`deferred` adds as a batch of their own (no
        longer deferred: :meth:`count` defers again those Redis refuses), or None."""
        sets: dict[SetId, tuple[bool, list[bytes], list[bytes]]] = {}
        room = max_keys
        for set_id, fps in self.deferred.items():
            if room <= 0:
                break
            take = [fps.pop() for _ in range(min(room, len(fps)))]
            if take:
                sets[set_id] = (False, take, [])
                room -= len(take)
        self.deferred = {k: v for k, v in self.deferred.items() if v}
        return Batch(sets, (), self.last_seq) if sets else None

    def full_batch(self, snapshot: Mapping[SetId, Sequence[bytes]], last_seq: int) -> Batch:
        """A resync: every set of this incarnation replaced by ``snapshot`` (chunk keys per
        (namespace, tier), as of event ``last_seq``); sets of namespaces it lacks are emptied.
        In one step: :meth:`resync` is the same in steps."""
        steps = self.resync(snapshot, last_seq)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                batch: Batch = done.value
                return batch

    def resync(
        self, snapshot: Mapping[SetId, Sequence[bytes]], last_seq: int
    ) -> Generator[None, None, Batch]:
        """:meth:`full_batch` as a generator that returns the batch, in steps of at most
        :data:`RESYNC_STEP` keys fingerprinted (~2 ms of the loop each; 1 M keys took
        ~0.25 s in one), so that its caller lets the event loop run between steps.

        The first step drops the pending changes and takes ``last_seq``: events added after
        it follow the snapshot and stay pending, for the batch after this one.
        REQUIRES: ``snapshot``'s lists are not changed while it runs (the daemon's are made
        for the call)."""
        self.drop()
        self.last_seq = last_seq
        yield  # the first step: pending changes dropped, nothing fingerprinted
        sets: dict[SetId, tuple[bool, list[bytes], list[bytes]]] = {
            (ns, tier): (True, [], []) for ns in self.namespaces for tier in schema.TIERS
        }
        done = 0  # keys fingerprinted in this step
        for (ns, tier), keys in snapshot.items():
            if not keys:
                continue
            fps: list[bytes] = []
            for i in range(0, len(keys), RESYNC_STEP):
                chunk = keys[i : i + RESYNC_STEP]
                if done and done + len(chunk) > RESYNC_STEP:
                    yield
                    done = 0
                fps += map(schema.fingerprint, chunk)
                done += len(chunk)
            sets[(ns, tier)] = (True, fps, [])
        claimed = self._claim({ns for (ns, _), (_, a, _) in sets.items() if a})
        return Batch(sets, claimed, last_seq)

    def _claim(self, namespaces: set[str]) -> tuple[str, ...]:
        new = tuple(sorted(namespaces - self.namespaces))
        self.namespaces.update(new)
        return new

    def key(self, ns_id: str, tier: str) -> str:
        return schema.index_key(self.host_id, self.incarnation, ns_id, tier)

    def set_ids(self) -> list[SetId]:
        """Every (namespace, tier) this incarnation may have a set for, in a fixed order."""
        return [(ns, tier) for ns in sorted(self.namespaces) for tier in schema.TIERS]

    def index_keys(self) -> list[str]:
        """The keys of :meth:`set_ids`, in that order."""
        return [self.key(ns, tier) for ns, tier in self.set_ids()]

    @property
    def fence_key(self) -> str:
        return schema.fence_key(self.host_id, self.incarnation)

    def next_fence(self) -> int:
        """A new fence number, for a resync to set before its writes (module docstring)."""
        self.fence += 1
        return self.fence

    def queue_fence(self, pipe: Any) -> int:
        """Queue the move of the fence to the next number, done only from the number before
        (:data:`FENCE_SCRIPT`; :meth:`fence_read` checks its reply, the number it read).
        Last in a pipeline: on the sets' slot, after every write of the pipeline to them."""
        self.fence += 1
        pipe.execute_command("EVAL", FENCE_SCRIPT, 1, self.fence_key, self.fence - 1, self.fence,
                             self.ttl_ms)  # fmt: skip
        return 1

    def fence_read(self, reply: Any) -> bool:
        """Whether the fence read (``reply``) the number of the pipeline before the last
        move queued: else Redis lost or reordered writes (the node resyncs)."""
        return reply is not None and int(reply) == self.fence - 1

    def apply(self, pipe: Any, batch: Batch, fence: int | None = None) -> int:
        """Queue ``batch`` on ``pipe`` (a non-transactional redis-py pipeline), each write
        done only while the fence reads ``fence`` (default: :attr:`fence`, the number the
        next move expects; :data:`WRITE_SCRIPT`); returns the number of commands queued
        (their replies, in order, go to :meth:`count`)."""
        commands = 0
        fence_key = self.fence_key
        fence = self.fence if fence is None else fence
        for set_id, op, fps in self._writes(batch):
            args = (WRITE_SCRIPT, 2, self.key(*set_id), fence_key, fence, self.ttl_ms)
            pipe.execute_command("EVAL", *args, op, *fps)
            commands += 1
        return commands

    def count(self, batch: Batch, replies: Sequence[Any]) -> int:
        """Update :attr:`sizes` from the replies of ``batch``'s commands (:meth:`apply`'s, in
        order); returns how many of them the fence refused (-1: they changed nothing). A
        write of the node's current pipeline is refused only when Redis ran it after the
        pipeline's fence move (a Redis Cluster client retrying it after a redirection, at
        the end): its change is lost, and the node resyncs. An add Redis refused for memory
        (the reply an ``OutOfMemoryError``: :func:`is_oom`) is deferred, unless an event
        newer than the batch decided its keys already (pending here); any other error
        reply is raised."""
        refused = 0
        for (set_id, op, fps), reply in zip(self._writes(batch), replies, strict=True):
            if isinstance(reply, Exception):
                if not (op == "a" and is_oom(reply)):
                    raise reply
                self._defer(set_id, fps)
                continue
            n = int(reply)
            if n < 0:
                refused += 1
            elif op == "u":
                self.sizes[set_id] = 0
            else:
                self.sizes[set_id] = self.sizes.get(set_id, 0) + (n if op == "a" else -n)
        return refused

    def _defer(self, set_id: SetId, fps: list[bytes]) -> None:
        newer = self._pending.get(set_id)
        if newer is not None and newer.cleared:
            return  # the set was cleared since: these adds are void
        deferred = self.deferred.setdefault(set_id, set())
        deferred.update(fps if newer is None else (fp for fp in fps if fp not in newer.ops))

    @staticmethod
    def _writes(batch: Batch) -> Iterator[tuple[SetId, str, list[bytes]]]:
        """``batch``'s writes, in the order :meth:`apply` queues them: per set, its unlink,
        then its removes and its adds, :data:`MAX_ARGS` fingerprints a command."""
        for set_id, (unlink, adds, removes) in batch.sets.items():
            if unlink:
                yield set_id, "u", []
            for op, fps in (("r", removes), ("a", adds)):
                for i in range(0, len(fps), MAX_ARGS):
                    yield set_id, op, fps[i : i + MAX_ARGS]

    def lost_sets(self, cards: Sequence[Any]) -> list[str]:
        """The sets among :meth:`index_keys` (``cards``: the number of members Redis reports
        for each, :data:`KEEP_SCRIPT`'s reply) that do not hold what this incarnation's
        writes left there: Redis lost members without any write failing (a set evicted
        under a ``maxmemory-policy`` other than ``noeviction``; the node resyncs)."""
        return [
            f"{self.key(*set_id)} holds {int(card)}, not {self.sizes.get(set_id, 0)}"
            for set_id, card in zip(self.set_ids(), cards, strict=True)
            if int(card) != self.sizes.get(set_id, 0)
        ]
