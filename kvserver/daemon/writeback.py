"""Write-back: DRAM victims written down to the SSD tier, in batches.

Runs on the daemon's event loop, as part of :class:`~kvserver.daemon.tiering.SsdTier` (its
``on_evict`` delegates to :meth:`WriteBack.on_evict`); the disk work runs on the tier's
threads as :class:`~kvserver.daemon.tier_jobs.WriteBatch` jobs. Not thread-safe: loop only.

``on_evict`` is synchronous and called by the engine before the victims' pages are freed: a
victim used at least ``admission`` times, of a namespace already saved in the directory, not
yet on SSD, gets a staging buffer and an SSD slot (the reservation may evict SSD victims by the
tier's own policy: their slots are discarded by the same job); its parts are copied into the
buffer. Whatever does not fit (staging full, SSD full of chunks being read, tier degraded) is
dropped and counted. The admitted chunks go to the threads in jobs of about ``BATCH_BYTES``
(a long eviction is cut, each job submitted as soon as it is full, so the disk starts while the
loop still copies). When a job is done, each written entry becomes READY (BlockStored, medium
STORAGE); a failed one is aborted, its slot discarded, and the tier turns ``degraded`` — while
degraded one write (the ``probe``) is let through every ``retry_s``.

Invariants: every staging buffer acquired here is released exactly once, when its job is done;
every slot handed to a job is reported back to the index exactly once (``commit``/``abort``,
``discarded``/``discard_failed``), on the loop.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

from kvserver.daemon.tier_jobs import DISCARD_BATCH, WriteBatch, run_batch
from kvserver.engine_types import Entry
from kvserver.errors import StorageError
from kvserver.namespace import NamespaceSpec
from kvserver.ssd.format import HEADER_BYTES, ChunkHeader, slot_bytes_for
from kvserver.ssd.index import Slot, SsdEntry
from kvserver.ssd.store import ChunkWrite

if TYPE_CHECKING:
    from kvserver.daemon.tiering import SsdTier

logger = logging.getLogger(__name__)


class WriteBack:
    """The write-back of one tier; see the module docstring. Loop only."""

    def __init__(self, tier: SsdTier) -> None:
        self._tier = tier
        #: the one write let through while degraded (None when none is in flight)
        self.probe: SsdEntry | None = None

    def on_evict(self, spec: NamespaceSpec, victims: list[Entry]) -> None:
        """Write down the admitted ``victims`` of ``spec`` (see the module docstring)."""
        t = self._tier
        c = t.counters
        ns_id = spec.ns_id
        writable = t.writable()
        if not t.opened or ns_id not in t.durable:
            c.skipped_chunks += len(victims)
            if writable:
                t.namespaces_changed()
            return
        tp, part = spec.tp_world_size, spec.part_bytes
        slot_bytes = slot_bytes_for(tp * part)
        views = t.engine.arena.views
        batch = WriteBatch(slot_bytes)
        for victim in victims:
            if t.index.get(ns_id, victim.key) is not None:
                continue  # already on SSD (inclusive tiers) or being written
            if victim.uses < t.config.admission:
                c.not_admitted_chunks += 1
                continue
            buf = t.staging.acquire(slot_bytes) if writable else None
            got = t.index.reserve(ns_id, victim.key, slot_bytes) if buf is not None else None
            if buf is None or got is None:
                if buf is not None:
                    t.staging.release(buf)
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
            if not t.is_ok:  # degraded: this write is the probe, skip the rest
                self.probe, writable = entry, False
            if batch.is_full:
                self._submit(batch)  # the threads start while the loop copies the rest
                batch = WriteBatch(slot_bytes)
        if batch:
            self._submit(batch)

    def _submit(self, batch: WriteBatch) -> None:
        """One thread job for the batch: its discards, then its writes."""
        t = self._tier
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(t.threads, run_batch, t.store, batch)
        t.track(fut, partial(self._batch_done, batch))

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

    def _write_done(self, entry: SsdEntry, buf: memoryview, exc: BaseException | None) -> None:
        t = self._tier
        t.staging.release(buf)
        if self.probe is entry:
            self.probe = None
        if exc is None:
            t.index.commit(entry)
            t.counters.stored_chunks += 1
            t.counters.bytes_written += entry.slot_bytes
            t.event(entry.ns_id, True, entry.key)
            t.write_succeeded()
            return
        slot = t.index.abort(entry)
        if isinstance(exc, StorageError) and exc.context.get("slot_touched") is False:
            t.index.discarded(slot)  # nothing was written there: free at once
        else:
            self.discard(slot)
        t.failed_write(exc)

    def _evicted(self, victims: list[SsdEntry]) -> list[Slot]:
        """Count and announce SSD victims; their slots, to discard."""
        t = self._tier
        for victim in victims:
            t.counters.evicted_chunks += 1
            t.event(victim.ns_id, False, victim.key)
        return [victim.location for victim in victims]

    def discard(self, *slots: Slot) -> None:
        """Discard slots on the threads (one job per DISCARD_BATCH slots)."""
        for i in range(0, len(slots), DISCARD_BATCH):
            self._submit(WriteBatch(0, discards=list(slots[i : i + DISCARD_BATCH])))

    def _discard_done(self, slot: Slot, exc: BaseException | None) -> None:
        t = self._tier
        if exc is None:
            t.index.discarded(slot)
        else:
            t.index.discard_failed(slot)
            t.counters.io_errors += 1
            logger.warning("SSD tier: slot %s not reusable: %s", slot, exc)
