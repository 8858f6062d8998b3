"""Reuse gating: do not store a chunk until it has been seen enough times.

Offloading a chunk costs a copy and a slot; a chunk that is never read back wasted both. The
tracker counts sightings of keys in ``lookup`` calls that ask for it (the scheduler's planning
lookups) in an LRU-bounded counter; ``prepare_store`` only admits keys whose count reached
``store_threshold``. A threshold of 0 or 1 disables gating.

Single owner (the storage engine); no locks. Keys are opaque hashables.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from kvserver.errors import InvalidArgument


class ReuseTracker:
    """LRU-bounded sighting counter; see the module docstring."""

    def __init__(self, store_threshold: int = 0, max_tracker_size: int = 64_000) -> None:
        if store_threshold < 0:
            raise InvalidArgument("store_threshold must be >= 0", value=store_threshold)
        if max_tracker_size < 1:
            raise InvalidArgument("max_tracker_size must be >= 1", value=max_tracker_size)
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._counts: OrderedDict[Hashable, int] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.store_threshold >= 2

    def __len__(self) -> int:
        return len(self._counts)

    def record(self, keys: Iterable[Hashable]) -> None:
        """Count one sighting of each key (no-op when gating is disabled)."""
        if not self.enabled:
            return
        counts = self._counts
        for key in keys:
            counts[key] = counts.pop(key, 0) + 1
        while len(counts) > self.max_tracker_size:
            counts.popitem(last=False)

    def admits(self, key: Hashable) -> bool:
        """True if ``key`` may be stored now."""
        return not self.enabled or self._counts.get(key, 0) >= self.store_threshold

    def count(self, key: Hashable) -> int:
        return self._counts.get(key, 0)
