"""What the storage engine reports: its monotonic counters (:class:`EngineCounters`, their one
owner) and the snapshot ``StorageEngine.stats()`` returns (:class:`StorageStats`, made by
:func:`storage_stats` from the counters and the DRAM index's page accounting).

Runs inside the storage engine (``kvserver/engine/core.py``): single owner, no locks. The engine
counts lookups, loads, filtered and rejected stores; ``EngineEvents`` (``events.py``)
stored and evicted chunks; ``LeaseBook`` (``leases.py``) roll-backs, quarantines and
ended leases: each through one method of :class:`EngineCounters` named for what happened,
which bumps the namespace's counters and the totals alike.

Invariants: ``per_namespace[i]`` counts namespace index ``i`` (one appended per registration,
never removed, parallel to ``NamespaceTable.specs``); every field of ``totals`` is the sum of
that field over ``per_namespace``; no counter ever decreases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvserver.engine.index import DramIndex
from kvserver.namespace import NamespaceSpec

__all__ = ["Counters", "EngineCounters", "StorageStats", "storage_stats"]


@dataclass(slots=True)
class Counters:
    """Monotonic counters (per namespace and totals)."""

    lookups: int = 0
    hit_chunks: int = 0
    miss_chunks: int = 0
    stored_chunks: int = 0
    loaded_chunks: int = 0
    evicted_chunks: int = 0
    rolled_back_chunks: int = 0
    #: of those, the chunks of expired reservations whose pages were quarantined
    quarantined_chunks: int = 0
    #: chunks of expired load leases kept from eviction for the quarantine (a late reader)
    quarantined_load_chunks: int = 0
    expired_leases: int = 0
    released_leases: int = 0
    filtered_chunks: int = 0
    store_rejections: int = 0


#: the names of the counters, in declaration order
COUNTER_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Counters))


@dataclass(frozen=True, slots=True)
class StorageStats:
    capacity_bytes: int
    page_size: int
    total_pages: int
    free_pages: int
    reserved_pages: int
    ready_pages: int
    pinned_pages: int
    #: pages of expired reservations not free yet (``leases.py``)
    quarantined_pages: int
    #: pages of READY chunks that only an expired load lease's quarantine keeps from
    #: eviction (served as usual; evictable again when it ends)
    quarantined_load_pages: int
    num_entries: int
    num_writing: int
    num_leases: int
    policy: str
    totals: Counters
    namespaces: dict[str, dict[str, int]]

    @property
    def used_bytes(self) -> int:
        return (self.total_pages - self.free_pages) * self.page_size

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["used_bytes"] = self.used_bytes
        return out


class EngineCounters:
    """The engine's counters, per namespace index and in total (see the module docstring)."""

    def __init__(self) -> None:
        self.totals = Counters()
        self.per_namespace: list[Counters] = []

    def add_namespace(self) -> None:
        """Counters for the next namespace index (at its registration)."""
        self.per_namespace.append(Counters())

    def looked_up(self, ns: int, hits: int, misses: int) -> None:
        """One lookup of ``hits + misses`` keys, its leading ``hits`` READY."""
        for c in (self.totals, self.per_namespace[ns]):
            c.lookups += 1
            c.hit_chunks += hits
            c.miss_chunks += misses

    def store_rejected(self, ns: int) -> None:
        """A store found no room (``prepare_store`` returned None)."""
        for c in (self.totals, self.per_namespace[ns]):
            c.store_rejections += 1

    def filtered(self, ns: int, count: int) -> None:
        """``count`` keys of a store not admitted (reuse gating, a policy that admits)."""
        for c in (self.totals, self.per_namespace[ns]):
            c.filtered_chunks += count

    def loaded(self, ns: int, count: int) -> None:
        """``count`` chunks pinned for a load."""
        for c in (self.totals, self.per_namespace[ns]):
            c.loaded_chunks += count

    def stored(self, ns: int, count: int) -> None:
        """``count`` chunks became READY in DRAM."""
        for c in (self.totals, self.per_namespace[ns]):
            c.stored_chunks += count

    def evicted(self, ns: int, count: int) -> None:
        """``count`` READY chunks left DRAM to make room."""
        for c in (self.totals, self.per_namespace[ns]):
            c.evicted_chunks += count

    def rolled_back(self, ns: int, count: int, *, quarantined: bool) -> None:
        """``count`` reserved chunks rolled back (``quarantined``: their pages held for the
        quarantine, an expired reservation's)."""
        for c in (self.totals, self.per_namespace[ns]):
            c.rolled_back_chunks += count
            if quarantined:
                c.quarantined_chunks += count

    def held(self, ns: int, count: int) -> None:
        """``count`` chunks of an expired load lease kept from eviction for the quarantine."""
        for c in (self.totals, self.per_namespace[ns]):
            c.quarantined_load_chunks += count

    def lease_ended(self, ns: int, *, expired: bool) -> None:
        """A lease reclaimed: ``expired``, or released with its client."""
        for c in (self.totals, self.per_namespace[ns]):
            if expired:
                c.expired_leases += 1
            else:
                c.released_leases += 1

    def check_invariants(self) -> None:
        """Every total is the sum of that counter over the namespaces (tests)."""
        for name in COUNTER_NAMES:
            total = sum(getattr(c, name) for c in self.per_namespace)
            assert getattr(self.totals, name) == total, (name, getattr(self.totals, name), total)

    def snapshot(self) -> Counters:
        """A copy of the totals (a value of its own: later counts do not change it)."""
        totals = self.totals
        return Counters(**{name: getattr(totals, name) for name in COUNTER_NAMES})

    def rows(
        self, specs: Sequence[NamespaceSpec], ready_counts: Sequence[int]
    ) -> dict[str, dict[str, int]]:
        """Per namespace id: every counter, plus READY ``entries`` and their ``bytes``
        (``specs`` and ``ready_counts`` by namespace index)."""
        rows: dict[str, dict[str, int]] = {}
        for ns, spec in enumerate(specs):
            counters = self.per_namespace[ns]
            row = {name: getattr(counters, name) for name in COUNTER_NAMES}
            row["entries"] = ready_counts[ns]
            row["bytes"] = ready_counts[ns] * spec.part_bytes * spec.tp_world_size
            rows[spec.ns_id] = row
        return rows


def storage_stats(
    dram: DramIndex, counters: EngineCounters, specs: Sequence[NamespaceSpec], num_leases: int
) -> StorageStats:
    """The engine's snapshot: ``dram``'s pages and entries, ``counters`` (``specs`` by namespace
    index), ``num_leases`` live. O(entries): the READY entries per namespace are counted."""
    allocator = dram.allocator
    return StorageStats(
        capacity_bytes=allocator.num_pages * allocator.page_size,
        page_size=allocator.page_size,
        total_pages=allocator.num_pages,
        free_pages=allocator.num_free,
        reserved_pages=dram.reserved_pages,
        ready_pages=dram.ready_pages,
        pinned_pages=dram.pins.pinned_pages,
        quarantined_pages=dram.quarantined_pages,
        quarantined_load_pages=dram.pins.held_pages,
        num_entries=len(dram.entries) - dram.num_writing,
        num_writing=dram.num_writing,
        num_leases=num_leases,
        policy=dram.policy.name,
        totals=counters.snapshot(),
        namespaces=counters.rows(specs, dram.ready_counts(len(specs))),
    )
