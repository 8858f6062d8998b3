"""The bytes ``H`` hashes for each block of a call, encoded for all blocks at once (CBOR).

Runs wherever :mod:`kvserver.hashing` runs (the daemon's gRPC Lookup by token ids, the
scheduler-side connector, ``kvserver hash``). Pure computation on numpy arrays: no I/O, no
state; thread-safe.

Why. For ``sha256_cbor`` (the default) and ``xxhash_cbor`` a block's payload is
``cbor2.dumps((parent, tuple(ids), extra_keys), canonical=True)``. cbor2 writes it object by
object (~2 us a block of 16, more than the digest); but the payload has a fixed layout in which
only each id's width varies, so the payloads of all blocks are built here with a few numpy
operations over the whole call, and what is left in Python is the hash chain (``hashing.py``),
sequential by nature. (``sha256`` hashes pickle protocol 5, which ``pickle.dumps`` writes in C
at ~0.5 us a block: a numpy encoder of the same layout was measured slower, so it has none.)

Contract: :func:`encode_blocks` returns :class:`Payloads` whose ``payload(b, parent)`` is, byte
for byte, ``cbor2.dumps((parent, ids_b, keys_b), canonical=True)`` for any ``parent`` of
``digest_size`` bytes, where ``ids_b`` is block ``b``'s tuple of ids, ``keys_0 = first_keys``
and ``keys_b = rest_keys`` for ``b >= 1``; tests/kvserver/test_hash_payloads.py checks it
against cbor2 for ids of every width class. The ids are uint32: larger ones (no vocabulary has
them) are the caller's to hash block by block.

Layout, for a 32-byte digest and 16 ids per block (``|`` separates the parts)::

    83 58 20 | parent | 90 uint(id_0) ... uint(id_15) cbor(keys)
    uint(t) = t (t < 24) | 18 t | 19 t:2 BE | 1a t:4 BE        (the shortest form)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import cbor2
import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray

# Each id becomes one 64-bit word holding its encoding (big-endian, right-aligned: head byte
# << (8 * value bytes) | t) and a word of flags, one byte each, saying which of its bytes are
# kept. Tables by width class (_classes): t < 24, < 256, < 2**16, < 2**32.
_EDGES = (24, 256, 1 << 16)
_HEADS = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
_WIDTHS = np.array([1, 2, 3, 5], dtype=np.int64)
_FLAGS = np.frombuffer(b"".join(bytes(8 - w) + b"\x01" * w for w in _WIDTHS), np.uint64).copy()


class Payloads(NamedTuple):
    """Every block's payload but the parent: block ``b``'s payload is
    ``head + parent + data[starts[b]:ends[b]]``."""

    data: bytes
    head: bytes
    starts: list[int]
    ends: list[int]

    def payload(self, block: int, parent: bytes) -> bytes:
        """Block ``block``'s whole payload under ``parent`` (the hasher inlines this)."""
        return self.head + parent + self.data[self.starts[block] : self.ends[block]]


def encode_blocks(
    ids: NDArray[np.uint32],
    block_size: int,
    digest_size: int,
    first_keys: object,
    rest_keys: object,
) -> Payloads:
    """The CBOR payloads of every full block of ``ids`` (see the module docstring).

    REQUIRES: ``ids`` is one-dimensional, ``block_size >= 1``, ``len(ids)`` a positive multiple
    of ``block_size``; ``first_keys``/``rest_keys`` are what the hasher puts in the payload
    (None or tuples of str tuples).
    """
    num_blocks = len(ids) // block_size
    klass = _classes(ids)
    words = (_HEADS.take(klass) | ids.astype(np.uint64)).astype(">u8").view(np.uint64)
    head = b"\x83" + _cbor_head(2, digest_size)
    lead = _cbor_head(4, block_size)  # the head of the array of ids
    closing = cbor2.dumps(rest_keys, canonical=True)
    first_closing = cbor2.dumps(first_keys, canonical=True)
    # One row of 8-byte cells per block, [lead | one cell per id | keys], and a row of flags
    # beside it; the flagged bytes of all rows, in order, are ``data``. Block 0's keys are its
    # own (the cache salt is in block 0's only).
    lead_cells = -(-len(lead) // 8)
    cells = lead_cells + block_size + -(-max(len(closing), len(first_closing)) // 8)
    rows = np.zeros((num_blocks, cells * 8), dtype=np.uint8)
    kept = np.zeros((num_blocks, cells * 8), dtype=bool)
    rows[:, : len(lead)] = np.frombuffer(lead, dtype=np.uint8)
    kept[:, : len(lead)] = True
    ids_end = lead_cells + block_size
    rows.view(np.uint64)[:, lead_cells:ids_end] = words.reshape(num_blocks, block_size)
    kept.view(np.uint64)[:, lead_cells:ids_end] = _FLAGS.take(klass).reshape(num_blocks, -1)
    at = ids_end * 8
    rows[1:, at : at + len(closing)] = np.frombuffer(closing, dtype=np.uint8)
    kept[1:, at : at + len(closing)] = True
    rows[0, at : at + len(first_closing)] = np.frombuffer(first_closing, dtype=np.uint8)
    kept[0, at : at + len(first_closing)] = True
    # bytes per block: its ids' widths (1 + class, + 1 more for class 3: 1, 2, 3, 5) summed
    # over uint8s, no lookup table (the take and an int64 sum cost 2x: docs/benchmarks.md)
    widths_less_one = klass + (klass == 3).view(np.uint8)
    lengths = widths_less_one.reshape(num_blocks, block_size).sum(axis=1, dtype=np.int64)
    lengths += block_size + len(lead) + len(closing)
    lengths[0] += len(first_closing) - len(closing)
    data = np.compress(kept.ravel(), rows.ravel()).tobytes()
    bounds = np.cumsum(lengths)
    ends = bounds.tolist()
    bounds -= lengths
    return Payloads(data, head, bounds.tolist(), ends)


def _classes(ids: NDArray[np.uint32]) -> NDArray[np.uint8]:
    """Per id, its width class: how many of ``_EDGES`` it is >= (0 to 3)."""
    klass = (ids >= _EDGES[0]).view(np.uint8) + (ids >= _EDGES[1]).view(np.uint8)
    klass += (ids >= _EDGES[2]).view(np.uint8)
    return klass


def _cbor_head(major: int, value: int) -> bytes:
    """Canonical (shortest) CBOR head for major type ``major`` and argument ``value``."""
    if value < 24:
        return bytes((major << 5 | value,))
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes((major << 5 | info,)) + value.to_bytes(size, "big")
    raise ValueError(f"value too large for a CBOR head: {value}")
