"""Runs of whole blocks between CPU KV caches and host memory, copied by numpy.

Runs in the worker process: :class:`BlockRun` descriptions are made by worker/layout.py
(``strided_copies``, on the worker's thread) for CPU caches and a CPU host buffer, and copied by
the transfer engine's threads (:func:`run_block_runs`). The CUDA plan is worker/staging.py.

Why numpy: on our cores a torch ``copy_`` costs about a microsecond of dispatch and iterator
set-up per call, and its copy loop moved 128-512 KiB pieces at 0.77-0.95 of what glibc's
``memmove`` does; a numpy copy between two views costs a fraction of that per call and
copies each contiguous row with ``memmove`` (docs/benchmarks.md, "Worker transfer engine vs
memcpy (CPU)"). A chunk of a cross-layer cache is one ``memmove``; per-layer caches
(FlashAttention: K and V pages apart) are one strided copy per registered tensor, or one in
all where the tensors lie evenly spaced in memory (cut from one allocation).

A run is the consecutive blocks ``first .. first + count - 1`` and the host bytes ``[at, at +
count * block_bytes)``, laid out as a part (block after block, each block the view groups'
pages in order, worker/layout.py). Planning only checks and describes (integers); the engine
thread builds the views, after merging runs that continue each other on both sides (the next
run starts at the block after the last one's and at the host byte after its bytes: the chunks
of a prefill on a fresh arena), so that such a transfer costs one copy per registered tensor
however many chunks it holds. Only neighbours in the copy order merge, and merged runs never
overlap, so the order of every byte written is kept.

Thread safety: everything here is immutable. The arrays are views of memory owned elsewhere: the
KV caches live as long as the worker; the host is the mapped arena (unmapped only after the
copies that use it finished) or a staging buffer the transfer keeps alive.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from worker.staging import ViewGroup


@dataclass(frozen=True, slots=True, eq=False)
class KVArrays:
    """numpy views of CPU KV caches' view groups (worker/layout.py ``CanonicalKVCaches``).

    ``groups[g] = (rows, first_page, count)``: ``rows`` is group ``g``'s ``(num_blocks, count,
    page)`` bytes, its pages the ``first_page`` .. ``first_page + count - 1``-th of a block
    when every page has the same size (``page``, else 0). ``flat``: the whole cache as one
    flat byte array when its blocks are contiguous and back to back (a cross-layer cache).
    ``spaced``: every group at once, ``(num_blocks, groups, count, page)``, when the groups
    are alike and evenly spaced in memory (:func:`_evenly_spaced`), so that a run is one copy.
    """

    groups: tuple[tuple[np.ndarray, int, int], ...]
    block_bytes: int
    page: int
    flat: np.ndarray | None
    #: per group: the byte offset of its pages in a block (for pages of mixed sizes).
    offsets: tuple[int, ...]
    spaced: np.ndarray | None = None

    @classmethod
    def of(cls, groups: Sequence[ViewGroup], block_bytes: int) -> KVArrays | None:
        """The arrays of ``groups`` (their rows on the CPU), or None (not on the CPU)."""
        if not groups or groups[0].rows.device.type != "cpu":
            return None
        pages = {g.page for g in groups}
        page = pages.pop() if len(pages) == 1 else 0
        arrays = tuple((g.rows.detach().numpy(), g.offset // page if page else 0, g.count)
                       for g in groups)  # fmt: skip
        flat = None
        rows = groups[0].rows
        if len(groups) == 1 and rows.is_contiguous():  # one (num_blocks, block_bytes) tensor
            flat = rows.detach().reshape(-1).numpy()  # contiguous: a view, never a copy
        offsets = tuple(g.offset for g in groups)
        return cls(arrays, block_bytes, page, flat, offsets, _evenly_spaced(groups))


def _evenly_spaced(groups: Sequence[ViewGroup]) -> np.ndarray | None:
    """Two or more groups of one shape and strides whose data lie at one constant distance
    from each other (per-layer caches cut from one allocation, or allocated one after the
    other at equal steps) as one ``(num_blocks, groups, count, page)`` array over their
    memory; else None. Its element ``[b, g]`` is group ``g``'s ``rows[b]`` (same address), so
    it addresses only the groups' own bytes, never what lies between them; the groups' arrays
    (kept by :class:`KVArrays`) keep that memory alive."""
    if len(groups) < 2:
        return None
    shape, strides = tuple(groups[0].rows.shape), groups[0].rows.stride()
    if any(tuple(g.rows.shape) != shape or g.rows.stride() != strides for g in groups):
        return None
    ptrs = [g.rows.data_ptr() for g in groups]
    step = ptrs[1] - ptrs[0]
    if step == 0 or any(b - a != step for a, b in pairwise(ptrs)):
        return None
    dims = (shape[0], len(groups), shape[1], shape[2])
    steps = (strides[0], step, strides[1], strides[2])
    lo = sum((n - 1) * s for n, s in zip(dims, steps, strict=True) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(dims, steps, strict=True) if s > 0)
    span = (ctypes.c_uint8 * (hi - lo + 1)).from_address(ptrs[0] + lo)
    return np.ndarray(dims, np.uint8, memoryview(span), -lo, steps)


def host_array(host: torch.Tensor) -> np.ndarray | None:
    """``host`` (a flat uint8 tensor) as a numpy array over the same bytes, or None when it
    is not a contiguous CPU tensor."""
    if not host.is_cpu or not host.is_contiguous():
        return None
    return host.detach().numpy()


@dataclass(frozen=True, slots=True, eq=False)
class BlockRun:
    """Blocks ``first .. first + count - 1`` ↔ ``host[at : at + count * kv.block_bytes]``
    (see the module docstring). REQUIRES (checked by the planner): the blocks exist and the
    bytes lie inside ``host``, a flat uint8 array."""

    kv: KVArrays
    host: np.ndarray
    first: int
    count: int
    at: int
    is_load: bool

    @property
    def nbytes(self) -> int:
        return self.count * self.kv.block_bytes


#: A merged run: (kv, host, first block, block count, host offset, is_load).
Span = tuple[KVArrays, np.ndarray, int, int, int, bool]


def merged(runs: Sequence[BlockRun]) -> Iterator[Span]:
    """``runs`` in order, each neighbour that continues the span before it on both sides (the
    same arrays and direction, the next block, the next host byte) joined to it."""
    i, n = 0, len(runs)
    while i < n:
        r = runs[i]
        kv, host, is_load = r.kv, r.host, r.is_load
        first, count, at, bb = r.first, r.count, r.at, kv.block_bytes
        i += 1
        while i < n:
            s = runs[i]
            if (s.first != first + count or s.at != at + count * bb or s.kv is not kv
                    or s.host is not host or s.is_load != is_load):  # fmt: skip
                break
            count += s.count
            i += 1
        yield kv, host, first, count, at, is_load


def run_block_runs(runs: Sequence[BlockRun]) -> None:
    """Engine thread: copy ``runs`` in order, :func:`merged` (the same merge, inlined: this
    is the CPU engine's per-chunk loop). The host's views are made once per call and kept
    for the runs that follow on the same host and caches, not once per run; they live only
    during the call (a view kept would hold the arena's mapping open)."""
    views = _HostViews()
    i, n = 0, len(runs)
    while i < n:
        r = runs[i]
        kv, host, is_load = r.kv, r.host, r.is_load
        first, count, at, bb = r.first, r.count, r.at, kv.block_bytes
        i += 1
        while i < n:
            s = runs[i]
            if (s.first != first + count or s.at != at + count * bb or s.kv is not kv
                    or s.host is not host or s.is_load != is_load):  # fmt: skip
                break
            count += s.count
            i += 1
        views.copy(kv, host, first, count, at, is_load)


class _HostViews:
    """:func:`_copy` with the views of the host made once per host, caches and offset
    modulo the block size: a flat cache is copied between two memoryviews (slicing one costs
    half a numpy slice), the others from ``host`` seen as ``(rows, *block)`` from the run's
    offset modulo ``block_bytes`` on, so that a run is one slice of it, not a slice and a
    reshape."""

    __slots__ = ("_blocks", "_bytes", "_flat", "_host", "_kv", "_res")

    def __init__(self) -> None:
        self._host: np.ndarray | None = None
        self._kv: KVArrays | None = None
        self._res = -1
        self._flat: memoryview | None = None
        self._bytes: memoryview | None = None
        self._blocks: np.ndarray | None = None

    def copy(self, kv: KVArrays, host: np.ndarray, first: int, count: int, at: int,
             is_load: bool) -> None:  # fmt: skip
        """One merged run, as :func:`_copy` does it."""
        bb, whole = kv.block_bytes, kv.flat
        if whole is not None:
            if host is not self._host or kv is not self._kv or self._flat is None:
                self._host, self._kv, self._res, self._blocks = host, kv, -1, None
                self._bytes, self._flat = host.data, whole.data  # memoryviews
            side, flat = self._bytes, self._flat
            assert side is not None
            if is_load:
                flat[first * bb : (first + count) * bb] = side[at : at + count * bb]
            else:
                side[at : at + count * bb] = flat[first * bb : (first + count) * bb]
            return
        if not kv.page and kv.spaced is None:  # pages of mixed sizes: per group, as before
            _copy(kv, host, first, count, at, is_load)
            return
        res = at % bb
        blocks = self._blocks
        if host is not self._host or kv is not self._kv or res != self._res or blocks is None:
            shape = kv.spaced.shape[1:] if kv.spaced is not None else (bb // kv.page, kv.page)
            rows = (host.size - res) // bb
            blocks = host[res : res + rows * bb].reshape(rows, *shape)  # contiguous: a view
            self._host, self._kv, self._res, self._blocks = host, kv, res, blocks
            self._bytes = self._flat = None
        q = (at - res) // bb
        part = blocks[q : q + count]
        if kv.spaced is not None:
            cache = kv.spaced[first : first + count]
            if is_load:
                cache[...] = part
            else:
                part[...] = cache
            return
        for rows_g, p, c in kv.groups:
            if is_load:
                rows_g[first : first + count] = part[:, p : p + c]
            else:
                part[:, p : p + c] = rows_g[first : first + count]


def _copy(kv: KVArrays, host: np.ndarray, first: int, count: int, at: int, is_load: bool) -> None:
    """One run: one numpy copy per view group (one in all for a flat cache). ``a[...] = b``
    rather than ``np.copyto``: the same copy, a third less call overhead."""
    bb = kv.block_bytes
    end = at + count * bb
    if kv.flat is not None:
        cache = kv.flat[first * bb : first * bb + count * bb]
        if is_load:
            cache[...] = host[at:end]
        else:
            host[at:end] = cache
        return
    if kv.spaced is not None:
        rows = kv.spaced[first : first + count]
        part = host[at:end].reshape(rows.shape)  # contiguous: a view
        if is_load:
            rows[...] = part
        else:
            part[...] = rows
        return
    if kv.page:
        pages = host[at:end].reshape(count, bb // kv.page, kv.page)  # contiguous: a view
        for rows, p, c in kv.groups:
            if is_load:
                rows[first : first + count] = pages[:, p : p + c]
            else:
                pages[:, p : p + c] = rows[first : first + count]
        return
    for (rows, _, c), off in zip(kv.groups, kv.offsets, strict=True):
        page = rows.shape[2]
        side = np.ndarray((count, c, page), np.uint8, host, at + off, (bb, page, 1))
        if is_load:
            rows[first : first + count] = side
        else:
            side[...] = rows[first : first + count]
