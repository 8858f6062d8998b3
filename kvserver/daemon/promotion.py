"""Promotion: bring chunks that are only on SSD back into the DRAM tier before a load.

Runs on the daemon's event loop, owned by :class:`~kvserver.daemon.tiering.SsdTier` (its
``promote`` delegates to :class:`Promotions`); the slot reads run on the tier's I/O threads.
:class:`Promotions` is given the collaborators it uses — the DRAM engine, the SSD index, the
read-buffer pool, the counters, the slot reads' ``read`` (``tier_reads.SlotReads``) and the
tier's ``unpin``/``flush_events``/``track`` — and knows nothing else of the tier.
Several promotions may be under way at once (the ZMQ front end runs each load that needs one as
its own task), so :class:`Promotions` keeps the keys being promoted, per namespace and key:

- a key is promoted by at most one batch at a time. A request naming a key that another batch
  is promoting waits for that batch (without taking a slot) and then finds the key in DRAM, or,
  for a ``direct`` request, takes the bytes that batch read for it when DRAM could not hold
  them. Keys it still misses then (the other batch was not ``direct``, or failed) it promotes
  itself, once;
- at most ``limit`` batches read at once (an ``asyncio.Semaphore``); the others wait their turn
  with their keys already claimed, so later requests for those keys join them.

One batch (:meth:`Promotions.promote_batch`):

1. plan: the request's keys that are in DRAM (protected from the eviction below) and the
   claimed keys READY on SSD but not in DRAM (pinned in the SSD index so they are not evicted
   while read);
2. reserve DRAM for the latter with one ``prepare_store(gated=False)`` (atomic: all or none;
   it may evict DRAM victims, which the tier writes back);
3. read and verify the slots in windows of ``staging_bytes`` on threads; a chunk that fails
   is dropped by the tier (a miss);
4. copy each chunk's verified parts into its reserved arena pages (``write_part``) as soon as
   it was read (the copies overlap the window's other reads), then complete the store for the
   keys that made it, rolling back the rest; unpin.

If DRAM cannot take the chunks (every page pinned or reserved) and the caller asked for
``direct``, the verified bytes are returned instead, for the remote ``get`` to send straight
from the read buffers. Those buffers are bounded per daemon: a batch that would hold more than
``serve_limit`` bytes of them at once, counting every other batch's still alive (a buffer
counts until the reply that sends it has let go of it: a finalizer on its mapping), is refused
before it reads (``CapacityError``, counted in ``refused_direct_chunks``, nothing held), so a
large ``get`` against a fully pinned DRAM cannot allocate without limit. The reservation holds
a lease of ``max_lease_s``: should the disk be so slow that it expires, ``write_part`` fails
and the chunk is simply not promoted. While a batch runs the loop serves other requests, so
under DRAM pressure a chunk promoted (or protected) for one request may be evicted by another's
store before the request pins it: its load then reports the chunk missing, as for any miss.

A batch cancelled while slot reads are still running on the I/O threads (its caller's
deadline, a shutdown) leaves each such slot pinned until its read has ended: the read goes on
regardless, and an unpinned slot may be reused and rewritten under it (then counted corrupt).
Such a read is the tier's disk work in flight (``track``: ``wait_idle`` and ``close`` wait
for it) until it has ended and given back its buffer and its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable, Collection, Sequence
from functools import partial

from kvserver.daemon.owners import PROMOTE_CLIENT as PROMOTE_CLIENT
from kvserver.engine import StorageEngine
from kvserver.errors import CapacityError, KVServerError
from kvserver.namespace import NamespaceSpec
from kvserver.ssd.buffers import BufferPool
from kvserver.ssd.config import TierCounters
from kvserver.ssd.format import HEADER_BYTES
from kvserver.ssd.index import SsdEntry, SsdIndex

logger = logging.getLogger(__name__)

#: batches reading at once unless configured otherwise (``ssd_promotions``).
DEFAULT_PROMOTIONS = 4

_Parts = dict[bytes, list[memoryview]]
#: read and verify one pinned slot: (buffer, whether from the reads pool) or None (a miss);
#: a buffer not from the pool is a view of an object of its own that can be weakly referenced
#: (an anonymous mmap: the direct-serve budget is given back when it is freed)
SlotRead = Callable[[SsdEntry, bool], Awaitable["tuple[memoryview, bool] | None"]]
_Read = asyncio.Future["tuple[memoryview, bool] | None"]


class Promotions:
    """The promotions of one tier under way; see the module docstring. Loop only.

    Invariants: a (namespace, key) is in the in-flight map from the moment one batch claims it
    until that batch has finished (promoted, served direct or given up), and maps to that
    batch's future; the future is resolved exactly then, with the batch's direct parts ({} on
    failure or cancellation), never with an exception.
    """

    def __init__(
        self,
        *,
        engine: StorageEngine,
        index: SsdIndex,
        reads: BufferPool,
        counters: TierCounters,
        read: SlotRead,
        unpin: Callable[[SsdEntry], None],
        flush_events: Callable[[], None],
        track: Callable[[_Read, Callable[[_Read], None]], None],
        window_bytes: int,
        serve_limit: int,
        limit: int = DEFAULT_PROMOTIONS,
    ) -> None:
        if limit < 1:
            raise ValueError("at least one promotion must be allowed")
        self._engine = engine
        self._index = index
        self._reads = reads
        self._counters = counters
        self._read = read
        self._unpin = unpin
        self._flush_events = flush_events
        self._track = track
        self._window_bytes = window_bytes
        self._serve_limit = serve_limit
        #: bytes of direct-serve read buffers alive (budgeted, read or being read).
        self.serving_bytes = 0
        self._slots = asyncio.Semaphore(limit)
        self._inflight: dict[tuple[str, bytes], asyncio.Future[_Parts]] = {}
        #: keys a request waited for because another batch was promoting them.
        self.joined_chunks = 0

    @property
    def num_in_flight(self) -> int:
        """Keys claimed by a batch that has not finished (waiting for a slot or reading)."""
        return len(self._inflight)

    def in_flight(self, ns_id: str, key: bytes) -> bool:
        return (ns_id, key) in self._inflight

    def needs(self, ns_id: str, key: bytes) -> bool:
        """True if ``key`` is being promoted, or READY on SSD and not in DRAM."""
        if (ns_id, key) in self._inflight:
            return True
        return not self._engine.contains(ns_id, key) and self._index.ready(ns_id, key) is not None

    async def promote(self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False) -> _Parts:
        """Promote the keys of ``keys`` that need it, joining batches already promoting some;
        returns what :func:`promote_batch` returns, for all of them together."""
        out: _Parts = {}
        unique = list(dict.fromkeys(keys))
        candidates = unique
        for _round in range(2):  # the second round: keys a joined batch did not bring in
            todo = [k for k in candidates if k not in out and self.needs(ns_id, k)]
            mine = [k for k in todo if (ns_id, k) not in self._inflight]
            theirs: dict[int, asyncio.Future[_Parts]] = {}
            for key in todo:
                fut = self._inflight.get((ns_id, key))
                if fut is not None:
                    theirs[id(fut)] = fut
                    self.joined_chunks += 1
            if mine:
                out.update(await self._run(ns_id, unique, mine, direct))
            wanted = set(todo)
            for fut in theirs.values():
                shared = await asyncio.shield(fut)  # our cancellation must not cancel theirs
                if direct:
                    out.update((k, v) for k, v in shared.items() if k in wanted)
            candidates = [k for k in todo if k not in mine]
            if not candidates:
                break
        return out

    async def _run(self, ns_id: str, keys: list[bytes], mine: list[bytes], direct: bool) -> _Parts:
        """Claim ``mine``, promote them in a slot, release the claim, share the result."""
        fut: asyncio.Future[_Parts] = asyncio.get_running_loop().create_future()
        for key in mine:
            self._inflight[(ns_id, key)] = fut
        got: _Parts = {}
        try:
            async with self._slots:
                got = await self.promote_batch(ns_id, keys, set(mine), direct=direct)
            return got
        finally:
            for key in mine:
                del self._inflight[(ns_id, key)]
            fut.set_result(got)

    async def promote_batch(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        claimed: Collection[bytes],
        *,
        direct: bool = False,
    ) -> dict[bytes, list[memoryview]]:
        """Promote the keys of ``claimed`` that are READY on SSD but not in DRAM; the keys of
        ``keys`` in DRAM are protected from the eviction this may cause (module docstring).

        Returns, when ``direct``, the parts (one view per rank) of keys DRAM could not take;
        otherwise {}. Keys in neither tier and keys that fail verification are left for the
        caller's load to report missing. Raises what ``prepare_store`` raises for bad input
        (nothing changed then). REQUIRES: no other batch promotes a key of ``claimed``.
        """
        engine, index = self._engine, self._index
        spec = engine.namespace(ns_id)
        todo: list[SsdEntry] = []
        protect: list[bytes] = []
        unique = list(dict.fromkeys(keys))
        absent = set(engine.missing(ns_id, unique))
        for key in unique:
            if key not in absent:
                protect.append(key)
            elif key in claimed and (entry := index.ready(ns_id, key)) is not None:
                todo.append(entry)
        if not todo:
            return {}
        for entry in todo:
            index.pin(entry)
        out: dict[bytes, list[memoryview]] = {}
        lease = 0
        done: list[bytes] = []
        #: slot reads started and not yet taken by their ``take``
        reads: dict[bytes, _Read] = {}
        #: direct-serve bytes budgeted per key and not yet handed to a buffer's finalizer
        serving: dict[bytes, int] = {}
        try:
            grant = engine.prepare_store(
                ns_id,
                protect + [e.key for e in todo],
                client=PROMOTE_CLIENT,
                lease_s=engine.config.max_lease_s,
                gated=False,
            )
            self._flush_events()
            reserved = set(grant.keys) if grant is not None else set()
            lease = grant.lease_id if grant is not None else 0
            wanted = [e for e in todo if e.key in reserved or direct]
            serving.update((e.key, e.slot_bytes) for e in wanted if e.key not in reserved)
            self._budget(serving)

            async def take(entry: SsdEntry) -> None:
                """Read one chunk, then (as soon as it is verified, while the others are still
                being read) copy it into its reserved pages or keep its bytes to send."""
                reads[entry.key] = read = asyncio.ensure_future(
                    self._read(entry, entry.key in reserved)
                )
                got = await asyncio.shield(read)  # a cancellation leaves the read running
                if reads.pop(entry.key, None) is None:
                    return  # the batch ended meanwhile and took the read over (``_abandon``)
                if got is None:
                    self._unserve(serving.pop(entry.key, 0))
                    return
                buf, pooled = got
                parts = _parts(buf, spec)
                if entry.key not in reserved:
                    out[entry.key] = parts  # the caller sends them; the buffer is its own
                    weakref.finalize(buf.obj, self._unserve, serving.pop(entry.key))
                    self._counters.served_direct_chunks += 1
                    return
                try:
                    for rank, part in enumerate(parts):
                        engine.write_part(lease, entry.key, rank, part)
                    done.append(entry.key)
                except KVServerError as exc:  # the lease expired under a very slow disk
                    logger.warning("SSD tier: promotion of a chunk failed: %s", exc)
                finally:
                    if pooled:
                        self._reads.release(buf)

            for window in _windows(wanted, self._window_bytes):
                await asyncio.gather(*(take(e) for e in window))
        finally:
            for entry in todo:
                read = reads.pop(entry.key, None)
                budget = serving.pop(entry.key, 0)
                if read is None:
                    self._unpin(entry)
                    self._unserve(budget)
                elif read.done():
                    self._abandon(entry, budget, read)
                else:  # its thread still reads the slot: unpinned once the read ends
                    self._track(read, partial(self._abandon, entry, budget))
            if lease:
                self._finish(lease, done)
            self._flush_events()
        return out

    def _budget(self, serving: dict[bytes, int]) -> None:
        """Hold the direct-serve bytes of ``serving`` or raise CapacityError, nothing held."""
        need = sum(serving.values())
        if not need:
            return
        if self.serving_bytes + need > self._serve_limit:
            self._counters.refused_direct_chunks += len(serving)
            held, chunks = self.serving_bytes, len(serving)
            serving.clear()
            raise CapacityError(
                "serving these chunks straight from SSD (DRAM cannot take them: every page "
                "pinned or reserved) would hold too many read buffers; retry later or ask for "
                "fewer keys",
                chunks=chunks,
                bytes=need,
                serving_bytes=held,
                limit_bytes=self._serve_limit,
            )
        self.serving_bytes += need

    def _unserve(self, nbytes: int) -> None:
        self.serving_bytes -= nbytes

    def _abandon(self, entry: SsdEntry, budget: int, read: _Read) -> None:
        """A slot read whose batch ended first has ended: give back its pooled buffer and its
        direct-serve budget, and unpin its slot."""
        if not read.cancelled() and read.exception() is None:
            got = read.result()
            if got is not None and got[1]:
                self._reads.release(got[0])
        self._unserve(budget)
        self._unpin(entry)

    def _finish(self, lease: int, done: list[bytes]) -> None:
        """Complete the promoted keys; roll back whatever else the lease still reserves (one
        ``settle_store``)."""
        with contextlib.suppress(KVServerError):  # the lease expired under a very slow disk
            self._counters.promoted_chunks += len(self._engine.settle_store(lease, done))


def _windows(entries: list[SsdEntry], budget: int) -> list[list[SsdEntry]]:
    """Consecutive groups whose slot bytes fit ``budget`` (at least one entry each)."""
    out: list[list[SsdEntry]] = []
    cur: list[SsdEntry] = []
    size = 0
    for e in entries:
        if cur and size + e.slot_bytes > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.slot_bytes
    if cur:
        out.append(cur)
    return out


def _parts(buf: memoryview, spec: NamespaceSpec) -> list[memoryview]:
    part, base = spec.part_bytes, HEADER_BYTES
    return [buf[base + r * part : base + (r + 1) * part] for r in range(spec.tp_world_size)]
