"""Canonical KV-cache layout: any paged KV tensor as per-block byte rows (seed 000 §12.1).

Runs in the worker process, once at start-up (:func:`canonicalize`) and then per transfer
(:meth:`CanonicalKVCaches.segments`, pure arithmetic). No locks: the result is immutable and
may be read from any thread.

Attention backends lay out their paged KV differently: FlashAttention keeps ``(2, num_blocks,
block_size, heads, head_dim)`` per layer, others put the block dimension first
(``(num_blocks, 2, block_size, heads, head_dim)``), some allocate one cross-layer tensor
``(num_blocks, layers * page)``, and a logical shape may be a permuted view of the physical
one (HND vs NHD). :func:`canonicalize` finds the *physical* block dimension of each tensor from
its strides and rebuilds every tensor as one or more contiguous ``(num_blocks, page_bytes)``
uint8 views (dimensions physically outside the block dimension, e.g. FlashAttention's K/V
``2``, are split off into separate views). Nothing is copied.

Byte layout of one block (and therefore of a stored part, block ``j`` of a part at bytes
``[j * block_bytes, (j + 1) * block_bytes)``, kvserver/connector_messages.py): the pages of the
canonical views in order, i.e. tensors in registration order (layers in order), and within one
tensor the physically outer sub-views in order (K before V). A per-layer FlashAttention cache
and a cross-layer ``(num_blocks, layers, 2, ...)`` cache of the same model therefore produce
the same bytes; a different *inner* physical order (HND vs NHD) produces different bytes, so
workers that share a namespace must share the backend's inner layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvserver.errors import InvalidArgument
from worker.transfer import KeyCopies

#: (view index, byte offset in the view's flat bytes, byte offset in the part, length)
Segment = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class CanonicalKVCaches:
    """Block-major byte views of the registered KV caches.

    Invariants: every view is a contiguous ``(num_blocks, page_bytes[i])`` uint8 tensor on
    ``device``; ``block_bytes == sum(page_bytes)``; ``offsets[i]`` is where view ``i``'s page
    sits inside a block's bytes.
    """

    views: tuple[torch.Tensor, ...]
    num_blocks: int
    page_bytes: tuple[int, ...]
    offsets: tuple[int, ...]
    #: registered name of the tensor each view comes from (for messages).
    names: tuple[str, ...]

    @property
    def block_bytes(self) -> int:
        return sum(self.page_bytes)

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
        for b in block_ids:
            if type(b) is not int or not 0 <= b < self.num_blocks:
                raise InvalidArgument("block id out of range", block=b, num_blocks=self.num_blocks)
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
    device = items[0][1].device
    for name, tensor in items:
        if tensor.device != device:
            raise InvalidArgument("KV caches on different devices", layer=name)
        for view in _block_views(name, tensor, num_blocks, block_dim):
            views.append(view)
            names.append(name)
    pages = tuple(int(v.shape[1]) for v in views)
    offsets = tuple(sum(pages[:i]) for i in range(len(pages)))
    return CanonicalKVCaches(tuple(views), num_blocks, pages, offsets, tuple(names))


def _block_views(
    name: str, tensor: torch.Tensor, num_blocks: int, block_dim: int | None
) -> list[torch.Tensor]:
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
    as_bytes = rows.view(torch.uint8)  # (outer, num_blocks, inner * element_size)
    return [as_bytes[i] for i in range(outer)]


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
) -> KeyCopies:
    """The copies moving one part between KV blocks and ``host`` (a flat uint8 tensor; the
    part's bytes are at ``extents`` of it, in order).

    Store: ``block_ids`` are the part's ``chunk_blocks`` sub-blocks. Load: ``block_ids[j]``
    receives sub-block ``skip + j`` (``chunk_blocks - skip`` ids); the skipped leading
    sub-blocks are neither read nor written (kvserver/connector_messages.py). Each pair is
    contiguous on both sides. Raises InvalidArgument for ids or extents that do not fit.
    """
    want = chunk_blocks - skip if is_load else chunk_blocks
    if not 0 <= skip < chunk_blocks or len(block_ids) != want:
        raise InvalidArgument("block_ids do not fit the chunk", blocks=len(block_ids),
                              skip_blocks=skip, chunk_blocks=chunk_blocks)  # fmt: skip
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for view, src_off, part_off, length in caches.segments(block_ids, skip):
        flat = caches.flat(view)
        for host_off, piece_off, n in split_extents(extents, part_off, length):
            dev = flat[src_off + piece_off - part_off :][:n]
            h = host[host_off : host_off + n]
            pairs.append((h, dev) if is_load else (dev, h))
    return KeyCopies(key, pairs)
