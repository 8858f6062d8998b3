"""The DRAM tier's index: entries, their pages, the eviction policy and the page accounting.

Runs inside the storage engine (``kvserver/engine.py``), its only caller: single owner, no
locks, no I/O. It knows nothing of leases, namespaces, events or counters; the engine adds
those around each call. Call order for one chunk::

    make_room(need, ns, keep)               -> READY victims removed from index + policy, or None
    reserve(ns, spec, keys, lease_id)       -> WRITING entries, pages taken from the allocator
    make_ready(entry)                       -> READY, tracked by the eviction policy
    rollback(entry)                         -> a WRITING entry removed, its pages freed
    free(entries)                           -> the pages of evicted entries returned
    add_pin / drop_pin / extend_ttl / clear_ttl   pinned-page accounting of READY entries

Invariants (recomputed from scratch by :meth:`DramIndex.check_invariants`):
- every arena page is free, reserved (WRITING entry), ready (READY, unpinned) or pinned
  (READY, pinned); ``reserved_pages`` and ``pinned_pages`` are the counts of the middle two;
- every READY entry is tracked by the policy and no other key is;
- pinned and WRITING entries are never evicted; eviction removes whole entries, all or nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from kvserver.allocator import Extents, PageAllocator
from kvserver.engine_types import Entry, EntryState
from kvserver.namespace import NamespaceSpec
from kvserver.policies import make_policy

#: ``(namespace index, chunk key)``: the key of the engine's index and of its policy.
IndexKey = tuple[int, bytes]


class DramIndex:
    """Entries by :data:`IndexKey` over one :class:`PageAllocator` (see the module docstring)."""

    def __init__(self, num_pages: int, page_size: int, policy: str) -> None:
        self.policy = make_policy(policy)
        self.allocator = PageAllocator(num_pages, page_size)
        self.entries: dict[IndexKey, Entry] = {}
        self.reserved_pages = 0
        self.pinned_pages = 0
        self.num_writing = 0

    # ------------------------------------------------------------------ reservation

    def pages_for(self, spec: NamespaceSpec, count: int) -> int:
        """Pages that ``count`` chunks of ``spec`` (every TP part) occupy."""
        return self.allocator.pages_for(spec.part_bytes) * spec.tp_world_size * count

    def make_room(self, need: int, ns: int, keep: Iterable[bytes]) -> list[Entry] | None:
        """Evict READY unpinned entries until ``need`` pages are free.

        Keys of ``keep`` (in namespace ``ns``: the request's own keys) are never chosen. The
        victims leave the index and the policy and are returned in eviction order with their
        pages still allocated: the caller may read their bytes, then MUST call :meth:`free`.
        Returns ``[]`` if ``need`` pages are free already, and ``None`` — with nothing changed,
        not even the policy state — if they cannot be made free.
        """
        shortfall = need - self.allocator.num_free
        if shortfall <= 0:
            return []
        entries = self.entries
        protected = {(ns, k) for k in keep}
        victims = self.policy.evict(
            shortfall,
            self._cost,
            lambda k: k not in protected and not entries[k].is_pinned,  # type: ignore[index]
        )
        if victims is None:
            return None
        return [entries.pop(victim) for victim in victims]  # type: ignore[call-overload]

    def reserve(
        self, ns: int, spec: NamespaceSpec, keys: list[bytes], lease_id: int
    ) -> list[list[Extents]]:
        """Add a WRITING entry per key, pages allocated; returns each key's per-rank extents.

        REQUIRES: no key is in the index; :meth:`make_room` made ``pages_for(spec, len(keys))``
        pages free.
        """
        allocator = self.allocator
        part_pages = allocator.pages_for(spec.part_bytes)
        locations: list[list[Extents]] = []
        for key in keys:
            pages: list[list[int]] = []
            extents: list[Extents] = []
            for _rank in range(spec.tp_world_size):
                got = allocator.allocate(part_pages)
                assert got is not None, "eviction freed less than it promised"
                pages.append(got)
                extents.append(allocator.extents(got, spec.part_bytes))
            self.entries[(ns, key)] = Entry(ns, key, EntryState.WRITING, pages, extents, lease_id)
            locations.append(extents)
        self.reserved_pages += part_pages * spec.tp_world_size * len(keys)
        self.num_writing += len(keys)
        return locations

    def make_ready(self, entry: Entry) -> None:
        """WRITING → READY: visible, evictable, tracked by the policy."""
        entry.state = EntryState.READY
        entry.lease_id = 0
        self.reserved_pages -= entry.num_pages
        self.num_writing -= 1
        self.policy.insert((entry.ns, entry.key))

    def rollback(self, entry: Entry) -> None:
        """Remove a WRITING entry and free its pages. REQUIRES: ``entry`` is WRITING."""
        del self.entries[(entry.ns, entry.key)]
        self.reserved_pages -= entry.num_pages
        self.num_writing -= 1
        for pages in entry.pages:
            self.allocator.free(pages)

    def free(self, entries: Iterable[Entry]) -> None:
        """Return the pages of entries :meth:`make_room` removed."""
        for entry in entries:
            for pages in entry.pages:
                self.allocator.free(pages)

    def _cost(self, key: Hashable) -> int:
        return self.entries[key].num_pages  # type: ignore[index]

    # ------------------------------------------------------------------ pin accounting

    def add_pin(self, entry: Entry) -> None:
        """One more in-flight load of ``entry``."""
        if not entry.is_pinned:
            self.pinned_pages += entry.num_pages
        entry.pins += 1

    def drop_pin(self, entry: Entry) -> None:
        """One in-flight load of ``entry`` finished. REQUIRES: ``entry.pins > 0``."""
        entry.pins -= 1
        if not entry.is_pinned:
            self.pinned_pages -= entry.num_pages

    def extend_ttl(self, entry: Entry, until: float) -> bool:
        """TTL-pin ``entry`` until ``until`` unless it is pinned longer; True if extended."""
        if until <= entry.ttl_until:
            return False
        if not entry.is_pinned:
            self.pinned_pages += entry.num_pages
        entry.ttl_until = until
        return True

    def clear_ttl(self, entry: Entry) -> None:
        """Drop ``entry``'s TTL pin. REQUIRES: it has one."""
        entry.ttl_until = 0.0
        if not entry.is_pinned:
            self.pinned_pages -= entry.num_pages

    # ------------------------------------------------------------------ queries

    @property
    def ready_pages(self) -> int:
        """Pages of READY unpinned entries (the evictable ones)."""
        used = self.allocator.num_pages - self.allocator.num_free
        return used - self.reserved_pages - self.pinned_pages

    def ready_counts(self, num_namespaces: int) -> list[int]:
        """READY entries per namespace index (O(entries))."""
        counts = [0] * num_namespaces
        for (ns, _key), entry in self.entries.items():
            if entry.state is EntryState.READY:
                counts[ns] += 1
        return counts

    def check_invariants(self) -> None:
        """Recompute the accounting from scratch and compare (tests; O(entries))."""
        reserved = pinned = ready = writing = 0
        for (ns, key), entry in self.entries.items():
            assert entry.ns == ns and entry.key == key
            n = entry.num_pages
            if entry.state is EntryState.WRITING:
                reserved += n
                writing += 1
                assert not entry.is_pinned and (ns, key) not in self.policy
            else:
                assert (ns, key) in self.policy, "ready entry not tracked by the policy"
                if entry.is_pinned:
                    pinned += n
                else:
                    ready += n
        free = self.allocator.num_free
        assert reserved == self.reserved_pages, (reserved, self.reserved_pages)
        assert pinned == self.pinned_pages, (pinned, self.pinned_pages)
        assert writing == self.num_writing
        assert free + reserved + pinned + ready == self.allocator.num_pages
        assert len(self.policy) == len(self.entries) - writing
