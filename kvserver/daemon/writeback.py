"""Write-back: DRAM victims written down to the SSD tier, in batches.

Runs on the daemon's event loop, owned by :class:`~kvserver.daemon.tiering.SsdTier` (its
``on_evict`` delegates to :meth:`WriteBack.on_evict` once the namespace is saved in the
directory); the disk work runs on the tier's threads as
:class:`~kvserver.daemon.tier_jobs.WriteBatch` jobs. It is given the collaborators it uses —
the SSD index, the staging pool, the slot store and its threads, the counters, the tier's
health, the arena's views, and the tier's ``event``/``track`` callbacks — and knows nothing
else of the tier. Not thread-safe: loop only.

``on_evict`` is synchronous and called by the engine before the victims' pages are freed: a
victim used at least ``admission`` times, not yet on SSD, gets a staging buffer and an SSD
slot (the reservation may evict SSD victims by the
tier's own policy: their slots are discarded by the same job); its parts are copied into the
buffer. Whatever does not fit (staging full or its new buffer cannot be mapped, SSD full of
chunks being read, tier degraded) is dropped and counted; nothing here raises once a slot is
reserved (an entry left WRITING could never be written down again). The admitted chunks go
to the threads in jobs of about ``BATCH_BYTES`` (a long eviction is cut, each job submitted as
soon as it is full, so the disk starts while the loop still copies). When a job is done, each
written entry becomes READY (BlockStored, medium STORAGE); a failed one is aborted, its slot
discarded, and the tier turns ``degraded`` — while degraded one write (the ``probe``) is let
through every ``retry_s``.

Invariants: every staging buffer acquired here is released exactly once, when its job is done;
every slot handed to a job is reported back to the index exactly once (``commit``/``abort``,
``discarded``/``discard_failed``), on the loop; so is every slot handed to :meth:`release`
(``released``).

Disk space: once discards have freed slots, :meth:`release` punches the spare slots the index
no longer wants kept (the files then hold about the capacity whatever the mix of slot sizes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from typing import Any

from kvserver.allocator import Extents
from kvserver.daemon.tier_health import TierHealth
from kvserver.daemon.tier_jobs import DISCARD_BATCH, WriteBatch, run_batch
from kvserver.engine.types import Entry
from kvserver.errors import StorageError
from kvserver.namespace import NamespaceSpec
from kvserver.ssd.buffers import BufferPool
from kvserver.ssd.config import TierCounters
from kvserver.ssd.format import HEADER_BYTES, ChunkHeader, slot_bytes_for
from kvserver.ssd.index import Slot, SsdEntry, SsdIndex
from kvserver.ssd.store import ChunkWrite, SlotStore

logger = logging.getLogger(__name__)

#: queue a STORAGE event (ns_id, stored, key)
EventSink = Callable[[str, bool, bytes], None]
#: count a future as disk work in flight, then call the callback with it
Tracker = Callable[["asyncio.Future[Any]", Callable[["asyncio.Future[Any]"], None]], None]


class WriteBack:
    """The write-back of one tier; see the module docstring. Loop only."""

    def __init__(
        self,
        *,
        index: SsdIndex,
        staging: BufferPool,
        store: SlotStore,
        threads: Executor,
        counters: TierCounters,
        health: TierHealth,
        views: Callable[[Extents], list[memoryview]],
        admission: int,
        event: EventSink,
        track: Tracker,
    ) -> None:
        self._index = index
        self._staging = staging
        self._store = store
        self._threads = threads
        self._counters = counters
        self._health = health
        self._views = views
        self._admission = admission
        self._event = event
        self._track = track
        #: the one write let through while degraded (None when none is in flight)
        self.probe: SsdEntry | None = None

    def writable(self) -> bool:
        """Whether a write may go through now (``TierHealth.writable``)."""
        return self._health.writable(self.probe is not None)

    def on_evict(self, spec: NamespaceSpec, victims: list[Entry]) -> None:
        """Write down the admitted ``victims`` of ``spec`` (see the module docstring).
        REQUIRES: the tier is open and ``spec`` is saved in its directory."""
        c = self._counters
        index, staging = self._index, self._staging
        ns_id = spec.ns_id
        writable = self.writable()
        tp, part = spec.tp_world_size, spec.part_bytes
        slot_bytes = slot_bytes_for(tp * part)
        views = self._views
        batch = WriteBatch(slot_bytes)
        for victim in victims:
            if index.get(ns_id, victim.key) is not None:
                continue  # already on SSD (inclusive tiers) or being written
            if victim.uses < self._admission:
                c.not_admitted_chunks += 1
                continue
            buf = self._staging_buffer(slot_bytes) if writable else None
            if buf is None:
                writable = False  # ENOMEM: the rest are skipped too (pool full: the same)
            got = index.reserve(ns_id, victim.key, slot_bytes) if buf is not None else None
            if buf is None or got is None:
                if buf is not None:
                    staging.release(buf)
                c.skipped_chunks += 1
                continue
            entry, ssd_victims = got
            batch.discards += self._evicted(ssd_victims)
            pos = HEADER_BYTES
            for rank in range(tp):
                for view in views(victim.extents[rank]):
                    end = pos + view.nbytes
                    buf[pos:end] = view
                    pos = end
            meta = ChunkHeader(ns_id, victim.key, entry.seq, slot_bytes, part, tp, 0)
            batch.entries.append(entry)
            batch.writes.append(ChunkWrite(entry.slot, meta, buf))
            if not self._health.is_ok:  # degraded: this write is the probe, skip the rest
                self.probe, writable = entry, False
            if batch.is_full:
                self._submit(batch)  # the threads start while the loop copies the rest
                batch = WriteBatch(slot_bytes)
        if batch:
            self._submit(batch)

    def _staging_buffer(self, slot_bytes: int) -> memoryview | None:
        """A staging buffer, or None when the pool is full or a new buffer cannot be mapped
        (ENOMEM): raising here would leave the chunks reserved before it WRITING forever."""
        try:
            return self._staging.acquire(slot_bytes)
        except (OSError, MemoryError) as exc:
            logger.warning("SSD tier: no staging buffer (%s); write-backs skipped", exc)
            return None

    def _submit(self, batch: WriteBatch) -> None:
        """One thread job for the batch: its discards, then its writes."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._threads, run_batch, self._store, batch)
        self._track(fut, partial(self._batch_done, batch))

    def _batch_done(self, batch: WriteBatch, fut: asyncio.Future[Any]) -> None:
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is None:
            discarded, written = fut.result()
        else:  # the job itself failed (a bug, or cancelled at shutdown): nothing is known
            discarded, written = [exc] * len(batch.discards), [exc] * len(batch.writes)
        for slot, err in zip(batch.discards, discarded, strict=True):
            self._discard_done(slot, err)
        for entry, w, err in zip(batch.entries, batch.writes, written, strict=True):
            self._write_done(entry, w.buf, err)
        self.release()

    def release(self) -> None:
        """Return the disk blocks of the spare slots the index no longer wants kept
        (:meth:`SsdIndex.to_release`: the files past the capacity plus its slack), one thread
        job per data file; each slot is free again when its job is done."""
        files: dict[int, list[int]] = {}
        for slot_bytes, slot in self._index.to_release():
            files.setdefault(slot_bytes, []).append(slot)
        loop = asyncio.get_running_loop()
        for slot_bytes, slots in files.items():
            fut = loop.run_in_executor(self._threads, self._store.release_slots, slot_bytes, slots)
            self._track(fut, partial(self._released, slot_bytes, slots))

    def _released(self, slot_bytes: int, slots: list[int], fut: asyncio.Future[Any]) -> None:
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        errors = fut.result() if exc is None else [exc] * len(slots)
        could = self._index.can_release  # several jobs may fail: one warning
        for slot, err in zip(slots, errors, strict=True):
            self._index.released((slot_bytes, slot), ok=err is None)
            if err is None:
                self._counters.released_slots += 1
        failed = next((e for e in errors if e is not None), None)
        if failed is not None and could:
            logger.warning(
                "SSD tier: free slots keep their disk space from now on (%s): the data files "
                "may hold up to the capacity per slot size",
                failed,
            )

    def _write_done(self, entry: SsdEntry, buf: memoryview, exc: BaseException | None) -> None:
        self._staging.release(buf)
        if self.probe is entry:
            self.probe = None
        if exc is None:
            self._index.commit(entry)
            self._counters.stored_chunks += 1
            self._counters.bytes_written += entry.slot_bytes
            self._event(entry.ns_id, True, entry.key)
            self._health.write_succeeded()
            return
        slot = self._index.abort(entry)
        if isinstance(exc, StorageError) and exc.context.get("slot_touched") is False:
            self._index.discarded(slot)  # nothing was written there: free at once
        else:
            self.discard(slot)
        self._health.failed_write(exc)

    def _evicted(self, victims: list[SsdEntry]) -> list[Slot]:
        """Count and announce SSD victims; their slots, to discard."""
        for victim in victims:
            self._counters.evicted_chunks += 1
            self._event(victim.ns_id, False, victim.key)
        return [victim.location for victim in victims]

    def discard(self, *slots: Slot) -> None:
        """Discard slots on the threads (one job per DISCARD_BATCH slots)."""
        for i in range(0, len(slots), DISCARD_BATCH):
            self._submit(WriteBatch(0, discards=list(slots[i : i + DISCARD_BATCH])))

    def _discard_done(self, slot: Slot, exc: BaseException | None) -> None:
        if exc is None:
            self._index.discarded(slot)
        else:
            self._index.discard_failed(slot)
            self._counters.io_errors += 1
            logger.warning("SSD tier: slot %s not reusable: %s", slot, exc)
