"""The segment cache of a block hasher: already-hashed chain segments, reused bit for bit.

Runs wherever :mod:`kvserver.hashing` runs (the daemon's gRPC Lookup by token ids, the
scheduler-side connector, ``kvserver hash``); each :class:`~kvserver.hashing.BlockHasher` owns
one :class:`SegmentCache`. Pure in-process state, no I/O, no logging; thread-safe (one lock, held
for one pass over a call's segments).

Why. Prompts repeat and extend one another (multi-turn chats, shared system prompts, routers
asking about the same prompt again), so a hasher keeps a bounded LRU cache of chain segments:
the hashes of :data:`GROUP_BLOCKS` consecutive full blocks, keyed by what determines them (the
parent hash before the segment, the extra keys of its first and of its other blocks) and a
64-bit xxh3 of the segment's token ids packed as bytes. The xxh3 is there because dict keys are
hashed with siphash, ~5 instructions a byte: 2 KiB of ids per segment cost 0.6 M instructions
per 32k-token call. Only whole segments aligned to the call's first block are cached, so the
short incremental calls of a scheduler never touch it.

Contract: an entry keeps the segment's ids and is a hit only when they equal the call's byte
for byte, so a hit is the value a recomputation would give, bit for bit (segments whose ids
collide in xxh3 share one entry, the later replacing the earlier: a miss, never a wrong hash).
At most ``capacity`` segments are kept, the least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import xxhash

#: the type of a block hash (``hashing.BlockHash``: this module does not import hashing)
H = TypeVar("H", bound=bytes)

#: blocks per cached chain segment (512 tokens at block size 16)
GROUP_BLOCKS = 32
#: most segments one hasher caches (~8 KiB each at block size 16: 16k blocks, 256k tokens)
CACHE_GROUPS = 1024

#: the key of a segment's packed token ids in :class:`SegmentCache` (not its identity: the
#: entry keeps the ids, compared on every hit)
_segment_digest: Callable[[memoryview], int] = xxhash.xxh3_64_intdigest


class SegmentCache(Generic[H]):
    """A bounded LRU of chain segments (see the module docstring); thread-safe.

    Keys: (parent hash, extra keys of the segment's first block, of its other blocks,
    :data:`_segment_digest` of its packed ids); values: (those ids, the segment's block
    hashes), the hashes a list that callers must not mutate (``run`` copies them out).
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._segments: OrderedDict[tuple[object, ...], tuple[bytes, list[H]]] = OrderedDict()

    def run(
        self,
        parent: bytes,
        keys: object,
        rest_keys: object,
        packed: bytes,
        max_segments: int,
        seg_bytes: int,
    ) -> list[H]:
        """The hashes of the leading cached segments of a call (at most ``max_segments``),
        looked up in one pass under the lock: the first segment's parent is ``parent`` and its
        extra keys ``keys``, each later one's its predecessor's last hash and ``rest_keys``;
        segment ``i`` holds the ids ``packed[i * seg_bytes : (i + 1) * seg_bytes]``. A new
        list (the cached ones are not handed out)."""
        out: list[H] = []
        segments, digest, view = self._segments, _segment_digest, memoryview(packed)
        with self._lock:
            for at in range(0, max_segments * seg_bytes, seg_bytes):
                key = (parent, keys, rest_keys, digest(view[at : at + seg_bytes]))
                entry = segments.get(key)
                if entry is None or entry[0] != packed[at : at + seg_bytes]:
                    break
                segments.move_to_end(key)
                hashes = entry[1]
                out += hashes
                parent, keys = hashes[-1], rest_keys
        return out

    def put_chain(
        self,
        parent: bytes,
        keys: object,
        rest_keys: object,
        packed: bytes,
        first_segment: int,
        seg_bytes: int,
        hashes: list[H],
    ) -> None:
        """Remember the whole segments of ``hashes``, the chain computed from segment
        ``first_segment`` on (keyed as :meth:`run` looks them up), in one pass under the lock."""
        segments, digest, view = self._segments, _segment_digest, memoryview(packed)
        with self._lock:
            at = first_segment * seg_bytes
            for start in range(0, len(hashes) - GROUP_BLOCKS + 1, GROUP_BLOCKS):
                segment = hashes[start : start + GROUP_BLOCKS]
                ids = view[at : at + seg_bytes]
                segments[(parent, keys, rest_keys, digest(ids))] = (ids.tobytes(), segment)
                parent, keys, at = segment[-1], rest_keys, at + seg_bytes
            while len(segments) > self._capacity:
                segments.popitem(last=False)

    def __len__(self) -> int:
        return len(self._segments)
