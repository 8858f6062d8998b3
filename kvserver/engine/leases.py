"""Who holds what in the DRAM tier: the lease table (store reservations, load pins) and TTL pins.

Runs inside the storage engine (``kvserver/engine/core.py``), its only caller: single owner, no
locks, no I/O; time is the engine's clock, passed in. The page accounting of a pin or a
reservation lives in :class:`~kvserver.engine.index.DramIndex` (a pin's, a TTL pin's and a
hold's in its :class:`~kvserver.engine.pins.PinnedPages`, ``pins``, where the engine pins and
unpins a load's entries directly); a store lease's part bookkeeping is the lease's own
(:class:`~kvserver.leases.Lease`). :class:`LeaseBook` decides when leases and pins end:

    roll_back(lease, keys)       remove reserved WRITING entries (complete_store failure)
    reap(now)                    expired leases: reservations rolled back (their pages
                                 quarantined), pins released (their chunks held from
                                 eviction); expired TTL pins dropped; quarantines and
                                 holds whose time is up ended
    release_client(client)       the same for every lease of one client, now
    pin_ttl(ns, keys, until)     explicit pins that extend, never shorten
    unpin_ttl(ns, keys)          drop explicit pins now

Leases themselves are a :class:`~kvserver.leases.LeaseTable` (``leases``). Reclaiming counts
in the engine's counters (``stats.EngineCounters``: ``rolled_back_chunks``,
``expired_leases``, ``released_leases``, ``quarantined_chunks``, ``quarantined_load_chunks``);
it emits no events (WRITING entries were never announced).

Quarantine: a co-located client copies into its store grant's pages in its own process, and
shared memory cannot be taken back from its mapping. A client stalled past its lease (stopped,
swapped out, a long GC pause) may still be copying when the lease expires; were the pages
handed to the next reservation at once, its late bytes would land in another key's chunk and
be served as that key. So the pages of an *expired* store reservation are quarantined for
``quarantine_s`` (the engine's ``default_lease_s``: a client late by up to another default
lease cannot write into another key's pages) before they are free again; clients check a
grant's deadline before they copy (``kvserver/client/calls.py``), so one that wakes up late
does not write at all. Quarantined pages are neither free nor evictable: a store that needs
them is refused as on a full cache until they drain, by time alone (at every reap). Pages of
reservations ended otherwise are freed at once: a failed ``complete_store``, an explicit
``release`` (the client says it is done) and a local-channel client whose process exited.

Loads alike: a co-located reader (a client, a worker) copies out of its load grant's pages
itself. When its lease *expires* (rather than ``complete_load`` or a release), the pins go,
but the chunks it named stay READY and served and are *held* from eviction for
``quarantine_s`` (``PinnedPages.hold``): a reader stalled past its deadline that is still
copying reads their bytes, never another key's written into recycled pages. Readers check
the deadline after their copy too (``kvserver/client/calls.py``, ``worker/kv_connector.py``)
and drop what finished late, so the hold covers the time between the daemon's deadline and
their check. Held pages are counted apart (``held_pages``, stats ``quarantined_load_pages``).
Every key of the expired lease is held, also one another load or a TTL pin still pins: that
pin may end before the late reader is done.

Invariants: every entry with ``ttl_until > 0`` has an item ``(ttl_until, ns, key)`` in the TTL
heap (stale items, whose entry is gone or was re-pinned, are skipped lazily); ``entry.pins`` is
the number of keys naming it over all live load leases.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence

from kvserver.engine.index import DramIndex
from kvserver.engine.stats import EngineCounters
from kvserver.engine.types import EntryState
from kvserver.leases import Lease, LeaseKind, LeaseTable

logger = logging.getLogger(__name__)


class LeaseBook:
    """The lease table and the TTL pins over one :class:`DramIndex` (see the module doc)."""

    def __init__(
        self, dram: DramIndex, counters: EngineCounters, quarantine_s: float = 0.0
    ) -> None:
        self.leases = LeaseTable()
        self.quarantine_s = quarantine_s
        self._dram = dram
        self._pins = dram.pins
        self._counters = counters
        self._ttl_heap: list[tuple[float, int, bytes]] = []

    def roll_back(self, lease: Lease, keys: Iterable[bytes], until: float | None = None) -> None:
        """Remove the WRITING entries of ``keys`` and free their pages (``until``: quarantine
        them until then). REQUIRES: ``lease`` is a store lease that still holds every key (the
        caller then drops them from it: ``lease.finish``)."""
        entries = self._dram.entries
        rolled_back = 0
        for key in keys:
            self._dram.rollback(entries[(lease.ns, key)], until)
            rolled_back += 1
        self._counters.rolled_back(lease.ns, rolled_back, quarantined=until is not None)

    def reap(self, now: float) -> int:
        """Reclaim every lease and drop every TTL pin whose deadline is ``<= now``; returns
        the number of leases reclaimed."""
        self._dram.release_quarantine(now)
        self._pins.end_holds(now)
        expired = self.leases.pop_expired(now)
        if expired:
            until = now + self.quarantine_s if self.quarantine_s > 0 else None
            for lease in expired:
                logger.debug(
                    "lease %d (%s, client %r) expired",
                    lease.lease_id, lease.kind.value, lease.client,
                )  # fmt: skip
                self._reclaim(lease, expired=True, until=until)
        self._expire_ttl(now)
        return len(expired)

    def release_client(self, client: str) -> int:
        """End every lease of ``client`` now (reservations rolled back, pins released)."""
        leases = self.leases.by_client(client)
        for lease in leases:
            self.leases.end(lease, "released")
            self._reclaim(lease, expired=False)
        return len(leases)

    def _reclaim(self, lease: Lease, *, expired: bool, until: float | None = None) -> None:
        if lease.kind is LeaseKind.LOAD:
            if until is not None:  # held first: their pages go from pinned to held at once
                self._counters.held(lease.ns, self._pins.hold(lease.ns, lease.keys, until))
            self._pins.drop_pins(lease.ns, lease.keys)
        else:
            self.roll_back(lease, lease.keys, until)
        self._counters.lease_ended(lease.ns, expired=expired)

    def pin_ttl(self, ns: int, keys: Sequence[bytes], until: float) -> int:
        """TTL-pin the READY ``keys`` until ``until`` (extends, never shortens).

        Keys that are not READY are ignored; returns how many keys are pinned until at least
        ``until``.
        """
        entries = self._dram.entries
        pinned = 0
        for key in keys:
            entry = entries.get((ns, key))
            if entry is None or entry.state is not EntryState.READY:
                continue
            if self._pins.extend_ttl(entry, until):
                heapq.heappush(self._ttl_heap, (until, ns, key))
            pinned += 1
        return pinned

    def unpin_ttl(self, ns: int, keys: Sequence[bytes]) -> int:
        """Drop the TTL pins of ``keys``; returns how many had one."""
        entries = self._dram.entries
        count = 0
        for key in keys:
            entry = entries.get((ns, key))
            if entry is not None and entry.ttl_until > 0.0:
                self._pins.clear_ttl(entry)
                count += 1
        return count

    def _expire_ttl(self, now: float) -> None:
        """Drop every TTL pin whose deadline is ``<= now``."""
        heap = self._ttl_heap
        entries = self._dram.entries
        while heap and heap[0][0] <= now:
            until, ns, key = heapq.heappop(heap)
            entry = entries.get((ns, key))
            if entry is not None and entry.ttl_until == until:
                self._pins.clear_ttl(entry)
