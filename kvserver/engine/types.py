"""Value types of the storage engine: configuration, the per-chunk record, keys whose size is
known by construction (cut from one buffer, or made by a namespace's hasher).

The grants (``StoreGrant``, ``LoadGrant``) are data-plane wire values: ``kvserver/grants.py``;
the counters and the stats snapshot: ``stats.py``.

Pure data; no behaviour beyond validation and derived properties.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import numpy

from kvserver.allocator import Extents
from kvserver.arena import DEFAULT_SHM_DIR
from kvserver.errors import InvalidArgument

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Configuration of one storage engine (the DRAM tier). Validated on construction."""

    dram_bytes: int = 256 * MiB
    page_size: int = 64 * KiB
    policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    default_lease_s: float = 30.0
    max_lease_s: float = 600.0
    max_pin_ttl_s: float = 24 * 3600.0
    max_keys_per_request: int = 1 << 16
    shm_dir: str = DEFAULT_SHM_DIR

    def __post_init__(self) -> None:
        # the allocator's and the reuse tracker's own checks, here so that a daemon's config
        # is refused before its arena is made
        if self.page_size < 4096 or self.page_size & (self.page_size - 1):
            raise InvalidArgument("page_size must be a power of two >= 4096", value=self.page_size)
        if self.store_threshold < 0:
            raise InvalidArgument("store_threshold must be >= 0", value=self.store_threshold)
        if self.max_tracker_size < 1:
            raise InvalidArgument("max_tracker_size must be >= 1", value=self.max_tracker_size)
        if self.dram_bytes < self.page_size:
            raise InvalidArgument("dram_bytes must hold at least one page", value=self.dram_bytes)
        if not 0 < self.default_lease_s <= self.max_lease_s:
            raise InvalidArgument("need 0 < default_lease_s <= max_lease_s")
        if self.max_keys_per_request < 1:
            raise InvalidArgument("max_keys_per_request must be positive")

    @property
    def num_pages(self) -> int:
        return self.dram_bytes // self.page_size

    @property
    def quarantine_s(self) -> float:
        """How long the pages of an expired store reservation stay out of use, and the chunks
        of an expired load lease out of eviction (``leases.py``): ``default_lease_s``."""
        return self.default_lease_s

    def lease_s_of(self, lease_s: float | None) -> float:
        """A call's lease duration: ``default_lease_s`` for None, else ``lease_s`` checked
        (InvalidArgument outside (0, max_lease_s])."""
        if lease_s is None:
            return self.default_lease_s
        if not isinstance(lease_s, int | float) or not 0 < lease_s <= self.max_lease_s:
            raise InvalidArgument(
                "lease duration out of range", lease_s=lease_s, max_lease_s=self.max_lease_s
            )
        return float(lease_s)

    def pin_ttl_s_of(self, ttl_s: float) -> float:
        """A TTL pin's duration, checked (InvalidArgument outside (0, max_pin_ttl_s])."""
        if not isinstance(ttl_s, int | float) or not 0 < ttl_s <= self.max_pin_ttl_s:
            raise InvalidArgument("ttl out of range", ttl_s=ttl_s, max_pin_ttl_s=self.max_pin_ttl_s)
        return float(ttl_s)


class CutKeys(tuple[bytes, ...]):
    """Chunk keys cut from one buffer of concatenated keys, each ``key_size`` bytes.

    Every instance is made by cutting (there is no other constructor) and a tuple cannot
    change, so each key is ``bytes`` of exactly ``key_size`` by construction: key validation
    (``NamespaceTable.check_keys``) compares ``key_size`` instead of looking at each key
    (2,048 keys: ~60 us less). The gRPC ``packed_keys`` field arrives as one.
    """

    key_size: int

    def __new__(cls, packed: bytes, key_size: int) -> CutKeys:
        """REQUIRES: ``key_size >= 1`` and ``len(packed)`` a multiple of it (else ValueError)."""
        if key_size < 1 or len(packed) % key_size:
            raise ValueError(f"{len(packed)} bytes are not whole keys of {key_size} bytes")
        # one bytes object per key, cut in C (2,048 keys: ~25 us)
        keys = super().__new__(cls, numpy.frombuffer(packed, dtype=f"V{key_size}").tolist())
        keys.key_size = key_size
        return keys


class HashedKeys(tuple[bytes, ...]):
    """Chunk keys that a namespace's own :class:`~kvserver.hashing.BlockHasher` made from token
    ids (``PromptHashing.chunk_keys_for_tokens``): digests of the namespace's hash algorithm, so
    each is ``bytes`` of ``key_size`` by construction of the hash function, and the engine's
    key check (``NamespaceTable.check_keys``) compares ``key_size`` instead of each key, as for
    :class:`CutKeys` (2,048 keys: ~40 us less per Lookup by token ids).

    REQUIRES (not checked: that is the point): every item is a digest returned by a hasher
    whose ``digest_size`` is ``key_size``. Only the daemon's token paths make one.
    """

    key_size: int

    def __new__(cls, digests: Iterable[bytes], key_size: int) -> HashedKeys:
        keys = super().__new__(cls, digests)
        keys.key_size = key_size
        return keys


class EntryState(enum.IntEnum):
    #: reserved by prepare_store; invisible to lookup; some parts not yet written.
    WRITING = 0
    #: every part written; visible; evictable unless pinned.
    READY = 1


@dataclass(slots=True, eq=False)
class Entry:
    """One logical chunk: one part per TP rank. Owned by the engine's index."""

    ns: int
    key: bytes
    state: EntryState
    #: pages of each rank's part (index = rank).
    pages: list[list[int]]
    #: byte extents of each rank's part (index = rank).
    extents: list[Extents]
    #: total pages of all parts: ``sum(map(len, pages))``, fixed for the entry's life, given
    #: by the index, which knows it for a whole batch (eviction, pinning and accounting read
    #: it several times per key; ``check_invariants`` recomputes it).
    num_pages: int
    #: the store lease that reserved it (0 once ready).
    lease_id: int = 0
    #: in-flight loads reading it.
    pins: int = 0
    #: explicit TTL pin deadline (engine clock), 0.0 when not TTL-pinned.
    ttl_until: float = 0.0
    #: until when an expired load lease's quarantine keeps it from eviction (engine clock;
    #: 0.0: none): its reader may still be copying out of its pages (``leases.py``)
    held_until: float = 0.0
    #: times the chunk was used: 1 when stored, +1 per load and per touching/recording lookup
    #: hit. The SSD tier's admission rule reads it when the entry is evicted.
    uses: int = 1

    @property
    def is_pinned(self) -> bool:
        return self.pins > 0 or self.ttl_until > 0.0
