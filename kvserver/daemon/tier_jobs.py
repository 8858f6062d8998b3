"""Batched disk jobs of the SSD tier: many chunk operations per trip to an I/O thread.

Runs on the daemon's event loop (building, submitting and completing jobs); the jobs run on the
tier's thread pool through :class:`~kvserver.ssd.store.SlotStore`. Not thread-safe: loop only.

Why batches: a trip to a thread and back (executor submit, two futures, a wake-up of the
loop, a completion callback) costs tens of microseconds of loop time per job, as much as the
disk time of a small chunk. So the tier hands the threads *jobs*: a :class:`WriteBatch` holds
the write-backs of one eviction (up to ``BATCH_BYTES`` of slots; a longer eviction is cut into
several, submitted while the loop still copies the rest) and the discards of the SSD slots
their reservation evicted; :class:`ReadQueue` gathers the reads asked for in one loop turn and
submits them in a few jobs. Inside a job the store writes (or reads) each run of consecutive
slots in one system call. Every crash-safety rule stays the store's (docs/ssd_format.md):
batching changes how many chunks go per call, never the order of a slot's own writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvserver.errors import StorageError
from kvserver.ssd.format import ChunkHeader
from kvserver.ssd.index import Slot, SsdEntry
from kvserver.ssd.store import ChunkRead, ChunkWrite, SlotStore

#: one job carries about this many slot bytes (at least one chunk).
BATCH_BYTES = 4 << 20
#: slots discarded by one job when there is nothing to write (start-up, failed reads).
DISCARD_BATCH = 256

ReadResult = ChunkHeader | StorageError
Errors = list[StorageError | None]


@dataclass(slots=True)
class WriteBatch:
    """One job: slots to discard, then chunks to write into slots of ``slot_bytes``
    (``entries[i]`` is the index entry of ``writes[i]``)."""

    slot_bytes: int
    discards: list[Slot] = field(default_factory=list)
    entries: list[SsdEntry] = field(default_factory=list)
    writes: list[ChunkWrite] = field(default_factory=list)

    @property
    def is_full(self) -> bool:
        return len(self.writes) * self.slot_bytes >= BATCH_BYTES

    def __bool__(self) -> bool:
        return bool(self.writes or self.discards)


def run_batch(store: SlotStore, batch: WriteBatch) -> tuple[Errors, Errors]:
    """The job (on a thread): one result per discard and per write (None: done). Never
    raises: should the store raise (a bug), each item of that half fails with the error."""
    discarded = _each(len(batch.discards), store.discard_slots, batch.discards)
    written = _each(len(batch.writes), store.write_chunks, batch.slot_bytes, batch.writes)
    return discarded, written


def _each(n: int, fn: Callable[..., Errors], *args: Any) -> Errors:
    if not n:
        return []
    try:
        return fn(*args)
    except Exception as exc:  # nothing is known about the slots: each item failed
        return [StorageError(f"disk job failed: {exc!r}")] * n


class ReadQueue:
    """Reads asked for during one loop turn go to the threads together, at the end of the
    turn: per data file, in slot order, cut into at most ``BATCH_BYTES`` per job but into at
    least as many jobs as there are threads (so a few reads still run in parallel).

    Invariant: every submitted read's ``done`` callback runs exactly once, on the loop, with
    the verified header or the error (also if the job itself failed).
    """

    def __init__(
        self,
        store: SlotStore,
        threads: Executor,
        num_threads: int,
        track: Callable[[asyncio.Future[Any]], None] = lambda fut: None,
    ) -> None:
        self._store = store
        self._threads = threads
        self._num_threads = num_threads
        self._track = track  # sees every job's future (the tier drains them at close)
        self._pending: list[tuple[int, ChunkRead, Callable[[ReadResult], None]]] = []

    def submit(self, slot_bytes: int, read: ChunkRead, done: Callable[[ReadResult], None]) -> None:
        """Queue one read; ``done(result)`` runs on the loop once it was read and verified."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((slot_bytes, read, done))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        files: dict[int, list[tuple[ChunkRead, Callable[[ReadResult], None]]]] = {}
        for slot_bytes, read, done in pending:
            files.setdefault(slot_bytes, []).append((read, done))
        loop = asyncio.get_running_loop()
        for slot_bytes, items in files.items():
            items.sort(key=lambda item: item[0].slot)
            per_job = max(1, min(BATCH_BYTES // slot_bytes, -(-len(items) // self._num_threads)))
            for i in range(0, len(items), per_job):
                job = items[i : i + per_job]
                reads = [read for read, _ in job]
                fut = loop.run_in_executor(
                    self._threads, self._store.read_chunks, slot_bytes, reads
                )
                fut.add_done_callback(partial(_reads_done, [done for _, done in job]))
                self._track(fut)


def _reads_done(
    dones: list[Callable[[ReadResult], None]], fut: asyncio.Future[list[ReadResult]]
) -> None:
    if fut.cancelled() or fut.exception() is not None:
        exc = fut.exception() if not fut.cancelled() else None
        err = StorageError(f"read job failed: {exc!r}")
        results: list[ReadResult] = [err] * len(dones)
    else:
        results = fut.result()
    for done, result in zip(dones, results, strict=True):
        done(result)
