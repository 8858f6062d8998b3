"""Staged copies: gather on the KV caches' device, then few large copies to host memory.

Runs in the worker process, on the transfer engine's threads (:func:`run_staged`); the
:class:`StagedPart` descriptions are built by worker/layout.py on the worker's thread. The
default plan for CUDA caches (docs/worker.md, "Copies"): copying a FlashAttention chunk page by
page costs one ``cudaMemcpyAsync`` (and a few µs of Python and launch) per page, so instead

- STORE: per registered tensor (a :class:`ViewGroup`: a layer's K and V pages together), one
  ``index_select`` over the block dimension writes the blocks of many chunks into a device
  *staging buffer* laid out exactly as the parts' bytes (sub-block after sub-block, each the
  groups' pages in order); then one ``copy_(non_blocking=True)`` (a D2H DMA) per arena extent
  piece, merged where both sides continue;
- LOAD: one H2D copy per extent piece into the staging buffer, then per tensor one
  ``index_copy_`` scatters the sub-blocks into their blocks.

With a ``host_view`` (the engine's ``host_kernels``), a batch's extent pieces in one
page-locked host tensor move as one indexed kernel over rows of that memory seen from the
device, instead of one copy each (:func:`_host_kernel`; docs/worker.md, "Copies"), where the
pieces are small: a kernel over the bus reaches ~0.77 of the DMA peak at any piece size, while
one DMA per piece costs a few µs each and wins only for large pieces (``max_piece``).

The block-id index is built once per call (one small H2D copy from pinned memory on CUDA) and
sliced per batch. A batch is a run of sub-blocks (of one or more parts, split anywhere at
sub-block boundaries) that fits the staging buffer; a load batch never names a block twice
(a scatter with repeated indices has no defined winner), so a repeated id starts a new batch
and the later sub-block still wins. Parts whose sub-block alone exceeds the buffer, or when no
buffer can be had, run their per-piece fallback copies instead.

Everything here is plain torch, so the same code runs on CPU tensors (the tests force it).
Ordering: every operation is issued on the caller's current stream; the engine runs one
transfer per direction at a time on the GPU (event chain, worker/transfer_cuda.py), so one
:class:`StagingBuffer` per direction is reused without further synchronisation.
Not thread-safe: a buffer belongs to one direction's thread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: (offset in the host tensor, byte offset in the part, length): one extent piece of a part.
Piece = tuple[int, int, int]
#: Default staging buffer per direction (device memory, allocated at first use).
STAGING_BYTES = 64 << 20
#: Largest mean extent piece (bytes) whose batch still moves by kernel: larger pieces go as one
#: DMA each (an H200 ran 2 MiB pieces at 0.81 of a pinned memcpy by DMA, kernels ~0.77).
HOST_KERNEL_MAX_PIECE = 1 << 20


@dataclass(frozen=True, slots=True)
class ViewGroup:
    """The views cut from one registered tensor, as one strided byte tensor.

    ``rows[b, k]`` is the page of view ``first + k`` in block ``b``; shape ``(num_blocks,
    count, page)``. Its pages lie back to back in a block's bytes from ``offset`` on.
    """

    rows: torch.Tensor
    first: int
    offset: int
    count: int
    page: int


@dataclass(frozen=True, slots=True, eq=False)
class StagedPart:
    """One checked part to move through a staging buffer (see the module docstring).

    ``groups``: the caches' view groups (the same tuple object for every part of one set of
    caches); ``block_bytes``: their total page bytes. ``block_ids[j]`` is sub-block ``first +
    j`` of the part; ``pieces`` map the part bytes ``[first * block_bytes, (first +
    len(block_ids)) * block_bytes)`` to offsets of ``host`` (a flat uint8 tensor), in order.
    ``fallback()`` gives the same bytes as per-piece ``(src, dst)`` copies.
    """

    groups: tuple[ViewGroup, ...]
    block_bytes: int
    block_ids: tuple[int, ...]
    first: int
    host: torch.Tensor
    pieces: tuple[Piece, ...]
    is_load: bool
    fallback: Callable[[], list[Any]]

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self.block_bytes


class StagingBuffer:
    """One lazily allocated byte buffer of ``capacity`` bytes on the device it is first asked
    for; if that allocation fails (out of device memory) it is not retried and staged copies
    fall back to their per-piece copies. Freed by :meth:`release` (after the GPU is done)."""

    def __init__(self, capacity: int = STAGING_BYTES) -> None:
        if capacity < 1:
            raise ValueError("staging capacity must be positive")
        self.capacity = capacity
        #: batches whose host side ran as one indexed kernel (:func:`_host_kernel`).
        self.kernel_batches = 0
        self._buf: torch.Tensor | None = None
        self._failed = False

    def get(self, device: torch.device) -> torch.Tensor | None:
        """The buffer (uint8, ``capacity`` bytes) on ``device``, or None when unavailable."""
        buf = self._buf
        if buf is not None and buf.device == device:
            return buf
        if self._failed or buf is not None:  # a second device: not this buffer's job
            return None
        try:
            self._buf = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            logger.warning("no staging buffer (%s): copying page by page", exc)
            self._failed = True
        return self._buf

    def release(self) -> None:
        self._buf = None


#: Element types an indexed copy may view bytes as, widest first (its loop is per element).
_WIDE = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def widest(a: torch.Tensor, b: torch.Tensor, most: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (uint8, last dimension contiguous) viewed as the widest element type,
    of at most ``most`` bytes, both allow (aligned addresses, strides and row length), else as
    they are."""
    for width, dtype in _WIDE:
        if width <= most and all(
            t.data_ptr() % width == 0 and t.shape[-1] % width == 0
            and all(s % width == 0 for s in t.stride()[:-1])
            for t in (a, b)
        ):  # fmt: skip
            return a.view(dtype), b.view(dtype)
    return a, b


#: One batch: (part, first row, end row) runs; rows index the part's ``block_ids``.
_Batch = list[tuple[StagedPart, int, int]]


#: Maps a host tensor to a tensor over the same bytes that kernels on the KV caches' device
#: can address (page-locked memory seen through unified addressing), or None when they cannot.
HostView = Callable[[torch.Tensor], "torch.Tensor | None"]


def run_staged(
    parts: Sequence[StagedPart],
    staging: StagingBuffer,
    plain: Callable[[list[Any]], None],
    host_view: HostView | None = None,
    max_piece: int = HOST_KERNEL_MAX_PIECE,
) -> None:
    """Move ``parts`` (in order) through ``staging`` on the current stream; parts that cannot
    be staged go to ``plain`` (their fallback copies) in their place in the order. With
    ``host_view``, a batch whose extent pieces lie in one host tensor that ``host_view`` can
    show to the device, and average at most ``max_piece`` bytes, moves them with one indexed
    kernel instead of one copy per piece (:func:`_host_kernel`)."""
    if not parts:
        return
    device = parts[0].groups[0].rows.device
    buf = staging.get(device)
    if buf is None:
        plain([c for p in parts for c in p.fallback()])
        return
    ids = [b for p in parts for b in p.block_ids]
    index = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cpu":  # pinned, so that the H2D copy is asynchronous
        index = index.pin_memory().to(device, non_blocking=True)
    for batch, at in _batches(parts, buf.numel()):
        if isinstance(batch, StagedPart):
            plain(batch.fallback())
            continue
        rows = sum(hi - lo for _, lo, hi in batch)
        _run_batch(batch, buf, index[at : at + rows], host_view, staging, max_piece)


def _batches(parts: Sequence[StagedPart], capacity: int) -> list[tuple[_Batch | StagedPart, int]]:
    """Cut ``parts`` into runs of sub-blocks that fit ``capacity`` bytes, of one set of
    caches, with no block id twice in a load batch; a part that cannot be staged alone. Each
    with the position of its first sub-block in all the parts' block ids."""
    out: list[tuple[_Batch | StagedPart, int]] = []
    batch: _Batch = []
    used = start = row = 0  # row: position of the current part's first id
    seen: set[int] = set()

    def flush() -> None:
        nonlocal batch, used
        if batch:
            out.append((batch, start))
        batch, used = [], 0
        seen.clear()

    for p in parts:
        bb, n = p.block_bytes, len(p.block_ids)
        if batch and batch[0][0].groups is not p.groups:
            flush()
        if bb > capacity:
            flush()
            out.append((p, row))
            row += n
            continue
        lo = 0
        while lo < n:
            room = (capacity - used) // bb
            hi = min(n, lo + room)
            if p.is_load:
                for j in range(lo, hi):
                    if p.block_ids[j] in seen:
                        hi = j
                        break
                    seen.add(p.block_ids[j])
            if hi == lo:
                flush()
                continue
            if not batch:
                start = row + lo
            batch.append((p, lo, hi))
            used += (hi - lo) * bb
            lo = hi
        row += n
    flush()
    return out


def _run_batch(
    batch: _Batch,
    buf: torch.Tensor,
    index: torch.Tensor,
    host_view: HostView | None = None,
    staging: StagingBuffer | None = None,
    max_piece: int = HOST_KERNEL_MAX_PIECE,
) -> None:
    """One batch: gather + D2H per extent piece (store), or H2D + scatter (load); with a
    device view of the host, the per-piece copies become one indexed kernel."""
    first = batch[0][0]
    bb, is_load = first.block_bytes, first.is_load
    n = int(index.numel())
    spans = _spans(batch, bb)
    base = buf.storage_offset()
    most = 16 if buf.is_cpu else 8  # on the GPU: 8-byte elements, the mainstream kernels
    kernel = _host_kernel(spans, buf, n * bb, host_view, most, is_load, max_piece)
    if staging is not None:
        staging.kernel_batches += kernel is not None
    if is_load:
        if kernel is not None:
            kernel()
        else:
            for host, h, s, length in spans:
                buf[s : s + length].copy_(host[h : h + length], non_blocking=True)
    for g in first.groups:
        stage = buf.as_strided((n, g.count, g.page), (bb, g.page, 1), base + g.offset)
        if is_load:
            src, dst = widest(stage, g.rows, most)
            dst.index_copy_(0, index, src)
        else:
            src, dst = widest(g.rows, stage, most)
            torch.index_select(src, 0, index, out=dst)
    if not is_load:
        if kernel is not None:
            kernel()
        else:
            for host, h, s, length in spans:
                host[h : h + length].copy_(buf[s : s + length], non_blocking=True)


def _host_kernel(
    spans: list[tuple[torch.Tensor, int, int, int]],
    buf: torch.Tensor,
    total: int,
    host_view: HostView | None,
    most: int,
    is_load: bool,
    max_piece: int = HOST_KERNEL_MAX_PIECE,
) -> Callable[[], None] | None:
    """The batch's host side as one indexed kernel, or None (one copy per piece instead).

    Possible when there is more than one piece, all in one host tensor that ``host_view`` shows
    to the device, the pieces average at most ``max_piece`` bytes, and the pieces fill the
    staging bytes ``[0, total)`` in order (they do: :func:`_spans`). Both sides are cut into
    rows of ``R`` bytes, the largest size that divides every piece's host offset, staging offset
    and length; row ``i`` of the staging bytes is row ``dst[i]`` of the host. A store scatters
    the staging rows into the host rows (``index_copy_``), a load gathers the host rows into the
    staging rows (``index_select``). On CUDA this reads and writes the page-locked host memory
    from the kernel over the bus (zero copy), so a batch costs one launch whatever the number of
    pieces."""
    if host_view is None or len(spans) < 2 or total > max_piece * len(spans):
        return None
    host = spans[0][0]
    if any(sp[0] is not host for sp in spans):
        return None
    view = host_view(host)
    if view is None:
        return None
    r = total
    for _, h, s, length in spans:
        r = math.gcd(r, h, s, length)
    # the pieces fill the staging rows in order: staging row i is host row dst[i]
    rows = [row for _, h, _, length in spans for row in range(h // r, (h + length) // r)]
    dst = torch.tensor(rows, dtype=torch.int64)
    if buf.device.type != "cpu":
        dst = dst.pin_memory().to(buf.device, non_blocking=True)
    usable = (view.numel() // r) * r
    host_rows, stage_rows = widest(view[:usable].view(-1, r), buf[:total].view(-1, r), most)

    def gather() -> None:
        torch.index_select(host_rows, 0, dst, out=stage_rows)

    def scatter() -> None:
        host_rows.index_copy_(0, dst, stage_rows)

    return gather if is_load else scatter


def _spans(batch: _Batch, bb: int) -> list[tuple[torch.Tensor, int, int, int]]:
    """(host tensor, host offset, staging offset, length) per extent piece of the batch's
    rows, merged where both the host and the staging bytes continue."""
    spans: list[tuple[torch.Tensor, int, int, int]] = []
    pos = 0  # staging offset of the current run's first row
    for p, lo, hi in batch:
        start, end = (p.first + lo) * bb, (p.first + hi) * bb  # part bytes of the run
        for at, part_off, length in p.pieces:
            a, b = max(part_off, start), min(part_off + length, end)
            if a >= b:
                continue
            h, s = at + a - part_off, pos + a - start
            if spans:
                ph, pho, ps, pl = spans[-1]
                if ph is p.host and pho + pl == h and ps + pl == s:
                    spans[-1] = (ph, pho, ps, pl + b - a)
                    continue
            spans.append((p.host, h, s, b - a))
        pos += end - start
    return spans
