"""Slot reads of the SSD tier: one chunk's slot read and verified on a thread, and what a read
that fails does to the tier's books.

Runs on the daemon's event loop, owned by :class:`~kvserver.daemon.tiering.SsdTier`, which
hands :meth:`SlotReads.read` to :class:`~kvserver.daemon.promotion.Promotions`; the reads run
on the tier's threads, those asked for in one loop turn together
(:class:`~kvserver.daemon.tier_jobs.ReadQueue`). Like
:class:`~kvserver.daemon.writeback.WriteBack` on the write side, it is given the
collaborators it uses — the slot store and its threads, the SSD index, the read-buffer pool,
the counters, and the tier's ``event``/``discard``/``track`` callbacks — and knows nothing else
of the tier. Not thread-safe: loop only.

Owns the queue of the reads of this loop turn. A read that fails verification or I/O drops its
chunk from the index (counted in ``corrupt_chunks`` / ``io_errors``, BlockRemoved STORAGE, its
slot discarded): the chunk is a miss. Invariant: a buffer taken from the ``reads`` pool goes
back to it exactly once — by the caller when the read returns it, here when the read failed or
its caller is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from kvserver.daemon.tier_jobs import ReadQueue, ReadResult
from kvserver.daemon.writeback import EventSink
from kvserver.ssd.buffers import BufferPool
from kvserver.ssd.config import TierCounters
from kvserver.ssd.fileio import aligned_buffer
from kvserver.ssd.format import ChunkHeader, CorruptChunk
from kvserver.ssd.index import Slot, SsdEntry, SsdIndex
from kvserver.ssd.store import ChunkRead, SlotStore

logger = logging.getLogger(__name__)


class SlotReads:
    """The SSD tier's slot reads; see the module docstring."""

    def __init__(
        self,
        *,
        store: SlotStore,
        threads: Executor,
        num_threads: int,
        index: SsdIndex,
        reads: BufferPool,
        counters: TierCounters,
        event: EventSink,
        discard: Callable[[Slot], None],
        track: Callable[[asyncio.Future[Any]], None],
    ) -> None:
        self._index = index
        self._reads = reads
        self._counters = counters
        self._event = event
        self._discard = discard
        self._queue = ReadQueue(store, threads, num_threads, track=track)

    async def read(self, entry: SsdEntry, use_pool: bool) -> tuple[memoryview, bool] | None:
        """Read and verify one slot on a thread (with the other reads of this loop turn, see
        :class:`~kvserver.daemon.tier_jobs.ReadQueue`): (buffer, whether it came from the
        ``reads`` pool; its payload starts at HEADER_BYTES), or None on failure — then the
        chunk is dropped (counted, BlockRemoved STORAGE, slot discarded) and is a miss.
        REQUIRES: ``entry`` pinned by the caller."""
        size = entry.slot_bytes
        buf = self._reads.acquire(size) if use_pool else None
        pooled = buf is not None
        if buf is None:
            buf = aligned_buffer(size)
        fut: asyncio.Future[tuple[memoryview, bool] | None]
        fut = asyncio.get_running_loop().create_future()

        def done(result: ReadResult) -> None:
            got = self._read_done(entry, buf, pooled, result)
            if not fut.cancelled():
                fut.set_result(got)
            elif got is not None and pooled:  # the caller is gone: the buffer comes back
                self._reads.release(buf)

        expect = (entry.ns_id, entry.key, entry.seq)
        self._queue.submit(size, ChunkRead(entry.slot, expect, buf), done)
        try:
            return await fut
        except asyncio.CancelledError:  # cancelled after the result was set: nobody takes it
            got = fut.result() if fut.done() and not fut.cancelled() else None
            if got is not None and got[1]:
                self._reads.release(got[0])
            raise

    def _read_done(
        self, entry: SsdEntry, buf: memoryview, pooled: bool, result: ReadResult
    ) -> tuple[memoryview, bool] | None:
        if isinstance(result, ChunkHeader):
            self._counters.loaded_chunks += 1
            self._counters.bytes_read += entry.slot_bytes
            return buf, pooled
        if isinstance(result, CorruptChunk):
            self._counters.corrupt_chunks += 1
            logger.warning("SSD tier: dropped a corrupt chunk (a miss): %s", result)
        else:
            self._counters.io_errors += 1
            logger.warning("SSD tier: dropped an unreadable chunk (a miss): %s", result)
        if self._index.get(entry.ns_id, entry.key) is entry:
            slot = self._index.remove(entry)
            self._event(entry.ns_id, False, entry.key)
            if slot is not None:
                self._discard(slot)
        if pooled:
            self._reads.release(buf)
        return None
