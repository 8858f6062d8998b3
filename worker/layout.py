"""Canonical KV-cache layout: any paged KV tensor as per-block byte rows.

Runs in the worker process, once at start-up (:func:`canonicalize`) and then per chunk
(:func:`plan_copies`, on the worker's thread). No locks: the result is immutable and may be
read from any thread.

Attention backends lay out their paged KV differently: FlashAttention keeps ``(2, num_blocks,
block_size, heads, head_dim)`` per layer, others put the block dimension first
(``(num_blocks, 2, block_size, heads, head_dim)``), some allocate one cross-layer tensor
``(num_blocks, layers * page)``, and a logical shape may be a permuted view of the physical
one (HND vs NHD). :func:`canonicalize` finds the *physical* block dimension of each tensor from
its strides and rebuilds every tensor as one or more contiguous ``(num_blocks, page_bytes)``
uint8 views (dimensions physically outside the block dimension, e.g. FlashAttention's K/V
``2``, are split off into separate views). Nothing is copied.

Byte layout of one block (and therefore of a stored part, block ``j`` of a part at bytes
``[j * block_bytes, (j + 1) * block_bytes)``, step_protocol/connector.py): the pages of the
canonical views in order, i.e. tensors in registration order (layers in order), and within one
tensor the physically outer sub-views in order (K before V). A per-layer FlashAttention cache
and a cross-layer ``(num_blocks, layers, 2, ...)`` cache of the same model therefore produce
the same bytes; a different *inner* physical order (HND vs NHD) produces different bytes, so
workers that share a namespace must share the backend's inner layout.

Copies (:func:`plan_copies`): Python pays about a microsecond per torch call, so the number of
calls per chunk is what matters for small pages. On the CPU, :func:`strided_copies` describes a
run of whole sub-blocks with consecutive ids as one :class:`~worker.block_runs.BlockRun`
(integers only; the engine thread merges runs that continue each other and copies each with
numpy, one copy per registered tensor, a :class:`ViewGroup`: all its views, e.g. K and V, and
all the blocks at once, as ``(blocks, views, page)`` views on both sides; one in all for a
cross-layer cache or evenly spaced layers), an ``index_select``/``index_copy_`` per tensor when
the block ids are not consecutive, and only sub-blocks cut by an extent boundary page piece by
page piece. For CUDA caches
:func:`staged_copies` only describes the part (a :class:`~worker.staging.StagedPart`): the
engine gathers the parts of a whole transfer on the device and copies them to the host in one
DMA per extent (worker/staging.py). :func:`contiguous_copies` (one contiguous piece per page,
merged where both sides continue) is the per-piece form, the staged path's fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch

from kvserver.errors import InvalidArgument
from worker.block_runs import BlockRun, KVArrays, host_array
from worker.staging import Piece, StagedPart, ViewGroup, widest
from worker.transfer import Copy, IndexedCopy, KeyCopies

#: (view index, byte offset in the view's flat bytes, byte offset in the part, length)
Segment = tuple[int, int, int, int]
#: How a part's copies are built (:func:`plan_copies`).
Builder = Literal["strided", "contiguous", "staged"]


@dataclass(frozen=True, slots=True)
class CanonicalKVCaches:
    """Block-major byte views of the registered KV caches.

    Invariants: every view is a contiguous ``(num_blocks, page_bytes[i])`` uint8 tensor on
    ``device``; ``block_bytes == sum(page_bytes)``; ``offsets[i]`` is where view ``i``'s page
    sits inside a block's bytes; ``groups`` partition the views in order, group ``g`` holding
    views ``g.first .. g.first + g.count - 1`` (all of page ``g.page``, from ``g.offset`` on).
    """

    views: tuple[torch.Tensor, ...]
    num_blocks: int
    page_bytes: tuple[int, ...]
    offsets: tuple[int, ...]
    #: registered name of the tensor each view comes from (for messages).
    names: tuple[str, ...]
    #: the views grouped by the tensor they come from, in order.
    groups: tuple[ViewGroup, ...] = ()
    #: the groups as numpy arrays (CPU caches only; worker/block_runs.py).
    arrays: KVArrays | None = None
    #: ``sum(page_bytes)``, kept: planning asks for it per chunk.
    block_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_bytes", sum(self.page_bytes))

    @property
    def device(self) -> torch.device:
        return self.views[0].device

    def flat(self, index: int) -> torch.Tensor:
        """View ``index`` as one flat uint8 tensor (``num_blocks * page_bytes`` bytes)."""
        return self.views[index].view(-1)

    def segments(self, block_ids: Sequence[int], first_sub: int = 0) -> list[Segment]:
        """Byte segments moving GPU blocks ``block_ids`` to/from a part.

        ``block_ids[j]`` is sub-block ``first_sub + j`` of the part (a partly cached first
        chunk starts at ``first_sub = skip_blocks``). Adjacent segments that are contiguous on
        both sides are merged (consecutive block ids of a single-view layout become one copy).
        REQUIRES: every id in ``range(num_blocks)`` (checked: InvalidArgument).
        """
        self.check_blocks(block_ids)
        out: list[Segment] = []
        bb = self.block_bytes
        for j, block in enumerate(block_ids):
            base = (first_sub + j) * bb
            for i, (page, off) in enumerate(zip(self.page_bytes, self.offsets, strict=True)):
                seg = (i, block * page, base + off, page)
                if out:
                    pv, ps, pp, pl = out[-1]
                    if pv == i and ps + pl == seg[1] and pp + pl == seg[2]:
                        out[-1] = (pv, ps, pp, pl + page)
                        continue
                out.append(seg)
        return out

    def check_blocks(self, block_ids: Sequence[int]) -> None:
        """InvalidArgument unless every id is an int in ``range(num_blocks)``."""
        for b in block_ids:
            if type(b) is not int or not 0 <= b < self.num_blocks:
                raise InvalidArgument("block id out of range", block=b, num_blocks=self.num_blocks)


def canonicalize(
    kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    num_blocks: int,
    *,
    block_dim: int | None = None,
) -> CanonicalKVCaches:
    """Rebuild every KV tensor as contiguous ``(num_blocks, page_bytes)`` uint8 views.

    ``kv_caches``: layer name → tensor (in layer order), or a list. The block dimension is the
    logical dimension of size ``num_blocks``; pass ``block_dim`` (a logical index, the same for
    every tensor) when another dimension has that size too. The tensor must be dense (a
    permutation of a contiguous allocation); its physical order comes from the strides.
    Raises InvalidArgument for anything that cannot be viewed without a copy.
    """
    items = (
        list(kv_caches.items())
        if isinstance(kv_caches, Mapping)
        else [(str(i), t) for i, t in enumerate(kv_caches)]
    )
    if not items:
        raise InvalidArgument("no KV caches to register")
    if type(num_blocks) is not int or num_blocks < 1:
        raise InvalidArgument("num_blocks must be a positive integer", num_blocks=num_blocks)
    views: list[torch.Tensor] = []
    names: list[str] = []
    groups: list[ViewGroup] = []
    device = items[0][1].device
    offset = 0
    for name, tensor in items:
        if tensor.device != device:
            raise InvalidArgument("KV caches on different devices", layer=name)
        as_bytes = _block_views(name, tensor, num_blocks, block_dim)
        count, page = int(as_bytes.shape[0]), int(as_bytes.shape[2])
        groups.append(ViewGroup(as_bytes.permute(1, 0, 2), len(views), offset, count, page))
        offset += count * page
        views += as_bytes.unbind(0)
        names += [name] * count
    pages = tuple(int(v.shape[1]) for v in views)
    offsets = tuple(sum(pages[:i]) for i in range(len(pages)))
    arrays = KVArrays.of(groups, sum(pages))
    return CanonicalKVCaches(tuple(views), num_blocks, pages, offsets, tuple(names),
                             tuple(groups), arrays)  # fmt: skip


def _block_views(
    name: str, tensor: torch.Tensor, num_blocks: int, block_dim: int | None
) -> torch.Tensor:
    """``tensor`` as ``(outer, num_blocks, page_bytes)`` uint8, outer = the dimensions that lie
    physically outside the block dimension (FlashAttention's K/V ``2``)."""
    shape = tuple(tensor.shape)
    if block_dim is None:
        candidates = [d for d, size in enumerate(shape) if size == num_blocks]
        if len(candidates) != 1:
            raise InvalidArgument(
                "cannot tell the block dimension: pass block_dim",
                layer=name, shape=shape, num_blocks=num_blocks,
            )  # fmt: skip
        block_dim = candidates[0]
    if not 0 <= block_dim < len(shape) or shape[block_dim] != num_blocks:
        raise InvalidArgument("block_dim does not have num_blocks entries", layer=name,
                              shape=shape, block_dim=block_dim)  # fmt: skip
    # Physical order: strides descending (size-1 dimensions carry arbitrary strides: last).
    order = sorted(range(len(shape)), key=lambda d: (shape[d] != 1, tensor.stride(d)), reverse=True)
    physical = tensor.permute(order)
    if not physical.is_contiguous():
        raise InvalidArgument(
            "KV tensor is not dense (padding between blocks?)",
            layer=name, shape=shape, strides=tuple(tensor.stride()),
        )  # fmt: skip
    pos = order.index(block_dim)
    outer = math.prod(physical.shape[:pos])
    inner = math.prod(physical.shape[pos + 1 :])
    rows = physical.reshape(outer, num_blocks, inner)
    return rows.view(torch.uint8)  # (outer, num_blocks, inner * element_size)


def split_extents(
    extents: Sequence[tuple[int, int]], part_off: int, length: int
) -> list[tuple[int, int, int]]:
    """Map part bytes ``[part_off, part_off + length)`` to arena ranges through ``extents``.

    Returns ``(arena_offset, part_offset, length)`` pieces in order. A part's bytes are the
    concatenation of its extents. REQUIRES: the range lies within the extents' total length
    (InvalidArgument otherwise).
    """
    pieces: list[tuple[int, int, int]] = []
    pos = 0  # part offset where the current extent starts
    end = part_off + length
    for arena_off, ext_len in extents:
        lo, hi = max(part_off, pos), min(end, pos + ext_len)
        if lo < hi:
            pieces.append((arena_off + lo - pos, lo, hi - lo))
        pos += ext_len
        if pos >= end:
            break
    if sum(p[2] for p in pieces) != length:
        raise InvalidArgument("part range beyond its extents", offset=part_off, length=length)
    return pieces


def plan_copies(
    caches: CanonicalKVCaches,
    key: bytes,
    block_ids: Sequence[int],
    chunk_blocks: int,
    host: torch.Tensor,
    extents: Sequence[tuple[int, int]],
    *,
    skip: int = 0,
    is_load: bool,
    builder: Builder | None = None,
    array: np.ndarray | None = None,
) -> KeyCopies:
    """The copies moving one part between KV blocks and ``host`` (a flat uint8 tensor; the
    part's bytes are at ``extents`` of it, in order; ``array``: ``host`` as a numpy array, if
    the caller keeps one, else made here for the strided builder).

    Store: ``block_ids`` are the part's ``chunk_blocks`` sub-blocks. Load: ``block_ids[j]``
    receives sub-block ``skip + j`` (1 to ``chunk_blocks - skip`` ids); the skipped leading
    sub-blocks, and the trailing ones past the ids, are neither read nor written
    (step_protocol/connector.py). Raises
    InvalidArgument for ids or extents that do not fit, before building anything. The copies
    come from ``builder``: by default :func:`strided_copies` when the caches and ``host`` are
    on the CPU, else :func:`staged_copies`; ``"contiguous"`` is :func:`contiguous_copies`.
    """
    most = chunk_blocks - skip if is_load else chunk_blocks
    least = 1 if is_load else chunk_blocks
    if not 0 <= skip < chunk_blocks or not least <= len(block_ids) <= most:
        raise InvalidArgument("block_ids do not fit the chunk", blocks=len(block_ids),
                              skip_blocks=skip, chunk_blocks=chunk_blocks)  # fmt: skip
    ids = tuple(block_ids)
    caches.check_blocks(ids)
    bb = caches.block_bytes
    start, length = skip * bb, len(ids) * bb
    if len(extents) == 1 and start + length <= extents[0][1]:  # the usual case: one extent
        pieces: tuple[Piece, ...] = ((extents[0][0] + start, start, length),)
    else:
        pieces = tuple(split_extents(extents, start, length))
    size = host.numel()
    for at, _, n in pieces:
        if at < 0 or at + n > size:
            raise InvalidArgument("extent outside the host buffer", offset=at, length=n)
    if builder is None:
        builder = "strided" if host.is_cpu and caches.views[0].is_cpu else "staged"
    if builder == "strided":
        if array is not None and array.size != size:
            raise InvalidArgument("array is not the host buffer", size=array.size, host=size)
        copies = strided_copies(caches, ids, skip, host, pieces, is_load, array)
    else:
        copies = _BUILDERS[builder](caches, ids, skip, host, pieces, is_load)
    return KeyCopies(key, copies, size=length)


def strided_copies(
    caches: CanonicalKVCaches,
    block_ids: tuple[int, ...],
    skip: int,
    host: torch.Tensor,
    pieces: Sequence[Piece],
    is_load: bool,
    array: np.ndarray | None = None,
) -> list[Copy]:
    """The copies of one checked part (see :func:`plan_copies`; ``pieces`` from
    :func:`split_extents` over the part bytes ``block_ids`` cover), for CPU caches and host.

    Per run of whole sub-blocks inside one extent piece: when the block ids are consecutive,
    one :class:`~worker.block_runs.BlockRun` (numpy copies, one per :class:`ViewGroup`, built
    by the engine thread, which merges runs that continue each other), or one strided torch
    copy per group where numpy cannot see the memory; else one indexed copy per group; the
    pieces of sub-blocks cut by an extent boundary are copied one by one.
    """
    bb = caches.block_bytes
    if array is None and caches.arrays is not None:
        array = host_array(host)
    if len(pieces) == 1:  # the usual case: one extent holds every sub-block whole
        return _whole_copies(caches, block_ids, host, pieces[0][0], is_load, array)
    out: list[Copy] = []
    for at, start, length in pieces:
        end = start + length
        first, last = -(-start // bb), end // bb  # the whole sub-blocks [first, last)
        if first >= last:
            out += _range_copies(caches, block_ids, skip, host, at, start, end, is_load)
            continue
        if start < first * bb:
            out += _range_copies(caches, block_ids, skip, host, at, start, first * bb, is_load)
        whole = block_ids[first - skip : last - skip]
        out += _whole_copies(caches, whole, host, at + first * bb - start, is_load, array)
        if last * bb < end:
            tail_at = at + last * bb - start
            out += _range_copies(caches, block_ids, skip, host, tail_at, last * bb, end, is_load)
    return out


def _whole_copies(
    caches: CanonicalKVCaches,
    block_ids: tuple[int, ...],
    host: torch.Tensor,
    at: int,
    is_load: bool,
    array: np.ndarray | None,
) -> list[Copy]:
    """Whole sub-blocks ``block_ids`` at ``host[at:]``, back to back: one run (``array``:
    ``host`` as numpy) or one copy per view group."""
    bb = caches.block_bytes
    n, first = len(block_ids), block_ids[0]
    out: list[Copy] = []
    consecutive = block_ids == tuple(range(first, first + n))
    if consecutive and array is not None and caches.arrays is not None:
        return [BlockRun(caches.arrays, array, first, n, at, is_load)]
    origin = int(host.storage_offset()) + at
    if consecutive:
        for g in caches.groups:
            kv = g.rows[first : first + n]
            part = host.as_strided((n, g.count, g.page), (bb, g.page, 1), origin + g.offset)
            out.append((part, kv) if is_load else (kv, part))
        return out
    if is_load and len(set(block_ids)) != n:  # a scatter needs distinct rows: keep the order
        for j, b in enumerate(block_ids):
            out += _whole_copies(caches, (b,), host, at + j * bb, is_load, array)
        return out
    index = torch.tensor(block_ids, dtype=torch.int64)
    for g in caches.groups:
        part = host.as_strided((n, g.count, g.page), (bb, g.page, 1), origin + g.offset)
        if is_load:
            src, dst = widest(part, g.rows)
            out.append(IndexedCopy(src, dst, index, scatter=True))
        else:
            out.append(IndexedCopy(g.rows, part, index, scatter=False))
    return out


def _range_copies(
    caches: CanonicalKVCaches,
    block_ids: Sequence[int],
    skip: int,
    host: torch.Tensor,
    at: int,
    start: int,
    end: int,
    is_load: bool,
) -> list[Copy]:
    """Part bytes ``[start, end)`` (at ``host[at:]``), one contiguous copy per page piece."""
    bb = caches.block_bytes
    out: list[Copy] = []
    for sub in range(start // bb, -(-end // bb)):
        block = block_ids[sub - skip]
        for i, (page, off) in enumerate(zip(caches.page_bytes, caches.offsets, strict=True)):
            lo, hi = max(start, sub * bb + off), min(end, sub * bb + off + page)
            if lo < hi:
                kv_at = block * page + lo - sub * bb - off
                kv = caches.flat(i)[kv_at : kv_at + hi - lo]
                part = host[at + lo - start : at + hi - start]
                out.append((part, kv) if is_load else (kv, part))
    return out


def contiguous_copies(
    caches: CanonicalKVCaches,
    block_ids: Sequence[int],
    skip: int,
    host: torch.Tensor,
    pieces: Sequence[Piece],
    is_load: bool,
) -> list[Copy]:
    """Like :func:`strided_copies`, but every copy is contiguous on both sides (what
    ``copy_(non_blocking=True)`` between a CUDA device and pinned host memory wants): one per
    page, merged where both sides continue, split at extent boundaries."""
    extents = [(at, length) for at, _, length in pieces]
    base = pieces[0][1]  # part offset where ``extents`` start
    pairs: list[Copy] = []
    for view, src_off, part_off, length in caches.segments(block_ids, skip):
        flat = caches.flat(view)
        for host_off, piece_off, n in split_extents(extents, part_off - base, length):
            dev = flat[src_off + piece_off + base - part_off :][:n]
            h = host[host_off : host_off + n]
            pairs.append((h, dev) if is_load else (dev, h))
    return pairs


def staged_copies(
    caches: CanonicalKVCaches,
    block_ids: tuple[int, ...],
    skip: int,
    host: torch.Tensor,
    pieces: Sequence[Piece],
    is_load: bool,
) -> list[Copy]:
    """The part as one :class:`~worker.staging.StagedPart` (nothing built: the engine stages
    the parts of a transfer together); its fallback is :func:`contiguous_copies`. A part that
    is already contiguous on the device (one view, consecutive block ids: a cross-layer
    cache) needs no staging: its :func:`contiguous_copies` are one DMA per extent piece."""
    first = block_ids[0]
    if len(caches.views) == 1 and block_ids == tuple(range(first, first + len(block_ids))):
        return contiguous_copies(caches, block_ids, skip, host, pieces, is_load)
    pieces = tuple(pieces)
    fallback = partial(contiguous_copies, caches, block_ids, skip, host, pieces, is_load)
    return [StagedPart(caches.groups, caches.block_bytes, block_ids, skip, host, pieces,
                       is_load, fallback)]  # fmt: skip


#: The builders other than the strided one (which takes the host's numpy array too).
_BUILDERS: dict[str, Callable[..., list[Copy]]] = {
    "contiguous": contiguous_copies, "staged": staged_copies,
}  # fmt: skip
