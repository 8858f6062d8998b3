"""Property test of kvserver.engine: random operation sequences from several clients against a
model, for every registered eviction policy.

Three clients share a 12-page arena and two namespaces (1 page per chunk; TP 2 with 2 pages per
part, 4 pages per chunk), so eviction happens all the time. Clients store, write, complete (per
rank, all ranks, or with failure), load and read back, pin with TTLs, release, and vanish (the
clock moves past their leases). After every step the engine's own accounting must hold, every
READY entry must be exactly what the model (built from API results) and the replayed event
stream say, pinned and reserved chunks must still be there, and bytes read back must be the bytes
written for that (namespace, key, rank).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserver.engine import StorageEngine
from kvserver.engine.types import EntryState
from kvserver.errors import InvalidState, LeaseError, LeaseExpired, UnknownKey
from kvserver.events import BlockRemoved, BlockStored
from kvserver.policies import POLICIES
from tests.kvserver.builders import PAGE, FakeClock, make_engine, make_keys, make_spec, pattern

NUM_PAGES = 12
CLIENTS = ("c0", "c1", "c2")
KEYS = make_keys(6)
SPECS = (
    make_spec(),
    make_spec(model="test/tp2", tp_world_size=2, part_bytes_override=PAGE + 100),
)
PAGES_PER_CHUNK = (1, 4)
DEFAULT_LEASE_S = 10.0

key_lists = st.lists(st.integers(0, len(KEYS) - 1), max_size=5)
#: mostly the first indexes: with ``from_ready`` these are the next victims.
few_keys = st.lists(st.integers(0, len(KEYS) - 1) | st.integers(0, 1), min_size=1, max_size=3)
namespaces = st.integers(0, len(SPECS) - 1)
clients = st.sampled_from(CLIENTS)
lease_durations = st.sampled_from([None, 2.0, 5.0, 30.0])
picks = st.integers(0, 1 << 16)

Item = tuple[int, bytes]  # (namespace index, key)


def payload(ns: int, key: bytes, rank: int) -> bytes:
    """The bytes every client writes for (ns, key, rank): distinct per namespace, key and rank."""
    return pattern(bytes([ns]) + key, rank, SPECS[ns].part_bytes)


def policy_state(policy: Any) -> Any:
    """The policy's keys in order and its state (``declined`` reports the last ``evict``: not
    state)."""
    return list(policy), copy.deepcopy({k: v for k, v in vars(policy).items() if k != "declined"})


@dataclass
class StoreLease:
    lease_id: int
    client: str
    ns: int
    keys: list[bytes]  # still WRITING
    deadline: float
    done: dict[bytes, int] = field(default_factory=dict)  # rank mask completed
    written: dict[bytes, int] = field(default_factory=dict)  # rank mask written
    #: live | pending (past deadline, not reaped yet) | expired | completed | released
    status: str = "live"


@dataclass
class LoadLease:
    lease_id: int
    client: str
    ns: int
    keys: list[bytes]
    deadline: float
    status: str = "live"


class EngineMachine(RuleBasedStateMachine):
    policy_name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.engine: StorageEngine | None = None
        self.threshold = 0
        self.ns_ids: list[str] = []
        self.ready: set[Item] = set()  # from complete_store results and observed evictions
        self.replayed: set[Item] = set()  # from the event stream only
        self.ttl: dict[Item, float] = {}
        self.stores: dict[int, StoreLease] = {}
        self.loads: dict[int, LoadLease] = {}
        self.sightings: Counter[Item] = Counter()
        self.next_seq = 1
        #: pages of expired reservations, with the time they are free again (quarantine)
        self.quarantine: list[tuple[float, int]] = []
        #: chunks of expired load leases, with the time they are evictable again (quarantine)
        self.held: dict[Item, float] = {}

    # ------------------------------------------------------------------ model helpers

    @property
    def eng(self) -> StorageEngine:
        assert self.engine is not None
        return self.engine

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def reaped(self) -> None:
        """The engine reaped expired leases (every call that reaps ends with this): ended
        quarantines and holds ended, the pages of expired reservations quarantined and the
        chunks of expired loads held for the default lease."""
        now = self.clock.now
        self.quarantine = [(until, n) for until, n in self.quarantine if until > now]
        self.held = {item: until for item, until in self.held.items() if until > now}
        for lease in [*self.stores.values(), *self.loads.values()]:
            if lease.status == "pending":
                lease.status = "expired"
                if isinstance(lease, StoreLease) and lease.keys:
                    pages = PAGES_PER_CHUNK[lease.ns] * len(lease.keys)
                    self.quarantine.append((now + DEFAULT_LEASE_S, pages))
                elif isinstance(lease, LoadLease):
                    for key in lease.keys:
                        self.held[(lease.ns, key)] = now + DEFAULT_LEASE_S

    def live_stores(self) -> list[StoreLease]:
        return [lease for lease in self.stores.values() if lease.status == "live"]

    def live_loads(self) -> list[LoadLease]:
        return [lease for lease in self.loads.values() if lease.status == "live"]

    def writing(self) -> set[Item]:
        return {(lease.ns, k) for lease in self.live_stores() for k in lease.keys}

    def pinned(self) -> set[Item]:
        load_pinned = {(lease.ns, k) for lease in self.live_loads() for k in lease.keys}
        return load_pinned | set(self.ttl)

    def used_pages(self) -> int:
        held = sum(PAGES_PER_CHUNK[ns] for ns, _ in self.ready | self.writing())
        return held + self.quarantined_pages()

    def quarantined_pages(self) -> int:
        return sum(n for _, n in self.quarantine)

    def admits(self, item: Item) -> bool:
        return self.threshold < 2 or self.sightings[item] >= self.threshold

    def drain(self) -> tuple[list[BlockStored], list[BlockRemoved]]:
        stored: list[BlockStored] = []
        removed: list[BlockRemoved] = []
        for event in self.eng.take_events():
            assert event.seq == self.next_seq, "event sequence has a gap"
            self.next_seq += 1
            assert event.medium == "CPU"
            ns = self.ns_ids.index(event.ns_id)
            if isinstance(event, BlockStored):
                stored.append(event)
                for key in event.keys:
                    assert (ns, key) not in self.replayed
                    self.replayed.add((ns, key))
            else:
                assert isinstance(event, BlockRemoved)
                removed.append(event)
                for key in event.keys:
                    self.replayed.remove((ns, key))
        return stored, removed

    def drain_nothing(self) -> None:
        assert self.drain() == ([], [])

    def ready_in_index(self) -> set[Item]:
        return {k for k, e in self.eng.entries().items() if e.state is EntryState.READY}

    def pick_keys(self, ns: int, idx: list[int], from_ready: bool) -> list[bytes]:
        """Keys of the universe by index or, with ``from_ready``, ready keys of ``ns`` in
        eviction order (index 0 = the next victim): pinning those is what eviction must respect.
        """
        if not from_ready:
            return [KEYS[i] for i in idx]
        order = [key for n, key in self.eng.policy if n == ns]  # type: ignore[misc]
        return [order[i % len(order)] for i in idx] if order else []

    def verify_bytes(self, lease: LoadLease) -> None:
        for key in lease.keys:
            for rank in range(SPECS[lease.ns].tp_world_size):
                views = self.eng.read_part(lease.lease_id, key, rank)
                got = b"".join(bytes(v) for v in views)
                assert got == payload(lease.ns, key, rank), "a pinned part was corrupted"

    # ------------------------------------------------------------------ rules

    @initialize(threshold=st.sampled_from([0, 0, 2]))
    def start(self, threshold: int) -> None:
        self.threshold = threshold
        self.engine = make_engine(
            self.policy_name,
            num_pages=NUM_PAGES,
            clock=self.clock,
            store_threshold=threshold,
            default_lease_s=DEFAULT_LEASE_S,
            max_lease_s=60.0,
        )
        self.ns_ids = [self.engine.register_namespace(spec) for spec in SPECS]
        # Policy keys are (namespace index, key): the index is the registration order.
        indexes = [self.engine.namespace_index(ns_id) for ns_id in self.ns_ids]
        assert indexes == list(range(len(SPECS)))

    @rule(ns=namespaces, idx=key_lists, record=st.booleans(), touch=st.booleans())
    def lookup_keys(self, ns: int, idx: list[int], record: bool, touch: bool) -> None:
        self.lookup(ns, [KEYS[i] for i in idx], record, touch)

    def lookup(self, ns: int, keys: list[bytes], record: bool, touch: bool) -> None:
        if touch and not record:
            self.eng.touch(self.ns_ids[ns], keys)
        expected = 0
        while expected < len(keys) and (ns, keys[expected]) in self.ready:
            expected += 1
        assert self.eng.lookup(self.ns_ids[ns], keys, record=record, touch=touch) == expected
        if record and self.threshold >= 2:
            self.sightings.update((ns, k) for k in keys)
        self.drain_nothing()

    @rule(
        client=clients,
        ns=namespaces,
        idx=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=3),
        plan=st.booleans(),
        lead_victim=st.booleans(),
        pin_victims=st.sampled_from([None, None, 0, 1]),
        finish=st.sampled_from(["commit", "commit", "ranks", "ranks", "reserve", "fail"]),
        lease_s=lease_durations,
        reap_first=st.booleans(),
    )
    def store(
        self,
        client: str,
        ns: int,
        idx: list[int],
        plan: bool,
        lead_victim: bool,
        pin_victims: int | None,
        finish: str,
        lease_s: float | None,
        reap_first: bool,
    ) -> None:
        """prepare_store, then write every part and commit (all ranks at once or rank by rank),
        or roll back, or leave the reservation to later rules (or to expiry).

        ``plan``: a planning lookup first (records sightings for gating, touches the hits).
        ``lead_victim``: the request starts with the namespace's next victim, which the
        request's own eviction must not take. ``pin_victims``: TTL-pin the next two victims of a
        namespace first (an agent keeping its prefix hot): the eviction must step over them.
        """
        keys = self.pick_keys(ns, [0], from_ready=True) if lead_victim else []
        keys += [KEYS[i] for i in idx]
        if plan:
            self.lookup(ns, keys, record=True, touch=True)
        if pin_victims is not None:
            self.pin(pin_victims, [0, 1], 5.0, from_ready=True)
        lease = self.checked_prepare_store(client, ns, keys, lease_s, reap_first)
        if lease is None or finish == "reserve":
            return
        if finish == "ranks":
            for rank in range(SPECS[ns].tp_world_size):
                self.checked_complete_store(lease, True, rank, None)
        else:
            self.checked_complete_store(lease, finish == "commit", None, None)

    def checked_prepare_store(
        self, client: str, ns: int, keys: list[bytes], lease_s: float | None, reap_first: bool
    ) -> StoreLease | None:
        eng = self.eng
        if reap_first:
            assert eng.expire() == sum(
                lease.status == "pending" for lease in [*self.stores.values(), *self.loads.values()]
            )
            self.reaped()
        # Leases or TTL pins past their deadline: prepare_store reaps them before anything else.
        any_pending = any(
            lease.status == "pending" for lease in [*self.stores.values(), *self.loads.values()]
        ) or any(0.0 < e.ttl_until <= self.clock.now for e in eng.entries().values())
        index_before = {
            k: (e.state, e.pins, e.ttl_until, e.pages) for k, e in eng.entries().items()
        }
        policy_before = policy_state(eng.policy)
        grant = eng.prepare_store(self.ns_ids[ns], keys, client=client, lease_s=lease_s)
        self.reaped()

        # What the engine should have decided.
        present_items = self.ready | self.writing()
        seen = list(dict.fromkeys(keys))
        present = [k for k in seen if (ns, k) in present_items]
        filtered = [k for k in seen if (ns, k) not in present_items and not self.admits((ns, k))]
        new = [k for k in seen if k not in present and k not in filtered]
        need = PAGES_PER_CHUNK[ns] * len(new)
        free = NUM_PAGES - self.used_pages()
        pinned = self.pinned()
        evictable = {
            item
            for item in self.ready
            if item not in pinned and item not in self.held
            and not (item[0] == ns and item[1] in seen)
        }  # fmt: skip
        room = free + sum(PAGES_PER_CHUNK[n] for n, _ in evictable)

        # declined: an admitting policy (``chain``) ranked the new keys below the victims; the
        # grant reserves nothing and names them not admitted, beside reuse gating's
        declined = (
            grant is not None and eng.policy.admits and eng.policy.declined
            and free < need <= room and not grant.keys and grant.present == present
            and grant.filtered == filtered + new and grant.lease_id == 0
        )  # fmt: skip
        if need > room or declined:
            assert grant is None or declined, "prepare_store over-committed the arena"
            # All or nothing: no entry, page or policy state changed.
            assert self.ready_in_index() == self.ready
            assert policy_state(eng.policy) == policy_before
            if not any_pending:
                after = {
                    k: (e.state, e.pins, e.ttl_until, e.pages) for k, e in eng.entries().items()
                }
                assert after == index_before
            self.drain_nothing()
            return None
        assert grant is not None, "prepare_store refused a request that fits"
        assert grant.keys == new and grant.present == present and grant.filtered == filtered
        victims = {item for item in self.ready if not eng.contains(self.ns_ids[item[0]], item[1])}
        assert victims <= evictable, "evicted a pinned, protected or non-ready entry"
        assert grant.num_evicted == len(victims)
        shortfall = need - free
        costs = [PAGES_PER_CHUNK[n] for n, _ in victims]
        if shortfall <= 0:
            assert not victims
        else:
            assert sum(costs) >= shortfall > sum(costs) - max(costs), "evicted more than needed"
        stored, removed = self.drain()
        assert not stored
        assert Counter((self.ns_ids.index(e.ns_id), k) for e in removed for k in e.keys) == Counter(
            victims
        )
        assert len({e.ns_id for e in removed}) == len(removed), "one BlockRemoved per namespace"
        self.ready -= victims
        assert len(grant.locations) == len(grant.keys)
        for parts in grant.locations:
            assert len(parts) == SPECS[ns].tp_world_size
            assert all(sum(n for _, n in ext) == SPECS[ns].part_bytes for ext in parts)
        if not new:
            assert grant.lease_id == 0
            return None
        assert grant.deadline == self.clock.now + (lease_s or DEFAULT_LEASE_S)
        lease = StoreLease(grant.lease_id, client, ns, list(new), grant.deadline)
        self.stores[grant.lease_id] = lease
        return lease

    @rule(pick=picks, key_pick=picks, rank=st.integers(0, 1))
    def write_part(self, pick: int, key_pick: int, rank: int) -> None:
        leases = self.live_stores()
        if not leases:
            return
        lease = leases[pick % len(leases)]
        key = lease.keys[key_pick % len(lease.keys)]
        rank %= SPECS[lease.ns].tp_world_size
        if lease.done.get(key, 0) >> rank & 1:
            with pytest.raises(InvalidState):
                self.eng.write_part(lease.lease_id, key, rank, payload(lease.ns, key, rank))
            return
        self.eng.write_part(lease.lease_id, key, rank, payload(lease.ns, key, rank))
        lease.written[key] = lease.written.get(key, 0) | 1 << rank
        self.drain_nothing()

    @rule(
        pick=picks,
        success=st.sampled_from([True, True, True, False]),
        rank=st.sampled_from([None, 0, 1]),
        key_mask=st.none() | st.integers(1, 31),
    )
    def complete_store(
        self, pick: int, success: bool, rank: int | None, key_mask: int | None
    ) -> None:
        if self.stores:
            lease = list(self.stores.values())[pick % len(self.stores)]
            self.checked_complete_store(lease, success, rank, key_mask)

    def checked_complete_store(
        self, lease: StoreLease, success: bool, rank: int | None, key_mask: int | None
    ) -> None:
        eng = self.eng
        if lease.status != "live":
            expected = LeaseExpired if lease.status in ("pending", "expired") else LeaseError
            with pytest.raises(LeaseError) as info:
                eng.complete_store(lease.lease_id, success=success)
            assert type(info.value) is expected
            self.reaped()
            self.drain_nothing()
            return
        world = SPECS[lease.ns].tp_world_size
        full = (1 << world) - 1
        ranks = None if rank is None else [rank % world]
        mask = full if ranks is None else 1 << ranks[0]
        selected = list(lease.keys)
        if key_mask is not None:
            selected = [k for i, k in enumerate(lease.keys) if key_mask >> i & 1] or selected
        keys_arg = None if key_mask is None else selected
        if success and any(lease.done.get(k, 0) & mask for k in selected):
            with pytest.raises(InvalidState):
                eng.complete_store(lease.lease_id, ranks=ranks, keys=keys_arg)
            self.reaped()
            self.drain_nothing()
            return
        if success:
            for key in selected:  # a well-behaved client writes before it commits
                for r in range(world):
                    if mask >> r & 1 and not lease.written.get(key, 0) >> r & 1:
                        eng.write_part(lease.lease_id, key, r, payload(lease.ns, key, r))
                        lease.written[key] = lease.written.get(key, 0) | 1 << r
        became = eng.complete_store(lease.lease_id, success=success, ranks=ranks, keys=keys_arg)
        self.reaped()
        if success:
            expected_ready = [k for k in selected if lease.done.get(k, 0) | mask == full]
            assert became == expected_ready
            for key in selected:
                lease.done[key] = lease.done.get(key, 0) | mask
            finished = set(became)
        else:
            assert became == []
            finished = set(selected)
        stored, removed = self.drain()
        assert not removed
        if became:
            assert [(e.ns_id, list(e.keys)) for e in stored] == [(self.ns_ids[lease.ns], became)]
        else:
            assert not stored
        self.ready |= {(lease.ns, k) for k in became}
        lease.keys = [k for k in lease.keys if k not in finished]
        if not lease.keys:
            lease.status = "completed"

    @rule(
        client=clients,
        ns=namespaces,
        idx=key_lists,
        lease_s=lease_durations,
        from_ready=st.booleans(),
        then_complete=st.booleans(),
    )
    def load(
        self,
        client: str,
        ns: int,
        idx: list[int],
        lease_s: float | None,
        from_ready: bool,
        then_complete: bool,
    ) -> None:
        """prepare_load and check the bytes; then complete_load at once, or leave the pins to
        later rules (or to expiry)."""
        lease = self.prepare_load(client, ns, idx, lease_s, from_ready)
        if lease is not None and then_complete:
            self.finish_load(lease, read_first=False)

    def prepare_load(
        self, client: str, ns: int, idx: list[int], lease_s: float | None, from_ready: bool
    ) -> LoadLease | None:
        keys = self.pick_keys(ns, idx, from_ready)  # from_ready: loads what a lookup found
        eng = self.eng
        if all((ns, k) in self.ready for k in keys):
            grant = eng.prepare_load(self.ns_ids[ns], keys, client=client, lease_s=lease_s)
            self.reaped()
            assert grant.keys == keys and len(grant.locations) == len(keys)
            lease = LoadLease(grant.lease_id, client, ns, list(keys), grant.deadline)
            self.loads[grant.lease_id] = lease
            self.verify_bytes(lease)
            self.drain_nothing()
            return lease
        else:
            pins_before = {k: e.pins for k, e in eng.entries().items()}
            pending = [lease for lease in self.loads.values() if lease.status == "pending"]
            with pytest.raises(UnknownKey):
                eng.prepare_load(self.ns_ids[ns], keys, client=client, lease_s=lease_s)
            self.reaped()
            for lease in pending:  # reaped by this call
                for key in lease.keys:
                    pins_before[(lease.ns, key)] -= 1
            assert {k: e.pins for k, e in eng.entries().items()} == {
                k: n for k, n in pins_before.items() if k in eng.entries()
            }
            self.drain_nothing()
            return None

    @rule(pick=picks, read_first=st.booleans())
    def complete_load(self, pick: int, read_first: bool) -> None:
        if self.loads:
            self.finish_load(list(self.loads.values())[pick % len(self.loads)], read_first)

    def finish_load(self, lease: LoadLease, read_first: bool) -> None:
        if lease.status == "live":
            if read_first:  # still intact, however much was evicted and rewritten meanwhile
                self.verify_bytes(lease)
            self.eng.complete_load(lease.lease_id)
            lease.status = "completed"
        else:
            expected = LeaseExpired if lease.status in ("pending", "expired") else LeaseError
            with pytest.raises(LeaseError) as info:
                self.eng.complete_load(lease.lease_id)
            assert type(info.value) is expected
        self.reaped()
        self.drain_nothing()

    @rule(
        ns=namespaces,
        idx=few_keys,
        ttl=st.sampled_from([None, 1.0, 5.0, 20.0]),
        from_ready=st.sampled_from([True, True, False]),
    )
    def pin(self, ns: int, idx: list[int], ttl: float | None, from_ready: bool) -> None:
        """Pin with a TTL, or (ttl None) unpin."""
        keys = self.pick_keys(ns, idx, from_ready)
        if ttl is None:
            self.unpin(ns, keys)
            return
        count = self.eng.pin(self.ns_ids[ns], keys, ttl)
        self.reaped()
        until = self.clock.now + ttl
        assert count == sum((ns, k) in self.ready for k in keys)
        for key in keys:
            if (ns, key) in self.ready and until > self.ttl.get((ns, key), 0.0):
                self.ttl[(ns, key)] = until
        self.drain_nothing()

    def unpin(self, ns: int, keys: list[bytes]) -> None:
        count = self.eng.unpin(self.ns_ids[ns], keys)
        self.reaped()
        expected = 0
        for key in keys:
            if self.ttl.pop((ns, key), None) is not None:
                expected += 1
        assert count == expected
        self.drain_nothing()

    @rule(seconds=st.sampled_from([0.5, 1.0, 1.0, 3.0, 12.0]))
    def advance_clock(self, seconds: float) -> None:
        """Time passes: clients that did not complete in time have vanished."""
        now = self.clock.advance(seconds)
        for lease in [*self.stores.values(), *self.loads.values()]:
            if lease.status == "live" and lease.deadline <= now:
                lease.status = "pending"
        self.ttl = {item: until for item, until in self.ttl.items() if until > now}

    @rule(check_stats=st.booleans())
    def maintenance(self, check_stats: bool) -> None:
        """The daemon's periodic expire(), or a stats() query (which reaps too)."""
        if check_stats:
            self.stats()
        else:
            self.expire()

    def expire(self) -> None:
        pending = [
            lease
            for lease in [*self.stores.values(), *self.loads.values()]
            if lease.status == "pending"
        ]
        assert self.eng.expire() == len(pending)
        self.reaped()
        self.drain_nothing()

    @rule(client=clients)
    def release_client(self, client: str) -> None:
        mine = [
            lease
            for lease in [*self.stores.values(), *self.loads.values()]
            if lease.client == client and lease.status in ("live", "pending")
        ]
        assert self.eng.release_client(client) == len(mine)
        for lease in mine:
            lease.status = "released"
        self.drain_nothing()

    def stats(self) -> None:
        stats = self.eng.stats()
        self.reaped()
        writing = self.writing()
        pinned = self.pinned()
        assert stats.num_entries == len(self.ready)
        assert stats.num_writing == len(writing)
        assert stats.reserved_pages == sum(PAGES_PER_CHUNK[n] for n, _ in writing)
        assert stats.pinned_pages == sum(PAGES_PER_CHUNK[n] for n, _ in pinned)
        assert stats.free_pages == NUM_PAGES - self.used_pages()
        assert stats.quarantined_pages == self.quarantined_pages()
        held_only = set(self.held) - pinned
        assert stats.quarantined_load_pages == sum(PAGES_PER_CHUNK[n] for n, _ in held_only)
        assert stats.num_leases == len(self.live_stores()) + len(self.live_loads())
        self.drain_nothing()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def engine_accounting(self) -> None:
        self.eng.check_invariants()

    @invariant()
    def pages_owned_once_and_within_capacity(self) -> None:
        eng = self.eng
        owned = [p for e in eng.entries().values() for pages in e.pages for p in pages]
        assert len(owned) == len(set(owned)) <= NUM_PAGES
        assert set(owned).isdisjoint(eng.allocator._free)
        quarantined = eng._dram.quarantined_pages  # stats() would reap
        assert len(owned) + eng.allocator.num_free + quarantined == NUM_PAGES

    @invariant()
    def ready_set_agrees_with_model_events_and_lookup(self) -> None:
        assert self.ready_in_index() == self.ready == self.replayed
        for ns, ns_id in enumerate(self.ns_ids):
            for key in KEYS:
                assert self.eng.lookup(ns_id, [key]) == ((ns, key) in self.ready)

    @invariant()
    def pinned_and_reserved_chunks_still_there(self) -> None:
        index = self.eng.entries()
        for item in self.pinned():
            assert item in self.ready, "a pinned chunk was evicted"
            assert index[item].is_pinned
        for item in self.writing():
            assert index[item].state is EntryState.WRITING, "a reserved chunk disappeared"
        for item in self.held:
            assert item in self.ready, "a chunk of an expired load was evicted in its quarantine"


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# One TestCase per registered policy: TestEngine_lru, TestEngine_arc, ...
for _name in sorted(POLICIES):
    _machine = type(f"EngineMachine_{_name}", (EngineMachine,), {"policy_name": _name})
    _case = _machine.TestCase
    _case.settings = SETTINGS
    globals()[f"TestEngine_{_name}"] = _case
del _name, _machine, _case
