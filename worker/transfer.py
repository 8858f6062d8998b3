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

Copies come as ``(src, dst)`` pairs, indexed copies (a gather or scatter of rows) or staged
parts (worker/staging.py: consecutive staged parts of a transfer are gathered into, or
scattered from, the direction's staging buffer together, with one copy per host extent).
Implementations: :class:`CpuTransferEngine` here (one single-thread executor per direction,
copies with ``torch`` ``copy_``, ``index_select`` and ``index_copy_``), and
``CudaTransferEngine`` in worker/transfer_cuda.py (dedicated streams, start/end events chained
across transfers); ``make_engine`` in worker/transfer_factory.py picks one by device. Thread safety:
``submit``/``poll``/``wait``/``close`` are called from one thread (the worker's); the engine's
own threads only run the transfer bodies, in order.
"""

from __future__ import annotations

import enum
import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.staging import (
    HOST_KERNEL_MAX_PIECE,
    STAGING_BYTES,
    StagedPart,
    StagingBuffer,
    run_staged,
)

logger = logging.getLogger(__name__)


class Direction(enum.Enum):
    STORE = "store"  # KV blocks → host
    LOAD = "load"  # host → KV blocks


@dataclass(frozen=True, slots=True, eq=False)
class IndexedCopy:
    """Rows along dim 0 picked by ``index`` on one side: a gather ``dst[k] = src[index[k]]``
    or, with ``scatter``, ``dst[index[k]] = src[k]``. ``index`` (int64, on the CPU) has no
    duplicates when ``scatter``; the row shapes of ``src`` and ``dst`` match."""

    src: torch.Tensor
    dst: torch.Tensor
    index: torch.Tensor
    scatter: bool

    @property
    def nbytes(self) -> int:
        dense = self.src if self.scatter else self.dst
        return dense.numel() * dense.element_size()


#: One copy: a ``(src, dst)`` pair of equal shape (``dst.copy_(src)``), an indexed copy, or a
#: part to move through the engine's staging buffer (worker/staging.py).
Copy = tuple[torch.Tensor, torch.Tensor] | IndexedCopy | StagedPart


def copy_bytes(copy: Copy) -> int:
    if isinstance(copy, IndexedCopy | StagedPart):
        return copy.nbytes
    return copy[0].numel() * copy[0].element_size()


@dataclass(slots=True, eq=False)
class KeyCopies:
    """The copies of one chunk part, run in order. ``error`` set means planning failed
    already: nothing is copied and the key is reported failed. ``size``: the bytes the copies
    move, when the planner knows it (else summed from ``pairs``)."""

    key: bytes
    pairs: list[Copy] = field(default_factory=list)
    error: str | None = None
    size: int | None = None

    @property
    def nbytes(self) -> int:
        if self.size is not None:
            return self.size
        return sum(copy_bytes(c) for c in self.pairs)


@dataclass(slots=True, eq=False)
class Transfer:
    """One unit of ordered work, reported once.

    ``prepare`` (optional) runs first on the engine's thread and returns the copies (e.g. a
    remote load reads the parts from the daemon, then copies them out); otherwise ``copies``
    are used. ``finish`` (optional) runs on the engine's thread once the copies have landed,
    with the keys that copied fine (e.g. a remote store sends its staging buffer). An exception
    from either fails every key. ``keepalive`` holds buffers the copies use until done.
    """

    direction: Direction
    tag: Any
    keys: list[bytes]
    copies: list[KeyCopies] = field(default_factory=list)
    prepare: Callable[[], list[KeyCopies]] | None = None
    finish: Callable[[list[bytes]], None] | None = None
    keepalive: list[Any] = field(default_factory=list)
    # --- results (written by the engine thread, read after completion) ---
    failed_keys: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    future: Future[None] | None = None
    #: engine-specific completion state (CUDA: the end event).
    state: Any = None


@dataclass(slots=True)
class EngineStats:
    transfers: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    failed_keys: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})


class TransferEngine(ABC):
    """Ordered per-direction transfers; see the module docstring for the guarantees."""

    def __init__(
        self,
        *,
        staging_bytes: int = STAGING_BYTES,
        host_kernels: bool = False,
        host_kernel_max_piece: int = HOST_KERNEL_MAX_PIECE,
    ) -> None:
        """``host_kernels``: staged batches move their host side with one indexed kernel
        (worker/staging.py ``_host_kernel``) where :meth:`_host_view` can show the host memory
        to the device and the batch's extent pieces average at most ``host_kernel_max_piece``
        bytes, instead of one copy per extent piece."""
        self.stats = EngineStats()
        self.host_kernels = host_kernels
        self.host_kernel_max_piece = host_kernel_max_piece
        #: one staging buffer per direction (used by that direction's thread only).
        self._staging = {d: StagingBuffer(staging_bytes) for d in Direction}
        self._executors = {
            d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-{d.value}")
            for d in Direction
        }
        self._inflight: dict[Direction, deque[Transfer]] = {d: deque() for d in Direction}
        self._closed = False

    # ------------------------------------------------------------------ public API

    def submit(self, transfer: Transfer) -> None:
        """Queue ``transfer`` behind every earlier one of its direction. Never blocks on I/O."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        ctx = self._on_submit(transfer)
        transfer.future = self._executors[transfer.direction].submit(self._run, transfer, ctx)
        self._inflight[transfer.direction].append(transfer)

    def poll(self) -> list[Transfer]:
        """Transfers finished since the last call (non-blocking), in order per direction."""
        done: list[Transfer] = []
        for queue in self._inflight.values():
            while queue and self._is_done(queue[0]):
                done.append(self._collect(queue.popleft()))
        return done

    def wait(self, transfers: Iterable[Transfer]) -> None:
        """Block until every one of ``transfers`` has finished (they stay pollable). The last
        given is waited for first: one direction's transfers finish in order, so for a list in
        submission order the thread wakes up once per direction, not once per transfer."""
        for t in reversed(list(transfers)):
            if t.future is not None:
                t.future.result()
                self._sync(t)

    @property
    def num_inflight(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    def close(self) -> None:
        """Finish queued work and stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ex in self._executors.values():
            ex.shutdown(wait=True)
        for queue in self._inflight.values():
            self.wait(queue)
        for buf in self._staging.values():
            buf.release()

    # ------------------------------------------------------------------ the transfer body

    def _run(self, transfer: Transfer, ctx: Any) -> None:
        """Engine thread: prepare → copies (per key) → land → finish. Never raises."""
        start = time.perf_counter()
        keys_failed: list[bytes] = []
        try:
            copies = transfer.prepare() if transfer.prepare is not None else transfer.copies
            with self._copy_context(transfer, ctx):
                failed = self._copy_keys(transfer, [kc for kc in copies if kc.error is None])
            good = {id(kc) for kc in copies if kc.error is None and id(kc) not in failed}
            ok = [kc.key for kc in copies if id(kc) in good]
            keys_failed = [kc.key for kc in copies if id(kc) not in good]
            nbytes = sum(kc.nbytes for kc in copies if id(kc) in good)
            missing = set(transfer.keys) - set(ok) - set(keys_failed)
            keys_failed += [k for k in transfer.keys if k in missing]
            if transfer.finish is not None:
                self._sync(transfer)
                transfer.finish(ok)
            transfer.nbytes = nbytes
        except Exception as exc:  # prepare/finish (daemon I/O) failed: every key
            logger.warning("transfer %s failed: %s", transfer.tag, exc)
            keys_failed = list(transfer.keys)
        transfer.failed_keys = keys_failed
        transfer.seconds = time.perf_counter() - start

    def _copy_keys(self, transfer: Transfer, keys: list[KeyCopies]) -> set[int]:
        """Engine thread: run the copies of ``keys``, all in one batch; if that raises, key by
        key so that a bad copy fails its key only. Returns ``id()`` of the keys that failed."""
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
        run: list[Copy] = []
        for c in copies:
            if run and isinstance(c, StagedPart) != isinstance(run[0], StagedPart):
                self._copy_run(direction, run)
                run = []
            run.append(c)
        if run:
            self._copy_run(direction, run)

    def _copy_run(self, direction: Direction, run: list[Copy]) -> None:
        if isinstance(run[0], StagedPart):
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
        return transfer.future is not None and transfer.future.done() and self._landed(transfer)

    # ------------------------------------------------------------------ engine hooks

    def _on_submit(self, transfer: Transfer) -> Any:
        """Submitting thread, at submit time (CUDA: capture the compute stream)."""
        return None

    def _host_view(self, host: torch.Tensor) -> torch.Tensor | None:
        """Engine thread: ``host`` as a tensor the KV device's kernels can address, or None.
        Default: the host tensor itself (the CPU engine's kernels address host memory)."""
        return host

    @abstractmethod
    def _copy_context(self, transfer: Transfer, ctx: Any) -> Any:
        """Engine thread: a context manager around the copies of one transfer."""

    @abstractmethod
    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Engine thread: one copy (may be asynchronous until :meth:`_landed`)."""

    def _copy_batch(self, copies: list[Copy]) -> None:
        """Engine thread: ``copies`` (no staged parts) in order. Default: one call each."""
        for c in copies:
            if isinstance(c, IndexedCopy):
                self._copy_indexed(c)
            elif isinstance(c, tuple):
                self._copy(c[0], c[1])
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


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class CpuTransferEngine(TransferEngine):
    """The thread-pool stand-in: copies run synchronously on the direction's thread, so a
    transfer is finished when its future is. Same interface and ordering as the CUDA engine.
    Indexed copies run as one native gather (``index_select``) or scatter (``index_copy_``)."""

    def _copy_context(self, transfer: Transfer, ctx: Any) -> Any:
        return _NullContext()

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def _copy_batch(self, copies: list[Copy]) -> None:
        # Runs of plain copies go to one _foreach_copy_ call (the loop runs in C++, in order).
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        for c in copies:
            if isinstance(c, tuple):
                srcs.append(c[0])
                dsts.append(c[1])
                continue
            if dsts:
                torch._foreach_copy_(dsts, srcs)
                srcs, dsts = [], []
            if not isinstance(c, IndexedCopy):
                raise TypeError("staged parts go through _copy_all")
            self._copy_indexed(c)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _copy_indexed(self, copy: IndexedCopy) -> None:
        # One native call per gather/scatter: a memcpy per row, no Python per row.
        if copy.scatter:
            copy.dst.index_copy_(0, copy.index, copy.src)
        else:
            torch.index_select(copy.src, 0, copy.index, out=copy.dst)
