"""The DRAM tier's index: entries, their pages, the eviction policy and the page accounting.

Runs inside the storage engine (``kvserver/engine/core.py``), its only caller: single owner, no
locks, no I/O. It knows nothing of leases, namespaces, events or counters; the engine adds
those around each call. Call order for one chunk::

    make_room(need, ns, keep, new, protect) -> READY victims removed from index + policy, or None
    reserve(ns, spec, keys, lease_id, victims)
                                      -> WRITING entries: the victims' parts recycled, other
                                         pages taken from the allocator
    make_ready(ns, keys)              -> READY, tracked by the eviction policy
    rollback(entry, until)            -> a WRITING entry removed, its pages freed (or, with
                                         ``until``, quarantined: freed by release_quarantine)
    release_quarantine(now)           -> the quarantined pages whose time is up freed
    free(entries)                     -> the pages of evicted entries returned
    ready_run(ns, keys) / missing(ns, keys)         a lookup's leading run, a batch's misses

What keeps a READY entry from eviction (load pins, TTL pins, an expired load's hold) and the
pages that counts are ``pins`` (:class:`~kvserver.engine.pins.PinnedPages`, ``pins.py``),
which the index makes and holds: the engine and ``LeaseBook`` pin, unpin and hold through it.

Every call that takes several keys does its work for the whole batch (one allocation, one
free, one accounting update), since a batch of a co-located store or load is hundreds of keys
and this runs right after the client's copies have evicted the daemon's data from the caches.

Invariants (recomputed from scratch by :meth:`DramIndex.check_invariants`):
- every arena page is free, reserved (WRITING entry), ready (READY, unpinned, not held),
  pinned (READY, pinned), held (READY, unpinned, ``held_until > 0``: an expired load lease's
  quarantine, its reader may still copy out of it) or quarantined (an expired reservation's,
  not handed out again before its time: a stalled client may still copy into it,
  ``leases.py``); ``reserved_pages``, ``pins.pinned_pages``, ``pins.held_pages`` and
  ``quarantined_pages`` count them; held and quarantined pages are neither free nor
  evictable (a store that needs them is refused, as on a full cache); quarantines end in the
  order they came, their times non-decreasing (holds too: ``pins.py``);
- every READY entry is tracked by the policy and no other key is; ``ready[ns]`` holds exactly
  the keys of namespace ``ns``'s READY entries;
- pinned and WRITING entries are never evicted; eviction removes whole entries, all or nothing.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Container, Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import takewhile
from operator import itemgetter
from typing import cast

from kvserver.allocator import Extents, PageAllocator
from kvserver.engine.pins import PinnedPages
from kvserver.engine.types import Entry, EntryState
from kvserver.namespace import NamespaceSpec
from kvserver.policies import make_policy

#: ``(namespace index, chunk key)``: the key of the engine's index and of its policy.
IndexKey = tuple[int, bytes]


class _Protected:
    """``make_room``'s keys never chosen: ``keep``'s (ns, key) pairs, and the keys of
    ``protect`` in namespace ``ns`` (looked up in place: not copied per call)."""

    __slots__ = ("_keep", "_ns", "_protect")

    def __init__(self, keep: set[IndexKey], ns: int, protect: AbstractSet[bytes]) -> None:
        self._keep, self._ns, self._protect = keep, ns, protect

    def __bool__(self) -> bool:
        return True

    def __contains__(self, k: object) -> bool:
        if k in self._keep:
            return True
        ns, key = cast("IndexKey", k)
        return ns == self._ns and key in self._protect


class DramIndex:
    """Entries by :data:`IndexKey` over one :class:`PageAllocator` (see the module docstring)."""

    def __init__(self, num_pages: int, page_size: int, policy: str) -> None:
        self.policy = make_policy(policy)
        self.allocator = PageAllocator(num_pages, page_size)
        self.entries: dict[IndexKey, Entry] = {}
        #: per namespace, the keys of its READY entries (what a lookup may hit), kept beside
        #: ``entries`` so that a lookup finds its leading run of hits in C, with no Python loop
        #: and no (ns, key) tuple per key
        self.ready: defaultdict[int, set[bytes]] = defaultdict(set)
        self.reserved_pages = 0
        self.num_writing = 0
        #: pages of rolled-back reservations not free yet: (free at, pages), times ascending
        self._quarantine: deque[tuple[float, list[int]]] = deque()
        self.quarantined_pages = 0
        #: the pins, TTL pins and holds of the entries, and their pages
        self.pins = PinnedPages(self.entries)
        #: part size in bytes of each namespace index that reserved (a victim of the same part
        #: size hands its parts to a reservation as they are: same pages, same extents)
        self._part_bytes: dict[int, int] = {}

    # ------------------------------------------------------------------ reservation

    def pages_for(self, spec: NamespaceSpec, count: int) -> int:
        """Pages that ``count`` chunks of ``spec`` (every TP part) occupy."""
        return self.allocator.pages_for(spec.part_bytes) * spec.tp_world_size * count

    def make_room(
        self,
        need: int,
        ns: int,
        keep: Iterable[bytes],
        new: Sequence[bytes] = (),
        protect: AbstractSet[bytes] = frozenset(),
    ) -> list[Entry] | None:
        """Evict READY unpinned entries until ``need`` pages are free.

        Keys of ``keep`` (in namespace ``ns``: the request's own keys that are in the index)
        and of ``protect`` (keys of ``ns`` the caller holds on to, e.g. a peer fetch's earlier
        windows: only looked up, never copied, so a caller may grow one set across calls)
        are never chosen. ``new``: the keys the pages are for (request order), shown to a
        policy that ``admits`` (it may decline them). The victims leave the index and the
        policy and are returned in eviction order with their pages still allocated: the
        caller may read their bytes, then MUST pass them to :meth:`reserve` (which recycles
        their pages) or :meth:`free`. Returns ``[]`` if ``need`` pages are free already, and
        ``None`` — with nothing changed, not even the policy state — if they cannot be made
        free or the policy declines them.
        """
        shortfall = need - self.allocator.num_free
        if shortfall <= 0:
            return []
        entries = self.entries
        protected: Container[Hashable] = {(ns, k) for k in keep}
        if protect:
            protected = _Protected(cast("set[IndexKey]", protected), ns, protect)
        evictable = self.pins.evictable(protected)
        policy = self.policy
        if policy.admits and new:
            victims = policy.evict(shortfall, self._cost, evictable, [(ns, k) for k in new])
        else:
            victims = policy.evict(shortfall, self._cost, evictable)
        if victims is None:
            return None
        ready = self.ready
        if len(ready) == 1:  # one namespace ever held READY keys: every victim is its (in C)
            taken = cast("list[IndexKey]", victims)
            next(iter(ready.values())).difference_update(map(itemgetter(1), taken))
        else:
            for victim_ns, victim_key in cast("list[IndexKey]", victims):
                ready[victim_ns].discard(victim_key)
        return list(map(entries.pop, victims))  # type: ignore[arg-type]

    def reserve(
        self,
        ns: int,
        spec: NamespaceSpec,
        keys: list[bytes],
        lease_id: int,
        victims: Sequence[Entry] = (),
    ) -> list[list[Extents]]:
        """Add a WRITING entry per key, pages allocated; returns each key's per-rank extents.

        ``victims`` (what :meth:`make_room` returned for this reservation, pages not freed yet)
        are recycled: a victim part with the page count of a new part becomes that part as it
        is (its pages are not freed and taken again, its extents are reused when the byte
        size matches), and the victims' other pages are freed. The rest of the batch's pages
        are taken in one allocation (ascending) and cut into parts in key order, so a batch on
        free contiguous pages gets contiguous parts.
        REQUIRES: no key is in the index; :meth:`make_room` made ``pages_for(spec, len(keys))``
        pages free, counting ``victims``' pages.
        """
        allocator = self.allocator
        part_pages = allocator.pages_for(spec.part_bytes)
        world = spec.tp_world_size
        nbytes = spec.part_bytes
        self._part_bytes[ns] = nbytes
        need = world * len(keys)
        #: the batch's parts, key-major then rank: their pages and their extents
        part_pages_of: list[list[int]] = []
        part_extents: list[Extents] = []
        if victims:
            sizes = self._part_bytes
            unused: list[int] = []
            for victim in victims:
                if len(part_pages_of) >= need:
                    for pages in victim.pages:
                        unused += pages
                elif sizes[victim.ns] == nbytes:  # parts of this size: taken as they are
                    part_pages_of += victim.pages
                    part_extents += victim.extents
                else:
                    for pages in victim.pages:  # another size: its extents do not fit
                        if len(part_pages_of) < need and len(pages) == part_pages:
                            part_pages_of.append(pages)
                            part_extents.append(allocator.extents(pages, nbytes))
                        else:
                            unused += pages
            if len(part_pages_of) > need:  # a victim of another TP world size overshot
                for pages in part_pages_of[need:]:
                    unused += pages
                del part_pages_of[need:], part_extents[need:]
            if unused:
                allocator.free(unused)
        fresh = allocator.allocate(part_pages * (need - len(part_pages_of)))
        assert fresh is not None, "eviction freed less than it promised"
        page_size, last = allocator.page_size, part_pages - 1
        for pos in range(0, len(fresh), part_pages):
            pages = fresh[pos : pos + part_pages]
            first = pages[0]
            if pages[last] - first == last:  # contiguous: one extent, no per-page work
                part_extents.append(((first * page_size, nbytes),))
            else:
                part_extents.append(allocator.extents(pages, nbytes))
            part_pages_of.append(pages)
        entries = self.entries
        writing = EntryState.WRITING
        num_pages = part_pages * world
        locations: list[list[Extents]] = []
        if world == 1:
            for key, pages, extents in zip(keys, part_pages_of, part_extents, strict=True):
                where = [extents]
                entries[(ns, key)] = Entry(ns, key, writing, [pages], where, num_pages, lease_id)
                locations.append(where)
        else:
            for i, key in enumerate(keys):
                j = i * world
                where = part_extents[j : j + world]
                pages_by_rank = part_pages_of[j : j + world]
                entries[(ns, key)] = Entry(
                    ns, key, writing, pages_by_rank, where, num_pages, lease_id
                )
                locations.append(where)
        self.reserved_pages += num_pages * len(keys)
        self.num_writing += len(keys)
        return locations

    def make_ready(self, ns: int, keys: Iterable[bytes]) -> None:
        """WRITING → READY for the entries of ``keys``: visible, evictable, tracked by the
        policy as one batch in the order of ``keys`` (request order). REQUIRES: each is WRITING."""
        ready = EntryState.READY
        pages = 0
        keys = list(keys)
        ikeys = [(ns, key) for key in keys]
        for entry in map(self.entries.__getitem__, ikeys):
            entry.state = ready
            entry.lease_id = 0
            pages += entry.num_pages
        count = len(ikeys)
        self.ready[ns].update(keys)
        self.policy.insert_batch(ikeys)
        self.reserved_pages -= pages
        self.num_writing -= count

    def rollback(self, entry: Entry, until: float | None = None) -> None:
        """Remove a WRITING entry and free its pages; with ``until``, quarantine them instead
        until that time (:meth:`release_quarantine`). REQUIRES: ``entry`` is WRITING; ``until``
        is not earlier than any earlier quarantine's."""
        del self.entries[(entry.ns, entry.key)]
        self.reserved_pages -= entry.num_pages
        self.num_writing -= 1
        if until is None:
            for pages in entry.pages:
                self.allocator.free(pages)
            return
        held = [p for pages in entry.pages for p in pages]
        self._quarantine.append((until, held))
        self.quarantined_pages += len(held)

    def release_quarantine(self, now: float) -> int:
        """Free the quarantined pages whose time is ``<= now``; returns how many were freed."""
        quarantine = self._quarantine
        freed: list[int] = []
        while quarantine and quarantine[0][0] <= now:
            freed += quarantine.popleft()[1]
        if freed:
            self.allocator.free(freed)
            self.quarantined_pages -= len(freed)
        return len(freed)

    def free(self, entries: Iterable[Entry]) -> None:
        """Return the pages of entries :meth:`make_room` removed (in one call)."""
        pages = [p for entry in entries for part in entry.pages for p in part]
        if pages:
            self.allocator.free(pages)

    def _cost(self, key: Hashable) -> int:
        return self.entries[key].num_pages  # type: ignore[index]

    # ------------------------------------------------------------------ queries

    def ready_run(self, ns: int, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` READY in namespace ``ns``, counted in C (a
        whole hit in one superset test)."""
        ready = self.ready.get(ns)
        if not ready:
            return 0
        if ready.issuperset(keys):
            return len(keys)
        return len(list(takewhile(ready.__contains__, keys)))

    def missing(self, ns: int, keys: Iterable[bytes]) -> list[bytes]:
        """The keys of ``keys`` not READY in namespace ``ns``, in order (one set test per
        key, none when every key is READY)."""
        ready = self.ready.get(ns)
        if not ready:
            return list(keys)
        if not isinstance(keys, list | tuple):
            keys = list(keys)
        if ready.issuperset(keys):
            return []
        return [key for key in keys if key not in ready]

    @property
    def ready_pages(self) -> int:
        """Pages of READY unpinned entries not held (the evictable ones)."""
        used = self.allocator.num_pages - self.allocator.num_free
        return (
            used - self.reserved_pages - self.pins.pinned_pages - self.quarantined_pages
            - self.pins.held_pages
        )  # fmt: skip

    def ready_keys(self) -> dict[int, list[bytes]]:
        """The keys of READY entries per namespace index, in index order (O(entries))."""
        out: dict[int, list[bytes]] = {}
        for (ns, key), entry in self.entries.items():
            if entry.state is EntryState.READY:
                out.setdefault(ns, []).append(key)
        return out

    def ready_counts(self, num_namespaces: int) -> list[int]:
        """READY entries per namespace index (O(entries))."""
        counts = [0] * num_namespaces
        for (ns, _key), entry in self.entries.items():
            if entry.state is EntryState.READY:
                counts[ns] += 1
        return counts

    def check_invariants(self) -> None:
        """Recompute the accounting from scratch and compare (tests; O(entries)); the pins'
        holds (:meth:`PinnedPages.check_invariants`)."""
        reserved = pinned = ready = held = writing = 0
        for (ns, key), entry in self.entries.items():
            assert entry.ns == ns and entry.key == key
            n = entry.num_pages
            assert n == sum(map(len, entry.pages)), (n, entry.pages)
            if entry.state is EntryState.WRITING:
                reserved += n
                writing += 1
                assert not entry.is_pinned and (ns, key) not in self.policy
            else:
                assert (ns, key) in self.policy, "ready entry not tracked by the policy"
                if entry.is_pinned:
                    pinned += n
                elif entry.held_until > 0.0:
                    held += n
                else:
                    ready += n
        free = self.allocator.num_free
        assert reserved == self.reserved_pages, (reserved, self.reserved_pages)
        pins = self.pins
        assert pinned == pins.pinned_pages, (pinned, pins.pinned_pages)
        assert held == pins.held_pages, (held, pins.held_pages)
        assert writing == self.num_writing
        quarantined = sum(len(pages) for _, pages in self._quarantine)
        assert quarantined == self.quarantined_pages, (quarantined, self.quarantined_pages)
        times = [until for until, _ in self._quarantine]
        assert times == sorted(times), "quarantine out of order"
        assert free + reserved + pinned + ready + held + quarantined == self.allocator.num_pages
        pins.check_invariants()
        assert len(self.policy) == len(self.entries) - writing
        in_ready = {(ns, k) for ns, keys in self.ready.items() for k in keys}
        assert in_ready == {k for k, e in self.entries.items() if e.state is EntryState.READY}
