"""The storage engine: index, DRAM arena, eviction, leases, reuse gating and events.

Runs inside the daemon, on its one event loop; it is also usable as a plain library (tests,
benchmarks). It has no sockets, no threads and no locks: exactly one owner calls it.

Lifecycle of a chunk (one logical entry with one part per TP rank)::

    lookup(keys)           -> length of the leading run of READY entries
    prepare_store(keys)    -> StoreGrant | None   new entries WRITING (invisible), pages reserved
      (clients write parts into the arena, or call write_part)
    complete_store(lease, success, ranks=, keys=)  READY once every rank's part is written;
                                                   on failure the reservation is rolled back
    settle_store(lease, written)  the daemon's own fills: written READY, the rest rolled back
    prepare_load(keys)     -> LoadGrant            entries pinned (never evicted while pinned)
      (clients read parts from the arena, or call read_part)
    complete_load(lease)                           pins released
    touch(keys), pin(keys, ttl)/unpin(keys), take_events(), stats()

Lower tiers (``kvserver/daemon/tiers.py``) attach through two seams: ``on_evict`` sees every
evicted entry while its pages still hold its bytes (write-down), and ``prepare_store(...,
gated=False)`` + ``write_part`` + ``settle_store`` bring chunks back up (promotion);
``announce`` puts their events in the one gap-free event sequence.

Layout (the package ``kvserver.engine``): this module is the facade (validation, the public
calls); the mechanics sit in one module of the package per concept, each used only from here:
``index.DramIndex`` (entries, pages, eviction, page accounting; its ``pins.PinnedPages``:
what keeps an entry from eviction), ``leases.LeaseBook`` (leases,
load pins, TTL pins), ``namespaces.NamespaceTable`` (specs, ids, key validation),
``events.EngineEvents`` (the one gap-free event sequence, the eviction hook),
``stats.EngineCounters`` (the counters, per namespace and in total, and the ``stats()``
snapshot), ``parts.PartCopies`` (the engine's ``write_parts`` / ``read_parts`` ...: parts copied
in, views out, for clients that cannot map the arena), ``stores.StorePath`` (the engine's
``prepare_store`` / ``complete_store`` / ``settle_store``: reuse gating, eviction, admission);
value types and the config's checks are in ``types``.

Invariants (checked by :meth:`StorageEngine.check_invariants`, which the property test calls
after every step):
- every arena page is free, reserved (WRITING entry), ready (READY, unpinned), pinned
  (READY, pinned), held (READY: an expired load lease's quarantine) or quarantined (an expired
  reservation's); the counts add up to the total;
- lookup and prepare_load see READY entries only; WRITING entries are invisible;
- pinned and WRITING entries are never evicted; eviction frees whole entries, all or nothing;
- every READY entry is tracked by the eviction policy and no other key is;
- BlockStored / BlockRemoved events of medium CPU, replayed in order, give exactly the set of
  READY keys.
- every total counter is the sum of that counter over the namespaces (``stats.py``).

Every public method validates its whole input before changing anything: a raised
:class:`~kvserver.errors.KVServerError` means the state is unchanged. A full cache is a normal
result (``prepare_store`` returns ``None``), not an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

from kvserver.arena import SharedArena
from kvserver.engine.events import EngineEvents, EvictHook
from kvserver.engine.index import DramIndex, IndexKey
from kvserver.engine.leases import LeaseBook
from kvserver.engine.namespaces import MAX_NAMESPACES, NamespaceTable
from kvserver.engine.parts import PartCopies
from kvserver.engine.stats import EngineCounters, StorageStats, storage_stats
from kvserver.engine.stores import StorePath
from kvserver.engine.types import EngineConfig, Entry, EntryState
from kvserver.errors import CapacityError, UnknownKey
from kvserver.events import Event, Medium
from kvserver.grants import LoadGrant
from kvserver.leases import LeaseKind
from kvserver.namespace import NamespaceSpec
from kvserver.reuse import ReuseTracker

__all__ = ["IndexKey", "StorageEngine"]

logger = logging.getLogger(__name__)


class StorageEngine:
    """One DRAM tier with its index; see the module docstring for the contract."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        prefault_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """``prefault_progress(done, total)``: reports the arena's pre-fault (bytes)."""
        self.config = config = config or EngineConfig()
        self._clock = clock
        self._dram = DramIndex(config.num_pages, config.page_size, config.policy)
        self.policy = self._dram.policy
        self.allocator = self._dram.allocator
        self._pins = self._dram.pins
        self.reuse = ReuseTracker(config.store_threshold, config.max_tracker_size)
        # Last: everything that validates input runs first, so a bad config leaks no shm file.
        self.arena = SharedArena(
            config.num_pages * config.page_size,
            directory=config.shm_dir,
            progress=prefault_progress,
        )
        self._namespaces = NamespaceTable(config.max_keys_per_request)
        self._counters = EngineCounters()
        self.totals = self._counters.totals
        self._holds = LeaseBook(self._dram, self._counters, config.quarantine_s)
        self.leases = self._holds.leases
        # the payload path of clients that cannot map the arena, exposed as the engine's calls
        parts = PartCopies(self.arena, self.leases, self._namespaces, self._dram.entries)
        self.write_parts, self.write_part = parts.write_parts, parts.write_part
        self.read_parts, self.read_part = parts.read_parts, parts.read_part
        self._log = EngineEvents(self._namespaces, self._counters)
        # the store path (reservations: reuse gating, eviction, admission), the engine's calls
        stores = StorePath(
            config, clock, self._dram, self.reuse, self._namespaces, self._counters,
            self._holds, self._log,
        )  # fmt: skip
        self.prepare_store = stores.prepare_store
        self.complete_store, self.settle_store = stores.complete_store, stores.settle_store

    @property
    def on_evict(self) -> EvictHook | None:
        """Called as ``on_evict(spec, entries)`` for every eviction, after the entries left the
        index and the policy and BEFORE their pages are freed or handed to the new entries of
        the same ``prepare_store``, so it may read their bytes (``arena.views(
        entry.extents[rank])``), then and only then. It must not call back into the engine; an
        exception it raises is logged and ignored (the eviction completes regardless)."""
        return self._log.on_evict

    @on_evict.setter
    def on_evict(self, hook: EvictHook | None) -> None:
        self._log.on_evict = hook

    # ================================================================== namespaces

    def register_namespace(self, spec: NamespaceSpec) -> str:
        """Register ``spec`` (idempotent) and return its ``ns_id``.

        Raises CapacityError if one chunk (all TP parts) cannot fit in the whole arena, or
        when ``MAX_NAMESPACES`` are registered already.
        """
        ns_id = spec.ns_id
        if ns_id in self._namespaces.ids:
            return ns_id
        if len(self._namespaces.specs) >= MAX_NAMESPACES:
            raise CapacityError("too many namespaces registered", max=MAX_NAMESPACES)
        if self._dram.pages_for(spec, 1) > self.allocator.num_pages:
            raise CapacityError(
                "one chunk is larger than the whole DRAM tier",
                ns=ns_id,
                chunk_bytes=spec.part_bytes * spec.tp_world_size,
                capacity=self.config.dram_bytes,
            )
        self._namespaces.add(spec)
        self._counters.add_namespace()
        logger.info("registered namespace %s (%s, %d B/part)", ns_id, spec.model, spec.part_bytes)
        return ns_id

    def namespace(self, ns_id: str) -> NamespaceSpec:
        return self._namespaces.specs[self._ns(ns_id)]

    def lease_namespace(self, lease_id: int) -> NamespaceSpec | None:
        """The namespace of live lease ``lease_id`` (None: no such lease)."""
        lease = self.leases.find(lease_id)
        return None if lease is None else self._namespaces.specs[lease.ns]

    @property
    def namespaces(self) -> dict[str, NamespaceSpec]:
        return self._namespaces.by_id()

    def held_keys(self) -> dict[str, list[bytes]]:
        """The READY (visible) chunk keys per namespace id: what the fleet index mirrors."""
        ns_ids = self._namespaces.ns_ids
        return {ns_ids[ns]: keys for ns, keys in self._dram.ready_keys().items()}

    # ================================================================== queries

    def lookup(
        self, ns_id: str, keys: Sequence[bytes], *, record: bool = False, touch: bool = False
    ) -> int:
        """Length of the leading run of ``keys`` that are READY.

        ``record`` counts the keys as sightings for reuse gating (planning lookups do, router
        queries do not); ``touch`` also marks the hits as used for the eviction policy.
        """
        ns = self._ns(ns_id)
        self._namespaces.check_keys(ns, keys)
        hits = self._dram.ready_run(ns, keys)
        if record or touch:
            index = self._dram.entries
            for key in keys[:hits]:
                index[(ns, key)].uses += 1
        if record and self.reuse.enabled:
            self.reuse.record([(ns, k) for k in keys])
        if touch and self.policy.reads_requests:
            self.policy.lookup([(ns, k) for k in keys], hits)
        elif touch and hits:
            self.policy.touch([(ns, k) for k in keys[:hits]])
        self._counters.looked_up(ns, hits, len(keys) - hits)
        return hits

    def touch(self, ns_id: str, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` as used (first key most important). Unknown keys are ignored."""
        ns = self._ns(ns_id)
        self._namespaces.check_keys(ns, keys)
        self.policy.touch([(ns, k) for k in keys])

    def contains(self, ns_id: str, key: bytes) -> bool:
        """True if ``key`` is READY in the namespace."""
        entry = self._dram.entries.get((self._ns(ns_id), key))
        return entry is not None and entry.state is EntryState.READY

    def missing(self, ns_id: str, keys: Iterable[bytes]) -> list[bytes]:
        """The keys of ``keys`` that are not READY in the namespace, in order (``contains``
        for a batch). No side effects."""
        return self._dram.missing(self._ns(ns_id), keys)

    # ================================================================== load path

    def prepare_load(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        client: str = "",
        lease_s: float | None = None,
    ) -> LoadGrant:
        """Pin every key (each must be READY, else UnknownKey and nothing changes).

        The pins hold until complete_load(lease_id) or the lease deadline.
        """
        ns = self._ns(ns_id)
        self._namespaces.check_keys(ns, keys)
        lease_s = self.config.lease_s_of(lease_s)
        self._reap()
        held = self._dram.ready.get(ns)
        if keys and not (held and held.issuperset(keys)):  # one set test for the whole batch
            key = next(k for k in keys if not held or k not in held)
            raise UnknownKey("chunk not present", ns=ns_id, key=key)
        ikeys = [(ns, key) for key in keys]
        loaded = list(map(self._dram.entries.__getitem__, ikeys))  # every one READY
        self._pins.add_pins(loaded)
        self.policy.touch(ikeys)
        deadline = self._clock() + lease_s
        lease = self.leases.new(LeaseKind.LOAD, client, ns, list(keys), deadline)
        self._counters.loaded(ns, len(keys))
        return LoadGrant(lease.lease_id, deadline, ns_id, list(keys), [e.extents for e in loaded])

    def complete_load(self, lease_id: int) -> None:
        """Release the pins of a load lease. A finished or expired lease raises LeaseError."""
        self._reap()
        lease = self.leases.get(lease_id, LeaseKind.LOAD)
        self._pins.drop_pins(lease.ns, lease.keys)
        self.leases.end(lease, "completed")

    # ================================================================== explicit pins

    def pin(self, ns_id: str, keys: Sequence[bytes], ttl_s: float) -> int:
        """Keep the READY ``keys`` from eviction for ``ttl_s`` seconds (extends, never shortens).

        Keys that are not present are ignored; returns how many keys were pinned.
        """
        ns = self._ns(ns_id)
        self._namespaces.check_keys(ns, keys)
        ttl_s = self.config.pin_ttl_s_of(ttl_s)
        self._reap()
        return self._holds.pin_ttl(ns, keys, self._clock() + ttl_s)

    def unpin(self, ns_id: str, keys: Sequence[bytes]) -> int:
        """Drop explicit TTL pins of ``keys``; returns how many were TTL-pinned."""
        ns = self._ns(ns_id)
        self._namespaces.check_keys(ns, keys)
        self._reap()
        return self._holds.unpin_ttl(ns, keys)

    # ================================================================== maintenance

    def expire(self) -> int:
        """Reclaim expired leases and TTL pins now; returns the number of leases reclaimed."""
        return self._reap()

    def release_client(self, client: str) -> int:
        """Roll back every reservation and release every load pin held by ``client``."""
        return self._holds.release_client(client)

    def announce(self, ns_id: str, keys: Sequence[bytes], medium: Medium, *, stored: bool) -> None:
        """Emit BlockStored (``stored``) or BlockRemoved for ``keys`` of another tier (medium
        STORAGE), numbered in the engine's one gap-free event sequence. No-op without keys."""
        if keys:
            self._ns(ns_id)
            self._log.announce(ns_id, keys, medium, stored=stored)

    def take_events(self) -> list[Event]:
        """Drain the events emitted since the last call, in sequence order."""
        return self._log.take()

    def stats(self) -> StorageStats:
        """A snapshot of the pages, entries, leases and counters (O(entries))."""
        self._reap()
        return storage_stats(self._dram, self._counters, self._namespaces.specs, len(self.leases))

    def close(self) -> None:
        """Release the arena (the shared-memory file is removed). Idempotent."""
        self.arena.close()

    def __enter__(self) -> StorageEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entries(self) -> Mapping[IndexKey, Entry]:
        """Every entry, by (namespace index, key), in any state: a read-only view (tests,
        tools). Namespace indexes count registrations from 0 (:meth:`namespace_index`)."""
        return MappingProxyType(self._dram.entries)

    def namespace_index(self, ns_id: str) -> int:
        """The index of a registered namespace in :meth:`entries` and the policy's keys."""
        return self._ns(ns_id)

    def check_invariants(self) -> None:
        """Recompute the accounting from scratch and compare (tests; O(entries)); the
        counters' totals against their namespaces' counts."""
        self._dram.check_invariants()
        self._counters.check_invariants()

    # ================================================================== internals

    def _ns(self, ns_id: str) -> int:
        return self._namespaces.index_of(ns_id)

    def _reap(self) -> int:
        """Reclaim expired leases and TTL pins (called at the top of mutating calls)."""
        return self._holds.reap(self._clock())
