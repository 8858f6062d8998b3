"""What keeps a READY entry from eviction, and the pages that counts: load pins, TTL pins and
the holds of expired loads.

Runs inside the storage engine (``kvserver/engine/core.py``): :class:`PinnedPages` is made and
held by the DRAM index (``index.DramIndex.pins``, whose page accounting it is part of); the
engine pins and unpins a load's entries through it, ``leases.LeaseBook`` its TTL pins and
holds. Single owner, no locks, no I/O; time is the engine's clock, passed in. Calls::

    evictable(protected)      the test of an eviction: neither pinned, held nor protected
    add_pins(entries) / drop_pins(ns, keys)   one in-flight load more / less of each entry
    extend_ttl(entry, until) / clear_ttl(entry)    an explicit TTL pin extended / dropped
    hold(ns, keys, until)     READY entries kept from eviction until then (an expired load
                              lease's quarantine: its reader may still copy out of them)
    end_holds(now)            the holds whose time is up ended

An entry is *pinned* while ``pins > 0`` or ``ttl_until > 0`` (``Entry.is_pinned``) and *held*
while ``held_until > 0`` and not pinned; the index's ``make_room`` evicts neither (the test it
hands the policy is :meth:`PinnedPages.evictable`'s).

Invariants (checked by :meth:`PinnedPages.check_invariants`, and against a recount from the
entries by ``DramIndex.check_invariants``): ``pinned_pages`` counts the pages of the pinned
entries, ``held_pages`` those of the held ones; holds end in the order they came, their times
non-decreasing, and every held entry has an item ``(held_until, [..., entry, ...])`` in
``holds`` (an entry re-held later has a later ``held_until``: its earlier item is skipped).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Hashable, Iterable, Mapping

from kvserver.engine.types import Entry, EntryState


class PinnedPages:
    """The pins, TTL pins and holds of the entries of one index (see the module docstring)."""

    def __init__(self, entries: Mapping[tuple[int, bytes], Entry]) -> None:
        self._entries = entries
        self.pinned_pages = 0
        #: READY entries held by expired load leases: (held until, entries), times ascending
        self.holds: deque[tuple[float, list[Entry]]] = deque()
        self.held_pages = 0

    def evictable(self, protected: Container[Hashable]) -> Callable[[Hashable], bool]:
        """The test ``DramIndex.make_room`` hands the policy: is the entry of an index key
        neither pinned nor held, nor a key of ``protected`` (the keys a store keeps)."""
        entries = self._entries

        def evictable(k: Hashable) -> bool:
            e = entries[k]  # type: ignore[index]
            return e.pins <= 0 and e.ttl_until <= 0.0 and (not protected or k not in protected)

        if self.holds:  # an expired load's chunks may be held: they are not evictable either

            def evictable(k: Hashable) -> bool:
                e = entries[k]  # type: ignore[index]
                return (
                    e.pins <= 0 and e.ttl_until <= 0.0 and e.held_until <= 0.0
                    and (not protected or k not in protected)
                )  # fmt: skip

        return evictable

    def add_pins(self, entries: Iterable[Entry]) -> None:
        """One more in-flight load of each of ``entries`` (+1 use each)."""
        pages = 0
        for entry in entries:
            if entry.pins <= 0 and entry.ttl_until <= 0.0:
                pages += entry.num_pages
                if entry.held_until > 0.0:
                    self.held_pages -= entry.num_pages
            entry.pins += 1
            entry.uses += 1
        self.pinned_pages += pages

    def drop_pins(self, ns: int, keys: Iterable[bytes]) -> None:
        """One in-flight load of each entry of ``keys`` finished. REQUIRES: each has
        ``pins > 0`` (taken by :meth:`add_pins`)."""
        pages = 0
        for entry in map(self._entries.__getitem__, [(ns, key) for key in keys]):
            entry.pins -= 1
            if entry.pins <= 0 and entry.ttl_until <= 0.0:
                pages += entry.num_pages
                if entry.held_until > 0.0:
                    self.held_pages += entry.num_pages
        self.pinned_pages -= pages

    def extend_ttl(self, entry: Entry, until: float) -> bool:
        """TTL-pin ``entry`` until ``until`` unless it is pinned longer; True if extended."""
        if until <= entry.ttl_until:
            return False
        if not entry.is_pinned:
            self.pinned_pages += entry.num_pages
            if entry.held_until > 0.0:
                self.held_pages -= entry.num_pages
        entry.ttl_until = until
        return True

    def clear_ttl(self, entry: Entry) -> None:
        """Drop ``entry``'s TTL pin. REQUIRES: it has one."""
        entry.ttl_until = 0.0
        if not entry.is_pinned:
            self.pinned_pages -= entry.num_pages
            if entry.held_until > 0.0:
                self.held_pages += entry.num_pages

    def hold(self, ns: int, keys: Iterable[bytes], until: float) -> int:
        """Keep the READY entries of ``keys`` from eviction until ``until`` (an expired load
        lease's quarantine: its reader may still be copying out of their pages); they stay
        READY and served. Returns how many entries were held. REQUIRES: each key is READY in
        ``ns``; ``until`` is not earlier than any earlier hold's."""
        entries = self._entries
        held = [entries[(ns, key)] for key in dict.fromkeys(keys)]
        for entry in held:
            if entry.held_until <= 0.0 and entry.pins <= 0 and entry.ttl_until <= 0.0:
                self.held_pages += entry.num_pages
            entry.held_until = until
        if held:
            self.holds.append((until, held))
        return len(held)

    def end_holds(self, now: float) -> None:
        """End the holds whose time is ``<= now``."""
        holds = self.holds
        while holds and holds[0][0] <= now:
            until, entries = holds.popleft()
            for entry in entries:
                if entry.held_until == until:  # not held again since
                    entry.held_until = 0.0
                    if entry.pins <= 0 and entry.ttl_until <= 0.0:
                        self.held_pages -= entry.num_pages

    def check_invariants(self) -> None:
        """The holds' order and items against the entries (tests; O(entries)); the page counts
        are recounted by ``DramIndex.check_invariants``."""
        hold_times = [until for until, _ in self.holds]
        assert hold_times == sorted(hold_times), "holds out of order"
        items = {(id(e), until) for until, held_entries in self.holds for e in held_entries}
        for entry in self._entries.values():
            if entry.held_until > 0.0:
                assert entry.state is EntryState.READY
                assert (id(entry), entry.held_until) in items, "a hold without its item"
