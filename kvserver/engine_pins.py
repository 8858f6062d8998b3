"""Who holds what in the DRAM tier: leases (store reservations, load pins) and TTL pins.

Runs inside the storage engine (``kvserver/engine.py``), its only caller: single owner, no
locks, no I/O; time is the engine's clock, passed in. The page accounting of a pin or a
reservation lives in :class:`~kvserver.engine_index.DramIndex`; this module decides when they
come and go:

    pin_load(entries)            one pin per entry for a load lease (+1 use each)
    release_load(lease)          drop them (complete_load)
    roll_back(lease, keys)       remove reserved WRITING entries (complete_store failure)
    reap(now)                    expired leases: reservations rolled back, pins released;
                                 expired TTL pins dropped
    release_client(client)       the same for every lease of one client, now
    pin_ttl(ns, keys, until)     explicit pins that extend, never shorten
    unpin_ttl(ns, keys)          drop explicit pins now

Leases themselves are a :class:`~kvserver.leases.LeaseTable` (``leases``). The functions
:func:`select_ranks`, :func:`select_keys`, :func:`record_parts` and :func:`check_store_part`
track which parts of a store lease are written; the checks raise before anything changes.
Reclaiming bumps the namespace counters (``rolled_back_chunks``, ``expired_leases``,
``released_leases``); it emits no events (WRITING entries were never announced).

Invariants: every entry with ``ttl_until > 0`` has an item ``(ttl_until, ns, key)`` in the TTL
heap (stale items, whose entry is gone or was re-pinned, are skipped lazily); ``entry.pins`` is
the number of keys naming it over all live load leases.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence

from kvserver.engine_index import DramIndex
from kvserver.engine_namespaces import NamespaceTable
from kvserver.engine_types import Entry, EntryState
from kvserver.errors import InvalidArgument, InvalidState
from kvserver.leases import Lease, LeaseKind, LeaseTable

logger = logging.getLogger(__name__)


class PinBook:
    """The lease table and the TTL pins over one :class:`DramIndex` (see the module doc)."""

    def __init__(self, dram: DramIndex, namespaces: NamespaceTable) -> None:
        self.leases = LeaseTable()
        self._dram = dram
        self._namespaces = namespaces
        self._ttl_heap: list[tuple[float, int, bytes]] = []

    def pin_load(self, entries: Iterable[Entry]) -> None:
        """Pin each entry once more and count the use. REQUIRES: every entry is READY."""
        self._dram.add_pins(entries)

    def release_load(self, lease: Lease) -> None:
        """Drop the pins of a load lease (one per key). REQUIRES: taken by :meth:`pin_load`."""
        self._dram.drop_pins(lease.ns, lease.keys)

    def roll_back(self, lease: Lease, keys: Iterable[bytes]) -> None:
        """Remove the WRITING entries of ``keys``, free their pages and forget their progress.
        REQUIRES: ``lease`` is a store lease that still holds every key (the caller then drops
        them from it)."""
        entries = self._dram.entries
        done = lease.done_ranks
        rolled_back = 0
        for key in keys:
            done.pop(key, None)
            self._dram.rollback(entries[(lease.ns, key)])
            rolled_back += 1
        for c in self._namespaces.pair(lease.ns):
            c.rolled_back_chunks += rolled_back

    def reap(self, now: float) -> int:
        """Reclaim every lease and drop every TTL pin whose deadline is ``<= now``; returns
        the number of leases reclaimed."""
        expired = self.leases.pop_expired(now)
        for lease in expired:
            logger.debug(
                "lease %d (%s, client %r) expired", lease.lease_id, lease.kind.value, lease.client
            )
            self._reclaim(lease, expired=True)
        self._expire_ttl(now)
        return len(expired)

    def release_client(self, client: str) -> int:
        """End every lease of ``client`` now (reservations rolled back, pins released)."""
        leases = self.leases.by_client(client)
        for lease in leases:
            self.leases.end(lease, "released")
            self._reclaim(lease, expired=False)
        return len(leases)

    def _reclaim(self, lease: Lease, *, expired: bool) -> None:
        if lease.kind is LeaseKind.LOAD:
            self.release_load(lease)
        else:
            self.roll_back(lease, lease.keys)
        for c in self._namespaces.pair(lease.ns):
            if expired:
                c.expired_leases += 1
            else:
                c.released_leases += 1

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
            if self._dram.extend_ttl(entry, until):
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
                self._dram.clear_ttl(entry)
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
                self._dram.clear_ttl(entry)


# ---------------------------------------------------------------------- store-lease validation


def select_ranks(lease: Lease, ranks: Iterable[int] | None, world: int) -> int:
    """Bit mask of the TP ranks ``ranks`` names (``None``: every rank of ``world``)."""
    if ranks is None:
        return (1 << world) - 1
    mask = 0
    ranks = list(ranks)
    if not ranks:
        raise InvalidArgument("ranks must name at least one rank", lease=lease.lease_id)
    for r in ranks:
        if type(r) is not int or not 0 <= r < world:
            raise InvalidArgument("rank out of range", rank=r, tp_world_size=world)
        mask |= 1 << r
    return mask


def select_keys(lease: Lease, keys: Iterable[bytes] | None) -> list[bytes]:
    """The keys ``keys`` names, duplicates removed (``None``: every key still in the lease)."""
    if keys is None:
        return list(lease.keys)
    selected = list(dict.fromkeys(keys))
    in_lease = set(lease.keys)
    for key in selected:
        if key not in in_lease:
            raise InvalidArgument(
                "key is not reserved by this lease", key=key, lease=lease.lease_id
            )
    return selected


def record_parts(lease: Lease, keys: list[bytes], mask: int, world: int) -> list[bytes]:
    """Record the parts ``mask`` of ``keys`` as written; returns the keys now complete.

    Atomic: raises InvalidState, with nothing recorded, if any of those parts was recorded
    before. A complete key's progress is forgotten (it is the caller's to make READY).
    """
    done = lease.done_ranks
    for key in keys:
        if done.get(key, 0) & mask:
            raise InvalidState("part completed twice", key=key, lease=lease.lease_id)
    all_mask = (1 << world) - 1
    complete: list[bytes] = []
    for key in keys:
        got = done.get(key, 0) | mask
        if got == all_mask:
            done.pop(key, None)
            complete.append(key)
        else:
            done[key] = got
    return complete


def finish_keys(lease: Lease, keys: Iterable[bytes]) -> None:
    """Drop ``keys`` (completed or rolled back, their progress forgotten) from a store lease."""
    finished = set(keys)
    lease.keys = [k for k in lease.keys if k not in finished]


def check_store_part(lease: Lease, key: bytes, rank: int, world: int) -> None:
    """Raise unless ``rank``'s part of ``key`` is reserved by ``lease`` and not written yet."""
    if type(rank) is not int or not 0 <= rank < world:
        raise InvalidArgument("rank out of range", rank=rank)
    if key not in lease.keys:
        raise InvalidArgument("key is not reserved by this lease", key=key, lease=lease.lease_id)
    if lease.done_ranks.get(key, 0) >> rank & 1:
        raise InvalidState("part already completed", key=key, rank=rank)
