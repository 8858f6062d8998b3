"""LRU eviction policy: evict the entry that has gone untouched the longest.

Runs inside the storage engine like every policy (single owner, no locks, no I/O); see
:mod:`kvserver.policies.base` for the call contract.

Invariants:
- ``_entries`` holds exactly the tracked keys, ordered least → most recently used (the
  OrderedDict is the recency list; ``move_to_end`` is "use").
- ``evict`` walks from the LRU end, skips keys that are not evictable and commits only once the
  chosen victims cover ``need``; the cost of a call is O(victims + skipped keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from kvserver.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used, over one OrderedDict (as vLLM's ``LRUCachePolicy``)."""

    name = "lru"

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        """Track ``key`` as most recently used (a key already tracked is just moved there)."""
        self._entries[key] = None
        self._entries.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def touch(self, keys: Iterable[Hashable]) -> None:
        entries = self._entries
        for key in reversed(list(keys)):
            if key in entries:
                entries.move_to_end(key)

    def evict(
        self,
        need: int,
        cost: Callable[[Hashable], int],
        evictable: Callable[[Hashable], bool],
        incoming: Sequence[Hashable] = (),
    ) -> list[Hashable] | None:
        if need <= 0:
            return []
        victims: list[Hashable] = []
        freed = 0
        for key in self._entries:
            if not evictable(key):
                continue
            victims.append(key)
            freed += cost(key)
            if freed >= need:
                break
        else:
            return None  # not enough evictable cost: nothing changed
        for key in victims:
            del self._entries[key]
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))
