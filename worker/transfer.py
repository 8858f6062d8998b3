"""The transfer engine: ordered asynchronous copies between KV blocks and host memory.

Runs in the worker process. The connector (worker/kv_connector.py) builds one
:class:`Transfer` per request and lease and direction, calls :meth:`TransferEngine.submit`, and
later collects it from :meth:`TransferEngine.poll` (non-blocking) or blocks on
:meth:`TransferEngine.wait` (the preemption barrier). Two handlers, one per direction:
``STORE`` (KV blocks → host: the arena or a staging buffer) and ``LOAD`` (host → KV blocks),
like vLLM's per-(src, dst) OffloadingHandlers.

Ordering guarantee (both engines): within one direction a transfer never starts before the
previous one submitted in that direction has finished; the two directions run independently.
Every transfer is collected exactly once, in submission order per direction, successful or
not; a failure of one key's copies fails that key only (``Transfer.failed_keys``).

Grouping: consecutive transfers of one direction that are queued together and have no
``prepare``/``finish`` (the co-located path: copies only) run as ONE group — one copy context
(CUDA: one stream, one start/end event pair for all), their copies in one batch (staged parts
through the staging buffer together) — and are then reported one by one as before. A decode
step stores one chunk per request, so without grouping a step's stores were as many tiny
transfers, each paying its own staging pass and launches. :meth:`TransferEngine.batched`
holds the engine thread back while the connector submits a step's transfers, so that they
queue together; :meth:`TransferEngine.wait` releases what is held first.

Copies come as ``(src, dst)`` pairs, indexed copies (a gather or scatter of rows), runs of
whole blocks between CPU caches and host memory (worker/block_runs.py) or staged parts
(worker/staging.py: consecutive staged parts of a transfer are gathered into, or scattered
from, the direction's staging buffer together, with one copy per host extent).
The value types (``Transfer``, ``KeyCopies``, the copies) are in worker/transfer_types.py,
re-exported here. Implementations: ``CpuTransferEngine`` in worker/transfer_cpu.py (one
single-thread executor per direction; numpy, ``torch`` ``copy_``, ``index_select`` and
``index_copy_``), and
``CudaTransferEngine`` in worker/transfer_cuda.py (dedicated streams, start/end events chained
across transfers); ``make_engine`` in worker/transfer_factory.py picks one by device. Thread
safety: ``submit``/``poll``/``wait``/``close`` are called from one thread (the worker's); the
engine's own threads run the transfer bodies, in order, except that a ``wait`` about to block
runs the copy-only transfers queued at its direction's head itself when that direction's
thread is not running any (:meth:`TransferEngine._help`: no two thread wake-ups per wait);
one runner per direction at a time, and ``prepare``/``finish`` hooks (daemon I/O) always run
on the engine's threads.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from worker.block_runs import BlockRun, run_block_runs
from worker.staging import (
    HOST_KERNEL_MAX_PIECE,
    STAGING_BYTES,
    StagedPart,
    StagingBuffer,
    run_staged,
)
from worker.transfer_types import (
    Copy,
    Direction,
    EngineStats,
    IndexedCopy,
    KeyCopies,
    Transfer,
    copy_bytes,
)

__all__ = [
    "MAX_GROUP", "Copy", "Direction", "EngineStats", "IndexedCopy", "KeyCopies", "Transfer",
    "TransferEngine", "copy_bytes",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: Most transfers run as one group (the rest form the next group).
MAX_GROUP = 256


class TransferEngine(ABC):
    """Ordered per-direction transfers; see the module docstring for the guarantees."""

    def __init__(
        self,
        *,
        staging_bytes: int = STAGING_BYTES,
        host_kernels: bool = False,
        host_kernel_max_piece: int = HOST_KERNEL_MAX_PIECE,
        max_group: int = MAX_GROUP,
    ) -> None:
        """``host_kernels``: staged batches move their host side with one indexed kernel
        (worker/staging.py ``_host_kernel``) where :meth:`_host_view` can show the host memory
        to the device and the batch's extent pieces average at most ``host_kernel_max_piece``
        bytes, instead of one copy per extent piece. ``max_group``: most transfers run as one
        group (1: every transfer alone, as before grouping)."""
        if max_group < 1:
            raise ValueError("max_group must be at least 1")
        self.max_group = max_group
        self.stats = EngineStats()
        self.host_kernels = host_kernels
        self.host_kernel_max_piece = host_kernel_max_piece
        #: one staging buffer per direction (used by that direction's runner only).
        self._staging = {d: StagingBuffer(staging_bytes) for d in Direction}
        self._executors = {
            d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-{d.value}")
            for d in Direction
        }
        self._inflight: dict[Direction, deque[Transfer]] = {d: deque() for d in Direction}
        #: submitted, not yet taken by the direction's thread (with their submit context).
        self._queued: dict[Direction, deque[tuple[Transfer, Any]]] = {d: deque() for d in Direction}
        #: inside :meth:`batched`: submit queues without waking the engine threads.
        self._holding = False
        #: per direction: a :meth:`_drain` is queued or running and will take what is queued
        #: (one executor task per burst of submits, not one per transfer). Under ``_wake``.
        self._draining = {d: False for d in Direction}
        #: per direction: held while transfers of it run (by its thread, or by a waiter that
        #: runs what is queued itself, :meth:`_help`): one runner at a time, in order.
        self._running = {d: threading.Lock() for d in Direction}
        self._wake = threading.Lock()
        #: per direction: notified when transfers of it are marked done (one notification
        #: per group, not a future per transfer).
        self._finished = {d: threading.Condition(threading.Lock()) for d in Direction}
        self._closed = False

    # ------------------------------------------------------------------ public API

    def submit(self, transfer: Transfer) -> None:
        """Queue ``transfer`` behind every earlier one of its direction. Never blocks on I/O."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        ctx = self._on_submit(transfer)
        transfer.done = False
        self._inflight[transfer.direction].append(transfer)
        self._queued[transfer.direction].append((transfer, ctx))
        if not self._holding:
            self._wake_drain(transfer.direction)

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Transfers submitted inside are held until the block ends (or a :meth:`wait`), then
        handed to the engine threads together, so that those without ``prepare``/``finish``
        run as one group per direction (see the module docstring). Reentrant."""
        if self._holding:
            yield
            return
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            self._release()

    def _release(self) -> None:
        """Wake the engine thread of each direction with queued transfers."""
        for d, queue in self._queued.items():
            if queue:
                self._wake_drain(d)

    def _wake_drain(self, direction: Direction) -> None:
        """Have a :meth:`_drain` of ``direction`` run, unless one is queued or running (it
        takes what is queued before it returns)."""
        with self._wake:
            if self._draining[direction]:
                return
            self._draining[direction] = True
        self._executors[direction].submit(self._drain, direction)

    def poll(self) -> list[Transfer]:
        """Transfers finished since the last call (non-blocking), in order per direction."""
        done: list[Transfer] = []
        for queue in self._inflight.values():
            while queue and self._is_done(queue[0]):
                transfer = queue.popleft()
                _stamp_landed(transfer)
                done.append(self._collect(transfer))
        return done

    def wait(self, transfers: Iterable[Transfer]) -> None:
        """Block until every one of ``transfers`` has finished (they stay pollable). The last
        given is waited for first: one direction's transfers finish in order, so for a list in
        submission order the thread wakes up once per direction, not once per transfer."""
        if self._holding:
            self._release()  # what is held may be among them
        for t in reversed(list(transfers)):
            if t.done is None:  # never submitted
                continue
            if not t.done:
                self._help(t.direction)
            if not t.done:
                finished = self._finished[t.direction]
                with finished:
                    while not t.done:
                        finished.wait()
            self._sync(t)
            _stamp_landed(t)

    def _help(self, direction: Direction) -> None:
        """Worker's thread, about to block in :meth:`wait`: if no transfer of ``direction`` is
        running, run the copy-only transfers queued at its head here (one group) instead of
        sleeping until the direction's thread has woken, run them and woken this one: two
        thread wake-ups per wait, which a busy machine makes cost milliseconds. Transfers with
        ``prepare``/``finish`` (daemon I/O) stay for the direction's thread; the order holds
        (one runner at a time, ``_running``; each takes from the head of the queue)."""
        running = self._running[direction]
        if not running.acquire(blocking=False):
            return  # the direction's thread is running a group: it goes on with the rest
        try:
            queue = self._queued[direction]
            with self._wake:
                items: list[tuple[Transfer, Any]] = []
                while queue and len(items) < self.max_group:
                    t = queue[0][0]
                    if t.prepare is not None or t.finish is not None:
                        break
                    items.append(queue.popleft())
            self._run_group(items)
        finally:
            running.release()

    @property
    def num_inflight(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    def close(self) -> None:
        """Finish queued work and stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release()
        for ex in self._executors.values():
            ex.shutdown(wait=True)
        for queue in self._inflight.values():
            self.wait(queue)
        for buf in self._staging.values():
            buf.release()

    # ------------------------------------------------------------------ the transfer body

    def _drain(self, direction: Direction) -> None:
        """Engine thread: run what is queued in ``direction``, in order: maximal runs of
        transfers without ``prepare``/``finish`` as groups (at most ``max_group``), the
        others one by one. Every transfer is marked done, whatever happens."""
        queue = self._queued[direction]
        try:
            while True:
                with self._running[direction]:
                    with self._wake:
                        if not queue:
                            self._draining[direction] = False
                            return
                        items = [queue.popleft() for _ in range(min(len(queue), self.max_group))]
                    run: list[tuple[Transfer, Any]] = []
                    for item in items:
                        if item[0].prepare is None and item[0].finish is None:
                            run.append(item)
                            continue
                        self._run_group(run)
                        run = []
                        self._run_group([item])
                    self._run_group(run)
        except BaseException:  # a bug: let the next submit start a drain again
            with self._wake:
                self._draining[direction] = False
            raise

    def _run_group(self, items: list[tuple[Transfer, Any]]) -> None:
        """The direction's runner (its thread, or a waiter: :meth:`_help`): prepare → copies
        (per key) → land → finish, for one transfer or a group of transfers without
        prepare/finish (their copies in one batch). Never raises;
        marks every transfer done (once its results are written) and wakes the waiters."""
        if not items:
            return
        start = time.perf_counter()
        transfers = [t for t, _ in items]
        if len(items) > 1:
            d = transfers[0].direction.value
            self.stats.groups[d] += 1
            self.stats.grouped_transfers[d] += len(items)
        try:
            copies = [t.prepare() if t.prepare is not None else t.copies for t in transfers]
            with self._copy_context(transfers, [ctx for _, ctx in items]):
                todo = [kc for cs in copies for kc in cs if kc.error is None]
                failed = self._copy_keys(transfers[0], todo)
            for t, cs in zip(transfers, copies, strict=True):
                self._account(t, cs, failed, start)
        except Exception as exc:  # prepare/finish (daemon I/O) failed: every key
            for t in transfers:
                logger.warning("transfer %s failed: %s", t.tag, exc)
                t.failed_keys = list(t.keys)
                t.seconds = time.perf_counter() - start
        finished = self._finished[transfers[0].direction]
        with finished:
            for t in transfers:
                t.done = True
            finished.notify_all()

    def _account(
        self, transfer: Transfer, copies: list[KeyCopies], failed: set[int], start: float
    ) -> None:
        """The results of one transfer whose copies ran (``failed``: ``id()`` of the keys
        whose copies failed); runs its ``finish`` once the copies have landed."""
        done = [kc for kc in copies if kc.error is None and id(kc) not in failed]
        ok = [kc.key for kc in done]
        nbytes = sum([kc.nbytes for kc in done])
        if len(done) == len(copies) and ok == transfer.keys:  # every key copied, in order
            keys_failed: list[bytes] = []
        else:
            keys_failed = [kc.key for kc in copies if kc.error is not None or id(kc) in failed]
            seen = {*ok, *keys_failed}
            keys_failed += [k for k in transfer.keys if k not in seen]
        if transfer.finish is not None:
            self._sync(transfer)
            transfer.finish(ok)
        transfer.nbytes = nbytes
        transfer.failed_keys = keys_failed
        transfer.seconds = time.perf_counter() - start

    def _copy_keys(self, transfer: Transfer, keys: list[KeyCopies]) -> set[int]:
        """Engine thread: run the copies of ``keys``, all in one batch; if that raises, key by
        key so that a bad copy fails its key only. Returns ``id()`` of the keys that failed.
        ``transfer``: the (first) transfer they belong to, for the direction and the log."""
        try:
            self._copy_all(transfer.direction, [c for kc in keys for c in kc.pairs])
            return set()
        except Exception:
            pass
        failed: set[int] = set()
        for kc in keys:
            try:
                self._copy_all(transfer.direction, kc.pairs)
            except Exception as exc:  # a bad view: this key only
                logger.warning("copy of one key failed (%s): %s", transfer.tag, exc)
                failed.add(id(kc))
        return failed

    def _copy_all(self, direction: Direction, copies: list[Copy]) -> None:
        """Engine thread: ``copies`` in order; runs of staged parts go through the direction's
        staging buffer together (:func:`~worker.staging.run_staged`), the rest to
        :meth:`_copy_batch`."""
        kinds = set(map(type, copies))
        if StagedPart not in kinds or len(kinds) == 1:  # one run (one pass in C to tell)
            if copies:
                self._copy_run(direction, copies)
            return
        run: list[Copy] = []
        staged = False  # whether ``run`` holds staged parts
        for c in copies:
            is_staged = type(c) is StagedPart
            if run and is_staged != staged:
                self._copy_run(direction, run)
                run = []
            staged = is_staged
            run.append(c)
        if run:
            self._copy_run(direction, run)

    def _copy_run(self, direction: Direction, run: list[Copy]) -> None:
        if type(run[0]) is StagedPart:
            parts = [c for c in run if isinstance(c, StagedPart)]
            view = self._host_view if self.host_kernels else None
            run_staged(parts, self._staging[direction], self._copy_batch, view,
                       self.host_kernel_max_piece)  # fmt: skip
        else:
            self._copy_batch(run)

    def _collect(self, transfer: Transfer) -> Transfer:
        d = transfer.direction.value
        self.stats.transfers[d] += 1
        self.stats.bytes[d] += transfer.nbytes
        self.stats.failed_keys[d] += len(transfer.failed_keys)
        transfer.keepalive.clear()
        return transfer

    def _is_done(self, transfer: Transfer) -> bool:
        return bool(transfer.done) and self._landed(transfer)

    # ------------------------------------------------------------------ engine hooks

    def _on_submit(self, transfer: Transfer) -> Any:
        """Submitting thread, at submit time (CUDA: capture the compute stream)."""
        return None

    def _host_view(self, host: torch.Tensor) -> torch.Tensor | None:
        """Engine thread: ``host`` as a tensor the KV device's kernels can address, or None.
        Default: the host tensor itself (the CPU engine's kernels address host memory)."""
        return host

    @abstractmethod
    def _copy_context(self, transfers: list[Transfer], ctxs: list[Any]) -> Any:
        """Engine thread: a context manager around the copies of one transfer or a group
        (``ctxs``: what :meth:`_on_submit` returned for each, in order)."""

    @abstractmethod
    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Engine thread: one copy (may be asynchronous until :meth:`_landed`)."""

    def _copy_batch(self, copies: list[Copy]) -> None:
        """Engine thread: ``copies`` (no staged parts) in order. Default: one call each (block
        runs: host memory only, copied by numpy)."""
        for c in copies:
            if isinstance(c, IndexedCopy):
                self._copy_indexed(c)
            elif isinstance(c, tuple):
                self._copy(c[0], c[1])
            elif isinstance(c, BlockRun):
                run_block_runs([c])
            else:
                raise TypeError("staged parts go through _copy_all")

    def _copy_indexed(self, copy: IndexedCopy) -> None:
        """Engine thread: one indexed copy. Default: one :meth:`_copy` per row (any engine,
        any devices); an engine with a native gather/scatter overrides it."""
        rows = copy.index.tolist()
        for k, i in enumerate(rows):
            if copy.scatter:
                self._copy(copy.src[k], copy.dst[i])
            else:
                self._copy(copy.src[i], copy.dst[k])

    def _landed(self, transfer: Transfer) -> bool:
        """Non-blocking: have the copies of a transfer whose body returned completed?"""
        return True

    def _sync(self, transfer: Transfer) -> None:
        """Block until the copies of a transfer whose body returned completed."""
        return None


def _stamp_landed(transfer: Transfer) -> None:
    """Submitting thread: record when ``transfer``'s copies were first seen landed."""
    if transfer.landed_at is None:
        transfer.landed_at = time.monotonic()
