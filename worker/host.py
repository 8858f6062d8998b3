"""Host memory the worker copies KV to and from: the daemon's mapped arena, staging buffers.

Runs in the worker process. :class:`MappedArena` is the co-located path: the daemon's
shared-memory arena (kvserver/arena.py) mapped into this process and wrapped as one flat uint8
tensor, so transfers copy between KV blocks and arena extents with no intermediate buffer; with
CUDA the mapping is page-locked (``cudaHostRegister``) so those copies are DMA. Staging buffers
(:func:`staging_buffer`) serve the remote path (payload frames).

Thread safety: a :class:`MappedArena` is created and closed on the worker's thread; the
transfer threads only copy into disjoint extents of its tensor (plain memcpy / DMA).
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import torch

from kvserver.arena import ArenaView
from kvserver.errors import InvalidArgument

logger = logging.getLogger(__name__)


class MappedArena:
    """The daemon's arena mapped here, as ``tensor`` (uint8, ``size`` bytes) and ``array``
    (the same bytes as a numpy array, for the CPU's copies: worker/block_runs.py).

    ``pin=True`` registers the mapping with CUDA for the lifetime of this object.
    :attr:`is_stale` tells when the daemon has removed the file (it restarted): the caller
    must map the new arena before copying again.
    """

    def __init__(self, path: str, *, pin: bool = False) -> None:
        self.path = path
        self._view: ArenaView | None = ArenaView.attach(path)
        self._inode = os.stat(path).st_ino
        self.size = self._view.size
        self.tensor = torch.frombuffer(self._view.buf, dtype=torch.uint8)
        self.array: np.ndarray = self.tensor.numpy()
        self._pinned = None
        if pin:
            from worker.transfer_cuda import HostRegistration

            try:
                self._pinned = HostRegistration.of(self._view.buf)
            except BaseException:
                self.close()
                raise

    @property
    def is_stale(self) -> bool:
        """True once the arena file is gone or replaced (one ``stat`` call)."""
        try:
            return os.stat(self.path).st_ino != self._inode
        except OSError:
            return True

    def check_extents(self, extents: list[tuple[int, int]], nbytes: int) -> None:
        """REQUIRES (InvalidArgument otherwise): extents inside the arena, ``nbytes`` in all."""
        total = 0
        for off, length in extents:
            if off < 0 or length < 0 or off + length > self.size:
                raise InvalidArgument("extent outside the arena", offset=off, length=length)
            total += length
        if total != nbytes:
            raise InvalidArgument("extents do not hold one part", got=total, part_bytes=nbytes)

    def close(self) -> None:
        """Unregister and unmap. Idempotent; the copies using it must have finished."""
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        if self._view is not None:
            del self.tensor, self.array  # releases the buffer export so the mmap can close
            self.tensor = torch.empty(0, dtype=torch.uint8)
            self.array = self.tensor.numpy()
            self._view.close()
            self._view = None


def staging_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A host uint8 tensor of ``nbytes`` (page-locked when ``pinned``: async DMA)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor (valid while the tensor lives)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise InvalidArgument("need a contiguous host tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
