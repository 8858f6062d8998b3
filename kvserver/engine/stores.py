"""The store path of the storage engine: a reservation's life, from ``prepare_store`` (reuse
gating, the keys already present, room made by eviction, a policy's admission) to
``complete_store`` / ``settle_store`` (READY and announced, or rolled back).

Runs inside the storage engine (``kvserver/engine/core.py``), which makes one
:class:`StorePath` over its parts and exposes its three calls as its own
(``StorageEngine.prepare_store`` / ``complete_store`` / ``settle_store``: the contract stated
there and in each method's docstring holds as written here). Single owner, no locks, no I/O;
time is the engine's clock. It holds no state of its own: the entries and pages are the
index's (``DramIndex``), the leases the ``LeaseBook``'s, the counters ``EngineCounters``', the
events ``EngineEvents``'; it changes them only through their methods.

Check, then act, as every engine call: each call validates its whole input (and reaps expired
leases) before it changes anything, so a raised :class:`~kvserver.errors.KVServerError` means
nothing changed; a full cache is ``None`` from ``prepare_store``, not an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet

from kvserver.engine.events import EngineEvents
from kvserver.engine.index import DramIndex
from kvserver.engine.leases import LeaseBook
from kvserver.engine.namespaces import NamespaceTable
from kvserver.engine.stats import EngineCounters
from kvserver.engine.types import EngineConfig, Entry
from kvserver.grants import StoreGrant
from kvserver.leases import LeaseKind
from kvserver.reuse import ReuseTracker


class StorePath:
    """``prepare_store``, ``complete_store`` and ``settle_store`` over the engine's parts (see
    the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float],
        dram: DramIndex,
        reuse: ReuseTracker,
        namespaces: NamespaceTable,
        counters: EngineCounters,
        holds: LeaseBook,
        log: EngineEvents,
    ) -> None:
        self.config = config
        self._clock = clock
        self._dram = dram
        self.policy = dram.policy
        self.reuse = reuse
        self._namespaces = namespaces
        self._counters = counters
        self._holds = holds
        self.leases = holds.leases
        self._log = log

    def prepare_store(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        client: str = "",
        lease_s: float | None = None,
        gated: bool = True,
        protect: AbstractSet[bytes] = frozenset(),
    ) -> StoreGrant | None:
        """Reserve space for the keys that are not present yet.

        Keys already present (READY or WRITING) and keys refused by reuse gating are skipped
        (``gated=False`` bypasses reuse gating: promotions of chunks a lower tier holds).
        If free space is short, READY unpinned entries are evicted (never keys of this request).
        Returns ``None`` — with nothing changed, not even the policy state — if space for every
        new key cannot be found (a store rejection). If a policy that ``admits`` (``chain``)
        ranks the new keys below the entries they would displace, nothing changes and they
        come back in ``filtered`` (not admitted, as reuse gating's: not a full cache); a
        ``gated=False`` store (an SSD promotion, a peer fetch's placement: chunks a load asked
        for) is never declined so. New entries are WRITING and invisible until complete_store.
        ``protect``: keys of the namespace that the eviction must not take either, without
        being part of the request (a peer fetch's earlier windows: a set the caller grows
        across calls, looked up, never iterated).
        """
        ns = self._namespaces.index_of(ns_id)
        spec = self._namespaces.specs[ns]
        self._namespaces.check_keys(ns, keys)
        lease_s = self.config.lease_s_of(lease_s)
        self._holds.reap(self._clock())
        new_keys: list[bytes] = list(dict.fromkeys(keys))  # request order, duplicates removed
        present, filtered = list[bytes](), list[bytes]()
        gate, held = gated and self.reuse.enabled, self._dram.ready.get(ns)
        # with no WRITING entry, the index's keys of ``ns`` are ``held``: one test in C
        if gate or self._dram.num_writing or (held and not held.isdisjoint(new_keys)):
            index, unique, new_keys = self._dram.entries, new_keys, []
            for key in unique:
                if (ns, key) in index:
                    present.append(key)
                elif gate and not self.reuse.admits((ns, key)):
                    filtered.append(key)
                else:
                    new_keys.append(key)
        evicted: list[Entry] | None = []
        if new_keys:  # victims only among keys in the index: this request's present ones kept
            need = self._dram.pages_for(spec, len(new_keys))
            # placements (gated=False) are reads of chunks a lower tier or a peer holds: shown
            # to no admission, so a load never loses them to it
            evicted = self._dram.make_room(need, ns, present, new_keys if gated else (), protect)
            if evicted is None and self.policy.declined:  # not admitted, as reuse gating's
                filtered, new_keys, evicted = filtered + new_keys, [], []
        if evicted is None:
            self._counters.store_rejected(ns)
            return None
        self._counters.filtered(ns, len(filtered))
        if not new_keys:
            return StoreGrant(0, 0.0, ns_id, [], [], present, filtered, 0)
        if evicted:
            self._log.evicted(evicted)
        deadline = self._clock() + lease_s
        lease = self.leases.new(LeaseKind.STORE, client, ns, new_keys, deadline)
        # the victims' pages go to the new entries (or back to the allocator) only now
        locations = self._dram.reserve(ns, spec, new_keys, lease.lease_id, evicted)
        return StoreGrant(
            lease.lease_id,
            deadline,
            ns_id,
            list(new_keys),
            locations,
            present,
            filtered,
            len(evicted),
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
        self._holds.reap(self._clock())
        lease = self.leases.get(lease_id, LeaseKind.STORE)
        spec = self._namespaces.specs[lease.ns]
        mask = lease.select_ranks(ranks, spec.tp_world_size)
        selected = lease.select_keys(keys)
        ns = lease.ns
        if success and ranks is None and keys is None and not lease.done_ranks:
            # the whole lease at once (a co-located batch): every part of every key written
            became_ready = lease.finish_all()
            self._dram.make_ready(ns, became_ready)
        elif success:
            became_ready = lease.record_parts(selected, mask, spec.tp_world_size)
            self._dram.make_ready(ns, became_ready)
            lease.finish(became_ready)
        else:
            became_ready = []
            self._holds.roll_back(lease, selected)
            lease.finish(selected)
        if not lease.keys:
            self.leases.end(lease, "completed")
        if became_ready:
            self._log.stored(ns, became_ready)
        return became_ready

    def settle_store(self, lease_id: int, written: Iterable[bytes]) -> list[bytes]:
        """End a store lease the daemon filled itself (a promotion, a peer fetch): the keys of
        ``written`` (every part written) become READY, in that order, announced with one
        BlockStored; every other key it reserves is rolled back; the lease ends. Returns the
        keys made READY: ``complete_store(keys=written)`` then ``(success=False)`` in one pass.
        Checks first: a gone lease raises LeaseError / LeaseExpired, a key the lease does not
        reserve InvalidArgument; nothing changed then."""
        self._holds.reap(self._clock())
        lease = self.leases.get(lease_id, LeaseKind.STORE)
        ns = lease.ns
        became_ready, rest = lease.settle(written)
        if rest:
            self._holds.roll_back(lease, rest)
        if became_ready:
            self._dram.make_ready(ns, became_ready)
        self.leases.end(lease, "completed")
        if became_ready:
            self._log.stored(ns, became_ready)
        return became_ready
