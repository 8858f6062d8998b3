"""The CUDA transfer engine and pinned host memory.

Runs in the worker process; importable without CUDA (nothing touches the driver until an
engine is built). Each direction has a small pool of dedicated streams; every transfer takes
the next stream, waits for

- the compute stream as it was when the transfer was submitted (``wait_event`` on an event
  recorded there by :meth:`submit`): a store must read KV the model has written; a load must
  not overwrite blocks the previous step's kernels may still read (blocks freed by a finished
  request are handed out again at once);
- the previous transfer of its direction (``wait_event`` on its end event): transfers of one
  direction never overlap, so they finish in submission order;

then records a start event, issues the transfer's work and records an end event; :meth:`poll`
queries end events without blocking. The work, for CUDA caches as worker/layout.py plans them:
staged parts (worker/staging.py): per batch of sub-blocks, the block-id index (one H2D copy),
one ``index_select`` per registered tensor into the direction's device staging buffer and one
``copy_(non_blocking=True)`` (cudaMemcpyAsync) per arena extent, or for a load the reverse
(H2D per extent, one ``index_copy_`` per tensor) — with ``host_kernels``, the per-extent
copies of a batch become one ``index_copy_`` / ``index_select`` addressing the page-locked
host memory itself (:meth:`CudaTransferEngine._host_view`, :func:`device_view`); plain
``(src, dst)`` pairs (a staged part's per-page fallback, or copies built by hand) as one
``copy_(non_blocking=True)`` each; an indexed copy row by row. The staging buffer of a
direction is reused without further synchronisation because its transfers run one after the
other on the GPU (the event chain).
Copies are launched from the direction's thread (so a remote transfer's daemon I/O never runs
on the worker's thread); the GPU-side order comes from the events alone.

:class:`HostRegistration` page-locks an existing host mapping (the daemon's arena) with
``cudaHostRegister`` so the copies DMA straight into kvserver's shared memory; it is undone on
close. Thread safety: as :mod:`worker.transfer`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from worker.staging import HOST_KERNEL_MAX_PIECE, STAGING_BYTES
from worker.transfer import MAX_GROUP, Direction, Transfer, TransferEngine

logger = logging.getLogger(__name__)
#: torch.cuda with its untyped constructors (Stream, Event, cudart) seen as Any by mypy.
_cuda: Any = torch.cuda

STREAMS_PER_DIRECTION = 4
#: cudaHostRegisterPortable | cudaHostRegisterMapped: the pinning is visible to every CUDA
#: context, and kernels may address the memory (unified addressing: at the same address).
CUDA_HOST_REGISTER_FLAGS = 1 | 2


class _DevicePointer:
    """Raw page-locked host memory as ``__cuda_array_interface__`` (version 3): bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }  # fmt: skip


def device_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor over ``nbytes`` of page-locked host memory at ``ptr`` (no copy;
    valid while the memory stays mapped and page-locked)."""
    return torch.as_tensor(_DevicePointer(ptr, nbytes), device=device)


class CudaTransferEngine(TransferEngine):
    """Per-direction stream pools with chained start/end events; see the module docstring."""

    def __init__(
        self,
        device: torch.device,
        *,
        streams_per_direction: int = STREAMS_PER_DIRECTION,
        staging_bytes: int = STAGING_BYTES,
        host_kernels: bool = False,
        host_kernel_max_piece: int = HOST_KERNEL_MAX_PIECE,
        max_group: int = MAX_GROUP,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransferEngine needs CUDA")
        self.device = device
        with torch.cuda.device(device):
            self._streams = {
                d: [_cuda.Stream(device) for _ in range(streams_per_direction)] for d in Direction
            }
        self._next = dict.fromkeys(Direction, 0)
        #: end event of the last transfer launched per direction (its runner only: the
        #: direction's thread, or a waiter running queued copies, one at a time).
        self._last_end: dict[Direction, torch.cuda.Event | None] = dict.fromkeys(Direction)
        #: host_view has logged that it cannot make device views (once).
        self._no_views = False
        #: device views made by host_view, by (address, bytes): one per mapping, not per batch
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        super().__init__(
            staging_bytes=staging_bytes,
            host_kernels=host_kernels,
            host_kernel_max_piece=host_kernel_max_piece,
            max_group=max_group,
        )

    def _on_submit(self, transfer: Transfer) -> Any:
        ready = _cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        i = self._next[transfer.direction]
        self._next[transfer.direction] = i + 1
        pool = self._streams[transfer.direction]
        return ready, pool[i % len(pool)]

    @contextmanager
    def _copy_context(self, transfers: list[Transfer], ctxs: list[Any]) -> Iterator[None]:
        """A group runs on its first transfer's stream, after every member's ready event and
        the direction's previous end event; one start/end pair times and completes them all."""
        stream = ctxs[0][1]
        direction = transfers[0].direction
        start, end = _cuda.Event(enable_timing=True), _cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for ready, _ in ctxs:
                stream.wait_event(ready)
            prev = self._last_end[direction]
            if prev is not None:
                stream.wait_event(prev)
            start.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self._last_end[direction] = end
                for t in transfers:
                    t.state = (start, end)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def _host_view(self, host: torch.Tensor) -> torch.Tensor | None:
        """A page-locked host tensor (``pin_memory()``, or a :class:`HostRegistration`'s
        mapping such as the arena) as a CUDA tensor over the same bytes; None otherwise."""
        if self._no_views or host.device.type != "cpu" or not host.is_pinned():
            return None
        key = (host.data_ptr(), host.numel())
        view = self._views.get(key)
        if view is not None:
            return view
        if len(self._views) >= 64:  # mappings come and go: keep the recent ones only
            self._views.clear()
        try:
            view = self._views[key] = device_view(key[0], key[1], self.device)
            return view
        except Exception as exc:  # any failure: one copy per piece instead
            logger.warning("no device view of host memory (%s): copying per extent", exc)
            self._no_views = True
            return None

    def _landed(self, transfer: Transfer) -> bool:
        return transfer.state is None or bool(transfer.state[1].query())

    def _sync(self, transfer: Transfer) -> None:
        if transfer.state is not None:
            transfer.state[1].synchronize()

    def _collect(self, transfer: Transfer) -> Transfer:
        if transfer.state is not None:
            start, end = transfer.state
            transfer.seconds = start.elapsed_time(end) / 1000.0
            transfer.state = None
        return super()._collect(transfer)


def buffer_address(buf: memoryview) -> int:
    """The address of a writable buffer (e.g. an mmap's memoryview), via ctypes."""
    holder = (ctypes.c_char * buf.nbytes).from_buffer(buf)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # releases the buffer export


class HostRegistration:
    """``cudaHostRegister`` of ``[address, address + size)`` for the lifetime of this object
    (undone by :meth:`close`, idempotent). Copies to and from the range then run as DMA."""

    def __init__(self, address: int, size: int) -> None:
        self.address, self.size = address, size
        cudart = _cuda.cudart()
        err = cudart.cudaHostRegister(address, size, CUDA_HOST_REGISTER_FLAGS)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        self._registered = True

    @classmethod
    def of(cls, buf: memoryview) -> HostRegistration:
        return cls(buffer_address(buf), buf.nbytes)

    def close(self) -> None:
        if self._registered:
            self._registered = False
            cudart = _cuda.cudart()
            err = cudart.cudaHostUnregister(self.address)
            if int(err) != 0:
                logger.warning("cudaHostUnregister failed: %s", err)
