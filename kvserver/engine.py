"""The storage engine: index, DRAM arena, eviction, leases, reuse gating and events.

Runs inside the daemon, on its one event loop; it is also usable as a plain library (tests,
benchmarks). It has no sockets, no threads and no locks: exactly one owner calls it.

Lifecycle of a chunk (seed 000 §7, one logical entry with one part per TP rank)::

    lookup(keys)           -> length of the leading run of READY entries
    prepare_store(keys)    -> StoreGrant | None   new entries WRITING (invisible), pages reserved
      (clients write parts into the arena, or call write_part)
    complete_store(lease, success, ranks=, keys=)  READY once every rank's part is written;
                                                   on failure the reservation is rolled back
    prepare_load(keys)     -> LoadGrant            entries pinned (never evicted while pinned)
      (clients read parts from the arena, or call read_part)
    complete_load(lease)                           pins released
    touch(keys), pin(keys, ttl)/unpin(keys), take_events(), stats()

Lower tiers (the SSD tier, ``kvserver/daemon/tiering.py``) attach through two seams: the
``on_evict`` hook sees every evicted entry while its pages still hold its bytes (write-back),
and ``prepare_store(..., gated=False)`` + ``write_part`` + ``complete_store`` bring a chunk
back up (promotion); ``announce`` puts their events in the one gap-free event sequence.

Invariants (checked by :meth:`StorageEngine.check_invariants`, which the property test calls
after every step):
- every arena page is free, reserved (WRITING entry), ready (READY, unpinned) or pinned
  (READY, pinned); the four counts add up to the total;
- lookup and prepare_load see READY entries only; WRITING entries are invisible;
- pinned and WRITING entries are never evicted; eviction frees whole entries, all or nothing;
- every READY entry is tracked by the eviction policy and no other key is;
- BlockStored / BlockRemoved events of medium CPU, replayed in order, give exactly the set of
  READY keys.

Every public method validates its whole input before changing anything: a raised
:class:`~kvserver.errors.KVServerError` means the state is unchanged. A full cache is a normal
result (``prepare_store`` returns ``None``), not an error.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

from kvserver.allocator import Extents, PageAllocator
from kvserver.arena import SharedArena
from kvserver.engine_types import (
    Counters,
    EngineConfig,
    EngineStats,
    Entry,
    EntryState,
    LoadGrant,
    StoreGrant,
)
from kvserver.errors import (
    CapacityError,
    InvalidArgument,
    InvalidState,
    UnknownKey,
    UnknownNamespace,
)
from kvserver.events import MEDIUM_DRAM, BlockRemoved, BlockStored, Event, Medium
from kvserver.leases import Lease, LeaseKind, LeaseTable
from kvserver.namespace import NamespaceSpec
from kvserver.policies import make_policy
from kvserver.reuse import ReuseTracker

logger = logging.getLogger(__name__)

IndexKey = tuple[int, bytes]


class StorageEngine:
    """One DRAM tier with its index; see the module docstring for the contract."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config = config or EngineConfig()
        self._clock = clock
        self.policy = make_policy(config.policy)
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        self.reuse = ReuseTracker(config.store_threshold, config.max_tracker_size)
        # Last: everything that validates input runs first, so a bad config leaks no shm file.
        self.arena = SharedArena(config.num_pages * config.page_size, directory=config.shm_dir)
        self.leases = LeaseTable()
        self._specs: list[NamespaceSpec] = []
        self._ns_index: dict[str, int] = {}
        self._index: dict[IndexKey, Entry] = {}
        self._ttl_heap: list[tuple[float, int, bytes]] = []
        self._events: list[Event] = []
        self._next_seq = 1
        self._reserved_pages = 0
        self._pinned_pages = 0
        self._num_writing = 0
        self.totals = Counters()
        self._ns_counters: list[Counters] = []
        #: called as ``on_evict(spec, entries)`` for every eviction, after the entries left the
        #: index and the policy and BEFORE their pages are freed, so it may read their bytes
        #: (``arena.views(entry.extents[rank])``). It must not call back into the engine; an
        #: exception it raises is logged and ignored (the eviction completes regardless).
        self.on_evict: Callable[[NamespaceSpec, list[Entry]], None] | None = None

    # ================================================================== namespaces

    def register_namespace(self, spec: NamespaceSpec) -> str:
        """Register ``spec`` (idempotent) and return its ``ns_id``.

        Raises CapacityError if one chunk (all TP parts) cannot fit in the whole arena.
        """
        ns_id = spec.ns_id
        if ns_id in self._ns_index:
            return ns_id
        pages = self.allocator.pages_for(spec.part_bytes) * spec.tp_world_size
        if pages > self.allocator.num_pages:
            raise CapacityError(
                "one chunk is larger than the whole DRAM tier",
                ns=ns_id,
                chunk_bytes=spec.part_bytes * spec.tp_world_size,
                capacity=self.config.dram_bytes,
            )
        self._ns_index[ns_id] = len(self._specs)
        self._specs.append(spec)
        self._ns_counters.append(Counters())
        logger.info("registered namespace %s (%s, %d B/part)", ns_id, spec.model, spec.part_bytes)
        return ns_id

    def namespace(self, ns_id: str) -> NamespaceSpec:
        return self._specs[self._ns(ns_id)]

    @property
    def namespaces(self) -> dict[str, NamespaceSpec]:
        return {spec.ns_id: spec for spec in self._specs}

    # ================================================================== queries

    def lookup(
        self, ns_id: str, keys: Sequence[bytes], *, record: bool = False, touch: bool = False
    ) -> int:
        """Length of the leading run of ``keys`` that are READY.

        ``record`` counts the keys as sightings for reuse gating (planning lookups do, router
        queries do not); ``touch`` also marks the hits as used for the eviction policy.
        """
        ns = self._ns(ns_id)
        self._check_keys(ns, keys)
        index = self._index
        hits = 0
        count_use = record or touch
        for key in keys:
            entry = index.get((ns, key))
            if entry is None or entry.state is not EntryState.READY:
                break
            if count_use:
                entry.uses += 1
            hits += 1
        if record and self.reuse.enabled:
            self.reuse.record([(ns, k) for k in keys])
        if touch and hits:
            self.policy.touch([(ns, k) for k in keys[:hits]])
        for c in (self.totals, self._ns_counters[ns]):
            c.lookups += 1
            c.hit_chunks += hits
            c.miss_chunks += len(keys) - hits
        return hits

    def touch(self, ns_id: str, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` as used (first key most important). Unknown keys are ignored."""
        ns = self._ns(ns_id)
        self._check_keys(ns, keys)
        self.policy.touch([(ns, k) for k in keys])

    def contains(self, ns_id: str, key: bytes) -> bool:
        """True if ``key`` is READY in the namespace."""
        entry = self._index.get((self._ns(ns_id), key))
        return entry is not None and entry.state is EntryState.READY

    # ================================================================== store path

    def prepare_store(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        client: str = "",
        lease_s: float | None = None,
        gated: bool = True,
    ) -> StoreGrant | None:
        """Reserve space for the keys that are not present yet.

        Keys already present (READY or WRITING) and keys refused by reuse gating are skipped
        (``gated=False`` bypasses reuse gating: promotions of chunks a lower tier holds).
        If free space is short, READY unpinned entries are evicted (never keys of this request).
        Returns ``None`` — with nothing changed, not even the policy state — if space for every
        new key cannot be found. New entries are WRITING and invisible until complete_store.
        """
        ns = self._ns(ns_id)
        spec = self._specs[ns]
        self._check_keys(ns, keys)
        lease_s = self._check_lease_s(lease_s)
        self._reap()
        index = self._index
        new_keys: list[bytes] = []
        present: list[bytes] = []
        filtered: list[bytes] = []
        seen: set[bytes] = set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            if (ns, key) in index:
                present.append(key)
            elif gated and not self.reuse.admits((ns, key)):
                filtered.append(key)
            else:
                new_keys.append(key)
        counters = (self.totals, self._ns_counters[ns])
        if not new_keys:
            for c in counters:
                c.filtered_chunks += len(filtered)
            return StoreGrant(0, 0.0, ns_id, [], [], present, filtered, 0)

        part_pages = self.allocator.pages_for(spec.part_bytes)
        need = part_pages * spec.tp_world_size * len(new_keys)
        num_evicted = 0
        shortfall = need - self.allocator.num_free
        if shortfall > 0:
            protected = {(ns, k) for k in seen}
            victims = self.policy.evict(
                shortfall,
                self._entry_cost,
                lambda k: k not in protected and not index[k].is_pinned,  # type: ignore[index]
            )
            if victims is None:
                for c in counters:
                    c.store_rejections += 1
                return None
            self._drop_evicted(victims)
            num_evicted = len(victims)
        for c in counters:
            c.filtered_chunks += len(filtered)

        deadline = self._clock() + lease_s
        lease = self.leases.new(LeaseKind.STORE, client, ns, new_keys, deadline)
        locations: list[list[Extents]] = []
        for key in new_keys:
            pages: list[list[int]] = []
            extents: list[Extents] = []
            for _rank in range(spec.tp_world_size):
                got = self.allocator.allocate(part_pages)
                assert got is not None, "eviction freed less than it promised"
                pages.append(got)
                extents.append(self.allocator.extents(got, spec.part_bytes))
            index[(ns, key)] = Entry(ns, key, EntryState.WRITING, pages, extents, lease.lease_id)
            locations.append(extents)
        self._reserved_pages += need
        self._num_writing += len(new_keys)
        return StoreGrant(
            lease.lease_id,
            deadline,
            ns_id,
            list(new_keys),
            locations,
            present,
            filtered,
            num_evicted,
        )

    def complete_store(
        self,
        lease_id: int,
        *,
        success: bool = True,
        ranks: Iterable[int] | None = None,
        keys: Iterable[bytes] | None = None,
    ) -> list[bytes]:
        """Mark parts written (``success``) or roll the reservation back (``not success``).

        ``ranks`` (default: every rank) and ``keys`` (default: every key still WRITING in the
        lease) select the parts. An entry becomes READY when all its ranks are written; the
        keys that became READY are returned (and announced with one BlockStored event). A
        failure rolls back the selected keys entirely, whatever the ranks. Completing a part
        twice raises InvalidState; an unknown/finished/expired lease raises LeaseError.
        """
        self._reap()
        lease = self.leases.get(lease_id, LeaseKind.STORE)
        spec = self._specs[lease.ns]
        world = spec.tp_world_size
        all_mask = (1 << world) - 1
        if ranks is None:
            mask = all_mask
        else:
            mask = 0
            ranks = list(ranks)
            if not ranks:
                raise InvalidArgument("ranks must name at least one rank", lease=lease_id)
            for r in ranks:
                if type(r) is not int or not 0 <= r < world:
                    raise InvalidArgument("rank out of range", rank=r, tp_world_size=world)
                mask |= 1 << r
        if keys is None:
            selected = list(lease.keys)
        else:
            selected = list(dict.fromkeys(keys))
            in_lease = set(lease.keys)
            for key in selected:
                if key not in in_lease:
                    raise InvalidArgument(
                        "key is not reserved by this lease", key=key, lease=lease_id
                    )
        done = lease.done_ranks
        if success:
            for key in selected:
                if done.get(key, 0) & mask:
                    raise InvalidState("part completed twice", key=key, lease=lease_id)
        ns = lease.ns
        became_ready: list[bytes] = []
        if success:
            for key in selected:
                got = done.get(key, 0) | mask
                if got == all_mask:
                    done.pop(key, None)
                    self._make_ready(self._index[(ns, key)])
                    became_ready.append(key)
                else:
                    done[key] = got
        else:
            for key in selected:
                done.pop(key, None)
                self._rollback(self._index[(ns, key)])
        finished = set(became_ready) if success else set(selected)
        lease.keys = [k for k in lease.keys if k not in finished]
        if not lease.keys:
            self.leases.end(lease, "completed")
        if became_ready:
            self._emit(BlockStored(self._seq(), spec.ns_id, tuple(became_ready), MEDIUM_DRAM))
            for c in (self.totals, self._ns_counters[ns]):
                c.stored_chunks += len(became_ready)
        return became_ready

    def write_part(self, lease_id: int, key: bytes, rank: int, data: bytes | memoryview) -> None:
        """Copy one part's payload into the arena (remote clients). Does not complete it."""
        entry = self._writing_entry(lease_id, key, rank)
        spec = self._specs[entry.ns]
        if memoryview(data).nbytes != spec.part_bytes:
            raise InvalidArgument(
                "payload size does not match the part size",
                size=memoryview(data).nbytes,
                part_bytes=spec.part_bytes,
            )
        self.arena.write(entry.extents[rank], data)

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
        self._check_keys(ns, keys)
        lease_s = self._check_lease_s(lease_s)
        self._reap()
        index = self._index
        entries: list[Entry] = []
        for key in keys:
            entry = index.get((ns, key))
            if entry is None or entry.state is not EntryState.READY:
                raise UnknownKey("chunk not present", ns=ns_id, key=key)
            entries.append(entry)
        for entry in entries:
            self._add_pin(entry)
            entry.uses += 1
        self.policy.touch([(ns, k) for k in keys])
        deadline = self._clock() + lease_s
        lease = self.leases.new(LeaseKind.LOAD, client, ns, list(keys), deadline)
        for c in (self.totals, self._ns_counters[ns]):
            c.loaded_chunks += len(keys)
        return LoadGrant(lease.lease_id, deadline, ns_id, list(keys), [e.extents for e in entries])

    def complete_load(self, lease_id: int) -> None:
        """Release the pins of a load lease. A finished or expired lease raises LeaseError."""
        self._reap()
        lease = self.leases.get(lease_id, LeaseKind.LOAD)
        self._release_load(lease)
        self.leases.end(lease, "completed")

    def read_part(self, lease_id: int, key: bytes, rank: int) -> list[memoryview]:
        """Zero-copy views of one pinned part (remote clients); valid while the lease lives."""
        lease = self.leases.get(lease_id, LeaseKind.LOAD)
        spec = self._specs[lease.ns]
        if type(rank) is not int or not 0 <= rank < spec.tp_world_size:
            raise InvalidArgument("rank out of range", rank=rank)
        if key not in lease.keys:
            raise InvalidArgument("key is not pinned by this lease", key=key, lease=lease_id)
        return self.arena.views(self._index[(lease.ns, key)].extents[rank])

    # ================================================================== explicit pins

    def pin(self, ns_id: str, keys: Sequence[bytes], ttl_s: float) -> int:
        """Keep the READY ``keys`` from eviction for ``ttl_s`` seconds (extends, never shortens).

        Keys that are not present are ignored; returns how many keys were pinned.
        """
        ns = self._ns(ns_id)
        self._check_keys(ns, keys)
        if not isinstance(ttl_s, int | float) or not 0 < ttl_s <= self.config.max_pin_ttl_s:
            raise InvalidArgument(
                "ttl out of range", ttl_s=ttl_s, max_pin_ttl_s=self.config.max_pin_ttl_s
            )
        self._reap()
        until = self._clock() + float(ttl_s)
        pinned = 0
        for key in keys:
            entry = self._index.get((ns, key))
            if entry is None or entry.state is not EntryState.READY:
                continue
            if until > entry.ttl_until:
                if not entry.is_pinned:
                    self._pinned_pages += entry.num_pages
                entry.ttl_until = until
                heapq.heappush(self._ttl_heap, (until, ns, key))
            pinned += 1
        return pinned

    def unpin(self, ns_id: str, keys: Sequence[bytes]) -> int:
        """Drop explicit TTL pins of ``keys``; returns how many were TTL-pinned."""
        ns = self._ns(ns_id)
        self._check_keys(ns, keys)
        self._reap()
        count = 0
        for key in keys:
            entry = self._index.get((ns, key))
            if entry is not None and entry.ttl_until > 0.0:
                self._clear_ttl(entry)
                count += 1
        return count

    # ================================================================== maintenance

    def expire(self) -> int:
        """Reclaim expired leases and TTL pins now; returns the number of leases reclaimed."""
        return self._reap()

    def release_client(self, client: str) -> int:
        """Roll back every reservation and release every load pin held by ``client``."""
        leases = self.leases.by_client(client)
        for lease in leases:
            self.leases.end(lease, "released")
            self._reclaim(lease, expired=False)
        return len(leases)

    def announce(self, ns_id: str, keys: Sequence[bytes], medium: Medium, *, stored: bool) -> None:
        """Emit BlockStored (``stored``) or BlockRemoved for ``keys`` of another tier (medium
        DISK), numbered in the engine's one gap-free event sequence. No-op without keys."""
        if keys:
            self._ns(ns_id)
            cls = BlockStored if stored else BlockRemoved
            self._emit(cls(self._seq(), ns_id, tuple(keys), medium))

    def take_events(self) -> list[Event]:
        """Drain the events emitted since the last call, in sequence order."""
        events, self._events = self._events, []
        return events

    def stats(self) -> EngineStats:
        self._reap()
        total = self.allocator.num_pages
        free = self.allocator.num_free
        per_ns: dict[str, dict[str, int]] = {}
        entries_by_ns = [0] * len(self._specs)
        for (ns, _key), entry in self._index.items():
            if entry.state is EntryState.READY:
                entries_by_ns[ns] += 1
        for ns, spec in enumerate(self._specs):
            counters = self._ns_counters[ns]
            row = {name: getattr(counters, name) for name in Counters.__dataclass_fields__}
            row["entries"] = entries_by_ns[ns]
            row["bytes"] = entries_by_ns[ns] * spec.part_bytes * spec.tp_world_size
            per_ns[spec.ns_id] = row
        return EngineStats(
            capacity_bytes=total * self.allocator.page_size,
            page_size=self.allocator.page_size,
            total_pages=total,
            free_pages=free,
            reserved_pages=self._reserved_pages,
            ready_pages=total - free - self._reserved_pages - self._pinned_pages,
            pinned_pages=self._pinned_pages,
            num_entries=len(self._index) - self._num_writing,
            num_writing=self._num_writing,
            num_leases=len(self.leases),
            policy=self.policy.name,
            totals=Counters(**{n: getattr(self.totals, n) for n in Counters.__dataclass_fields__}),
            namespaces=per_ns,
        )

    def close(self) -> None:
        """Release the arena (the shared-memory file is removed). Idempotent."""
        self.arena.close()

    def __enter__(self) -> StorageEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_invariants(self) -> None:
        """Recompute the accounting from scratch and compare (tests; O(entries))."""
        reserved = pinned = ready = writing = 0
        for (ns, key), entry in self._index.items():
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
        assert reserved == self._reserved_pages, (reserved, self._reserved_pages)
        assert pinned == self._pinned_pages, (pinned, self._pinned_pages)
        assert writing == self._num_writing
        assert free + reserved + pinned + ready == self.allocator.num_pages
        assert len(self.policy) == len(self._index) - writing

    # ================================================================== internals

    def _ns(self, ns_id: str) -> int:
        try:
            return self._ns_index[ns_id]
        except (KeyError, TypeError):
            raise UnknownNamespace("namespace not registered", ns=ns_id) from None

    def _check_keys(self, ns: int, keys: Sequence[bytes]) -> None:
        if not isinstance(keys, list | tuple):
            raise InvalidArgument("keys must be a list of byte strings")
        if len(keys) > self.config.max_keys_per_request:
            raise InvalidArgument(
                "too many keys in one request",
                count=len(keys),
                max=self.config.max_keys_per_request,
            )
        size = self._specs[ns].key_size
        for key in keys:
            if type(key) is not bytes or len(key) != size:
                raise InvalidArgument(
                    f"every key must be {size} bytes for this namespace's hash",
                    key=key if isinstance(key, bytes) else type(key).__name__,
                )

    def _check_lease_s(self, lease_s: float | None) -> float:
        if lease_s is None:
            return self.config.default_lease_s
        if not isinstance(lease_s, int | float) or not 0 < lease_s <= self.config.max_lease_s:
            raise InvalidArgument(
                "lease duration out of range", lease_s=lease_s, max_lease_s=self.config.max_lease_s
            )
        return float(lease_s)

    def _entry_cost(self, key: Hashable) -> int:
        return self._index[key].num_pages  # type: ignore[index]

    def _seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _emit(self, event: Event) -> None:
        self._events.append(event)

    def _writing_entry(self, lease_id: int, key: bytes, rank: int) -> Entry:
        lease = self.leases.get(lease_id, LeaseKind.STORE)
        spec = self._specs[lease.ns]
        if type(rank) is not int or not 0 <= rank < spec.tp_world_size:
            raise InvalidArgument("rank out of range", rank=rank)
        if key not in lease.keys:
            raise InvalidArgument("key is not reserved by this lease", key=key, lease=lease_id)
        if lease.done_ranks.get(key, 0) >> rank & 1:
            raise InvalidState("part already completed", key=key, rank=rank)
        return self._index[(lease.ns, key)]

    def _make_ready(self, entry: Entry) -> None:
        entry.state = EntryState.READY
        entry.lease_id = 0
        self._reserved_pages -= entry.num_pages
        self._num_writing -= 1
        self.policy.insert((entry.ns, entry.key))

    def _rollback(self, entry: Entry) -> None:
        del self._index[(entry.ns, entry.key)]
        self._reserved_pages -= entry.num_pages
        self._num_writing -= 1
        for pages in entry.pages:
            self.allocator.free(pages)
        for c in (self.totals, self._ns_counters[entry.ns]):
            c.rolled_back_chunks += 1

    def _drop_evicted(self, victims: list[Hashable]) -> None:
        """Free evicted entries (already forgotten by the policy) and announce them."""
        by_ns: dict[int, list[Entry]] = {}
        for victim in victims:
            entry = self._index.pop(victim)  # type: ignore[call-overload]
            by_ns.setdefault(entry.ns, []).append(entry)
        if self.on_evict is not None:
            for ns, entries in by_ns.items():
                try:
                    self.on_evict(self._specs[ns], entries)
                except Exception:  # a lower tier's failure must not break this tier
                    logger.exception("on_evict hook failed")
        for entries in by_ns.values():
            for entry in entries:
                for pages in entry.pages:
                    self.allocator.free(pages)
        for ns, entries in by_ns.items():
            keys = [entry.key for entry in entries]
            self._emit(BlockRemoved(self._seq(), self._specs[ns].ns_id, tuple(keys), MEDIUM_DRAM))
            self._ns_counters[ns].evicted_chunks += len(keys)
            self.totals.evicted_chunks += len(keys)

    def _add_pin(self, entry: Entry) -> None:
        if not entry.is_pinned:
            self._pinned_pages += entry.num_pages
        entry.pins += 1

    def _drop_pin(self, entry: Entry) -> None:
        entry.pins -= 1
        if not entry.is_pinned:
            self._pinned_pages -= entry.num_pages

    def _clear_ttl(self, entry: Entry) -> None:
        entry.ttl_until = 0.0
        if not entry.is_pinned:
            self._pinned_pages -= entry.num_pages

    def _release_load(self, lease: Lease) -> None:
        index = self._index
        for key in lease.keys:
            self._drop_pin(index[(lease.ns, key)])

    def _reclaim(self, lease: Lease, *, expired: bool = True) -> None:
        if lease.kind is LeaseKind.LOAD:
            self._release_load(lease)
        else:
            for key in lease.keys:
                self._rollback(self._index[(lease.ns, key)])
        for c in (self.totals, self._ns_counters[lease.ns]):
            if expired:
                c.expired_leases += 1
            else:
                c.released_leases += 1

    def _reap(self) -> int:
        """Reclaim expired leases and TTL pins (called at the top of mutating calls)."""
        now = self._clock()
        expired = self.leases.pop_expired(now)
        for lease in expired:
            logger.debug(
                "lease %d (%s, client %r) expired", lease.lease_id, lease.kind.value, lease.client
            )
            self._reclaim(lease)
        heap = self._ttl_heap
        while heap and heap[0][0] <= now:
            until, ns, key = heapq.heappop(heap)
            entry = self._index.get((ns, key))
            if entry is not None and entry.ttl_until == until:
                self._clear_ttl(entry)
        return len(expired)
