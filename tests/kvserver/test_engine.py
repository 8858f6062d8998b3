"""Tests of kvserver.engine: the chunk lifecycle, eviction, leases, pins, gating, events, stats.

Everything that involves eviction order runs against every registered policy.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserver.engine import StorageEngine
from kvserver.engine.namespaces import MAX_NAMESPACES
from kvserver.engine.types import CutKeys, EngineConfig, EntryState, HashedKeys
from kvserver.errors import (
    CapacityError,
    InvalidArgument,
    InvalidState,
    KVServerError,
    LeaseError,
    LeaseExpired,
    UnknownKey,
    UnknownNamespace,
)
from kvserver.events import BlockRemoved, BlockStored
from kvserver.policies import POLICIES
from tests.kvserver.builders import (
    PAGE,
    FakeClock,
    make_engine,
    make_keys,
    make_spec,
    pattern,
    read_back,
    store,
    store_each,
    write_all,
)

ALL = sorted(POLICIES)


def snapshot(engine: StorageEngine) -> Any:
    """Everything observable about the engine's state except monotonic counters."""
    stats = engine.stats()
    return (
        {k: v for k, v in stats.to_dict().items() if k not in ("totals", "namespaces")},
        {ns: {"entries": row["entries"]} for ns, row in stats.namespaces.items()},
        list(engine.policy),
        copy.deepcopy({k: v for k, v in vars(engine.policy).items() if k != "declined"}),
        {k: (e.state, e.pins, e.ttl_until, e.pages) for k, e in engine.entries().items()},
        sorted(lease.lease_id for lease in engine.leases),
        list(engine._log._events),
        engine.allocator.num_free,
    )


def ready_keys(engine: StorageEngine, ns: str, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if engine.contains(ns, k)]


def event_keys(events: list[Any], kind: type) -> list[bytes]:
    return [k for e in events if isinstance(e, kind) for k in e.keys]


# ============================================================================ lookup


@pytest.mark.parametrize("policy", ALL)
def test_lookup_counts_leading_run_and_stops_at_first_miss(policy: str) -> None:
    with make_engine(policy) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(5)
        store(engine, ns, [k[0], k[1], k[3], k[4]])
        assert engine.lookup(ns, k) == 2
        assert engine.lookup(ns, k[3:]) == 2
        assert engine.lookup(ns, [k[2], k[0]]) == 0
        assert engine.lookup(ns, []) == 0
        assert engine.lookup(ns, (k[0],)) == 1
        assert engine.lookup(ns, [k[0], k[0], k[1]]) == 3  # every key held: one superset test


@pytest.mark.parametrize("policy", ALL)
def test_writing_entries_are_invisible(policy: str) -> None:
    with make_engine(policy) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        store(engine, ns, [k[0], k[2]])
        grant = engine.prepare_store(ns, [k[1]])
        assert grant is not None and grant.keys == [k[1]]
        assert engine.lookup(ns, k) == 1
        assert engine.lookup(ns, [k[1]]) == 0
        assert not engine.contains(ns, k[1])
        with pytest.raises(UnknownKey):
            engine.prepare_load(ns, [k[1]])
        assert engine.pin(ns, [k[1]], 10.0) == 0
        write_all(engine, grant)
        engine.complete_store(grant.lease_id)
        assert engine.lookup(ns, k) == 3


@pytest.mark.parametrize("policy", ALL)
def test_lookup_touch_protects_from_eviction_lookup_without_touch_does_not(policy: str) -> None:
    with make_engine(policy, num_pages=4) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(6)
        store_each(engine, ns, k[:4])
        engine.lookup(ns, [k[1]])  # no touch: order unchanged
        engine.lookup(ns, [k[0]], touch=True)
        grant = engine.prepare_store(ns, [k[4], k[5]])
        assert grant is not None and grant.num_evicted == 2
        assert ready_keys(engine, ns, k[:4]) == [k[0], k[3]]


@pytest.mark.parametrize("policy", ALL)
def test_touch_protects_from_eviction(policy: str) -> None:
    with make_engine(policy, num_pages=3) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(4)
        store_each(engine, ns, k[:3])
        engine.touch(ns, [k[0], make_keys(1, tag="unknown")[0]])  # unknown keys are ignored
        store(engine, ns, [k[3]])
        assert ready_keys(engine, ns, k) == [k[0], k[2], k[3]]


# ============================================================================ prepare_store


@pytest.mark.parametrize("policy", ALL)
def test_prepare_store_skips_present_keys_and_duplicates(policy: str) -> None:
    with make_engine(policy, num_pages=8) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(5)
        store(engine, ns, [k[0]])
        writing = engine.prepare_store(ns, [k[1]])
        assert writing is not None
        grant = engine.prepare_store(ns, [k[2], k[0], k[2], k[1], k[3], k[3]])
        assert grant is not None
        assert grant.keys == [k[2], k[3]]
        assert grant.present == [k[0], k[1]]
        assert grant.filtered == [] and grant.num_evicted == 0
        assert len(grant.locations) == 2 and all(len(loc) == 1 for loc in grant.locations)
        stats = engine.stats()
        assert stats.reserved_pages == 3 and stats.num_writing == 3 and stats.num_entries == 1
        assert stats.free_pages == 4
        # Nothing new at all: an empty grant that holds no lease.
        empty = engine.prepare_store(ns, [k[0], k[2]])
        assert empty is not None
        assert empty.lease_id == 0 and empty.keys == [] and empty.present == [k[0], k[2]]
        assert engine.stats().num_leases == 2
        engine.check_invariants()


@pytest.mark.parametrize("policy", ALL)
def test_grant_locations_are_disjoint_and_sized(policy: str) -> None:
    spec = make_spec(part_bytes_override=PAGE + 10, tp_world_size=2)
    with make_engine(policy, num_pages=16) as engine:
        ns = engine.register_namespace(spec)
        grant = engine.prepare_store(ns, make_keys(3))
        assert grant is not None
        spans = []
        for parts in grant.locations:
            assert len(parts) == 2
            for extents in parts:
                assert sum(length for _, length in extents) == spec.part_bytes
                spans += [range(off, off + length) for off, length in extents]
        covered = [b for span in spans for b in (span.start, span.stop - 1)]
        assert len(covered) == len(set(covered))
        for a in spans:
            for b in spans:
                assert a is b or a.stop <= b.start or b.stop <= a.start


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("pin_kind", ["load", "ttl", "writing"])
def test_prepare_store_returns_none_and_changes_nothing_when_it_cannot_fit(
    policy: str, pin_kind: str
) -> None:
    clock = FakeClock()
    with make_engine(policy, num_pages=6, clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(11)
        store(engine, ns, k[:4])
        engine.lookup(ns, [k[1]], touch=True)  # some policy state (ARC: T2)
        if pin_kind == "load":
            engine.prepare_load(ns, k[:3])
        elif pin_kind == "ttl":
            engine.pin(ns, k[:3], 60.0)
        assert engine.prepare_store(ns, [k[4]]) is not None  # 2 free pages -> 1 left
        engine.take_events()
        before = snapshot(engine)
        rejections = engine.stats().totals.store_rejections
        # writing: 1 free + 4 evictable, 6 new chunks; pinned: 1 free + 1 evictable (k3), 3 new
        new = k[4:11] if pin_kind == "writing" else k[5:8]
        assert engine.prepare_store(ns, new) is None
        assert snapshot(engine) == before
        assert engine.stats().totals.store_rejections == rejections + 1
        assert engine.take_events() == []
        engine.check_invariants()


@pytest.mark.parametrize("policy", ALL)
def test_request_larger_than_the_arena_is_a_full_cache_not_an_error(policy: str) -> None:
    with make_engine(policy, num_pages=4) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(6)
        store(engine, ns, k[:2])
        before = snapshot(engine)
        assert engine.prepare_store(ns, k[1:]) is None
        assert snapshot(engine) == before


# ============================================================================ eviction


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize(
    ("num_stored", "num_new", "num_evicted"), [(8, 3, 3), (6, 3, 1), (5, 3, 0)]
)
def test_eviction_frees_exactly_enough_oldest_first(
    policy: str, num_stored: int, num_new: int, num_evicted: int
) -> None:
    with make_engine(policy, num_pages=8) as engine:
        ns = engine.register_namespace(make_spec())
        old, new = make_keys(num_stored), make_keys(num_new, tag="new")
        store_each(engine, ns, old)
        engine.take_events()
        grant = engine.prepare_store(ns, new)
        assert grant is not None
        assert grant.num_evicted == num_evicted
        assert ready_keys(engine, ns, old) == old[num_evicted:]
        events = engine.take_events()
        if num_evicted:
            assert len(events) == 1 and isinstance(events[0], BlockRemoved)
            assert events[0].keys == tuple(old[:num_evicted]) and events[0].ns_id == ns
            assert events[0].medium == "CPU"
        else:
            assert events == []
        stats = engine.stats()
        assert stats.free_pages == 8 - (num_stored - num_evicted) - num_new
        assert stats.totals.evicted_chunks == num_evicted
        assert stats.namespaces[ns]["evicted_chunks"] == num_evicted
        engine.check_invariants()


@pytest.mark.parametrize("policy", ALL)
def test_load_pinned_and_ttl_pinned_entries_never_evicted(policy: str) -> None:
    clock = FakeClock()
    with make_engine(policy, num_pages=4, clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(9)
        store(engine, ns, k[:4])
        load = engine.prepare_load(ns, [k[0]])
        assert engine.pin(ns, [k[1]], 100.0) == 1
        assert engine.stats().pinned_pages == 2
        grant = engine.prepare_store(ns, [k[4], k[5]])
        assert grant is not None and grant.num_evicted == 2
        assert ready_keys(engine, ns, k[:4]) == [k[0], k[1]]
        engine.complete_store(grant.lease_id)
        assert engine.prepare_store(ns, [k[6]]) is not None  # evicts k4 (oldest unpinned)
        assert ready_keys(engine, ns, k[:4]) == [k[0], k[1]]
        engine.complete_load(load.lease_id)
        assert engine.prepare_store(ns, k[7:9]) is not None  # k0 and k5 must go now
        assert not engine.contains(ns, k[0]) and engine.contains(ns, k[1])
        engine.check_invariants()


@pytest.mark.parametrize("policy", ALL)
def test_writing_entries_never_evicted(policy: str) -> None:
    with make_engine(policy, num_pages=4) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(8)
        store(engine, ns, k[:2])
        writing = engine.prepare_store(ns, k[2:4])
        assert writing is not None
        assert engine.prepare_store(ns, k[4:7]) is None
        grant = engine.prepare_store(ns, k[4:6])
        assert grant is not None and grant.num_evicted == 2
        writing_keys = [
            key for (_, key), e in engine.entries().items() if e.state is EntryState.WRITING
        ]
        assert set(k[2:4]) <= set(writing_keys)
        write_all(engine, writing)
        assert engine.complete_store(writing.lease_id) == k[2:4]


@pytest.mark.parametrize("policy", ALL)
def test_keys_of_the_same_request_are_never_evicted_by_it(policy: str) -> None:
    with make_engine(policy, num_pages=4) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(6)
        store_each(engine, ns, k[:4])
        # k0 is the oldest, but it is part of this request (present): k1 goes instead.
        grant = engine.prepare_store(ns, [k[0], k[4]])
        assert grant is not None and grant.present == [k[0]] and grant.keys == [k[4]]
        assert ready_keys(engine, ns, k[:4]) == [k[0], k[2], k[3]]
        engine.complete_store(grant.lease_id)
        # Every evictable entry is in the request: nothing to evict, None.
        assert engine.prepare_store(ns, [k[0], k[2], k[3], k[4], k[5]]) is None
        assert ready_keys(engine, ns, k) == [k[0], k[2], k[3], k[4]]


@pytest.mark.parametrize("policy", ALL)
def test_filtered_keys_of_the_request_are_protected_too(policy: str) -> None:
    with make_engine(policy, num_pages=2, store_threshold=2) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        for _ in range(2):
            engine.lookup(ns, k[:2], record=True)
        store(engine, ns, k[:2])
        engine.lookup(ns, [k[2]], record=True)
        engine.lookup(ns, [k[2]], record=True)
        before = snapshot(engine)
        assert engine.prepare_store(ns, [k[0], k[1], k[2]]) is None
        assert snapshot(engine) == before


# ============================================================================ complete_store


@pytest.mark.parametrize("policy", ALL)
def test_tp_entry_ready_only_after_every_rank(policy: str) -> None:
    spec = make_spec(tp_world_size=2)
    with make_engine(policy) as engine:
        ns = engine.register_namespace(spec)
        (key,) = make_keys(1)
        grant = engine.prepare_store(ns, [key])
        assert grant is not None and len(grant.locations[0]) == 2
        engine.write_part(grant.lease_id, key, 0, pattern(key, 0, spec.part_bytes))
        assert engine.complete_store(grant.lease_id, ranks=[0]) == []
        assert engine.lookup(ns, [key]) == 0
        assert engine.take_events() == []
        engine.write_part(grant.lease_id, key, 1, pattern(key, 1, spec.part_bytes))
        assert engine.complete_store(grant.lease_id, ranks=[1]) == [key]
        assert engine.lookup(ns, [key]) == 1
        (event,) = engine.take_events()
        assert isinstance(event, BlockStored) and event.keys == (key,)
        assert engine.stats().num_leases == 0
        engine.check_invariants()


def test_tp_ranks_per_key_subsets() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        a, b = make_keys(2)
        grant = engine.prepare_store(ns, [a, b])
        assert grant is not None
        assert engine.complete_store(grant.lease_id, ranks=[0], keys=[a]) == []
        assert engine.complete_store(grant.lease_id, ranks=[1]) == [a]  # b has only rank 1
        assert engine.lookup(ns, [a, b]) == 1
        with pytest.raises(InvalidState):
            engine.complete_store(grant.lease_id, ranks=[1], keys=[b])
        assert engine.complete_store(grant.lease_id, ranks=[0, 0]) == [b]
        with pytest.raises(LeaseError, match="already completed"):
            engine.complete_store(grant.lease_id)


@pytest.mark.parametrize("policy", ALL)
def test_double_complete_of_a_part_is_invalid_state_and_changes_nothing(policy: str) -> None:
    with make_engine(policy) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        a, b = make_keys(2)
        grant = engine.prepare_store(ns, [a, b])
        assert grant is not None
        engine.complete_store(grant.lease_id, ranks=[0], keys=[a])
        before = snapshot(engine)
        with pytest.raises(InvalidState):
            engine.complete_store(grant.lease_id, ranks=[0])  # a's rank 0 again (b is fine)
        with pytest.raises(InvalidState):
            engine.write_part(grant.lease_id, a, 0, bytes(PAGE))
        assert snapshot(engine) == before
        assert engine.complete_store(grant.lease_id, ranks=[1], keys=[a, b]) == [a]


def test_complete_a_finished_lease_is_lease_error() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        grant = store(engine, ns, make_keys(2))
        with pytest.raises(LeaseError, match="already completed") as info:
            engine.complete_store(grant.lease_id)
        assert type(info.value) is LeaseError
        with pytest.raises(LeaseError, match="unknown"):
            engine.complete_store(9999)


@pytest.mark.parametrize("policy", ALL)
def test_complete_after_expiry_is_lease_expired_and_pages_come_back_after_quarantine(
    policy: str,
) -> None:
    """An expired reservation's pages are quarantined for default_lease_s (a stalled client
    may still copy into them), refused to stores meanwhile, then free again."""
    clock = FakeClock()
    with make_engine(policy, num_pages=8, clock=clock, default_lease_s=5.0) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        keys = make_keys(3)
        grant = engine.prepare_store(ns, keys)
        assert grant is not None and grant.deadline == clock.now + 5.0
        engine.complete_store(grant.lease_id, ranks=[0])
        assert engine.stats().free_pages == 2
        clock.advance(5.0)
        with pytest.raises(LeaseExpired):
            engine.complete_store(grant.lease_id, ranks=[1])
        stats = engine.stats()
        assert stats.free_pages == 2 and stats.quarantined_pages == 6
        assert stats.reserved_pages == 0 and stats.num_writing == 0 and stats.ready_pages == 0
        assert stats.totals.expired_leases == 1 and stats.totals.rolled_back_chunks == 3
        assert stats.totals.quarantined_chunks == 3
        assert engine.lookup(ns, keys) == 0
        assert engine.take_events() == []
        with pytest.raises(LeaseExpired):
            engine.write_part(grant.lease_id, keys[0], 1, bytes(PAGE))
        assert engine.prepare_store(ns, keys) is None  # the quarantined pages are not handed out
        engine.check_invariants()
        clock.advance(4.999)
        assert engine.stats().quarantined_pages == 6
        clock.advance(0.001)
        stats = engine.stats()
        assert stats.free_pages == 8 and stats.quarantined_pages == 0
        store(engine, ns, keys)  # the keys can be stored again
        engine.check_invariants()


def test_quarantined_pages_are_never_handed_to_a_reservation_before_their_time() -> None:
    """A reservation expires; the next store gets other pages (or none), never the expired
    grant's, until the quarantine ends; explicit releases and failed completions free at once."""
    clock = FakeClock()
    with make_engine(num_pages=8, clock=clock, default_lease_s=5.0) as engine:
        ns = engine.register_namespace(make_spec())
        stale = engine.prepare_store(ns, make_keys(2, tag="a"), client="a")
        assert stale is not None
        clock.advance(5.0)
        engine.expire()
        fresh = engine.prepare_store(ns, make_keys(6, tag="b"), client="b")
        assert fresh is not None
        stale_offsets = {off for ext in stale.locations for part in ext for off, _ in part}
        fresh_offsets = {off for ext in fresh.locations for part in ext for off, _ in part}
        assert not stale_offsets & fresh_offsets
        assert engine.prepare_store(ns, make_keys(1, tag="c")) is None
        engine.release_client("b")  # released by its client: free at once
        assert engine.stats().free_pages == 6 and engine.stats().quarantined_pages == 2
        engine.check_invariants()


def test_lease_alive_until_its_deadline() -> None:
    clock = FakeClock()
    with make_engine(clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        grant = engine.prepare_store(ns, make_keys(1), lease_s=10)
        assert grant is not None
        clock.advance(9.999)
        assert engine.expire() == 0
        assert engine.complete_store(grant.lease_id) == make_keys(1)


def test_expire_reclaims_without_another_call() -> None:
    clock = FakeClock()
    with make_engine(clock=clock, default_lease_s=1.0) as engine:
        ns = engine.register_namespace(make_spec())
        engine.prepare_store(ns, make_keys(2))
        engine.prepare_store(ns, make_keys(1, tag="x"), lease_s=3.0)
        clock.advance(1.0)
        assert engine.expire() == 1
        assert engine.stats().reserved_pages == 1
        clock.advance(2.0)
        assert engine.expire() == 1
        assert engine.expire() == 0
        assert engine.stats().reserved_pages == 0


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("ranks_done", [[], [0], [1]])
def test_failure_rolls_back_frees_pages_and_emits_nothing(
    policy: str, ranks_done: list[int]
) -> None:
    with make_engine(policy, num_pages=8) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        keep, drop = make_keys(2)
        grant = engine.prepare_store(ns, [keep, drop])
        assert grant is not None
        if ranks_done:
            engine.complete_store(grant.lease_id, ranks=ranks_done)
        assert engine.complete_store(grant.lease_id, success=False, keys=[drop]) == []
        assert engine.stats().free_pages == 6 and engine.stats().num_writing == 1
        assert engine.complete_store(grant.lease_id, ranks=[1 - r for r in ranks_done] or None) == [
            keep
        ]
        events = engine.take_events()
        assert event_keys(events, BlockStored) == [keep]
        assert event_keys(events, BlockRemoved) == []
        assert engine.lookup(ns, [drop]) == 0
        assert engine.stats().totals.rolled_back_chunks == 1
        engine.check_invariants()


def test_failure_of_the_whole_lease_ends_it() -> None:
    with make_engine(num_pages=4) as engine:
        ns = engine.register_namespace(make_spec())
        grant = engine.prepare_store(ns, make_keys(4))
        assert grant is not None
        assert engine.complete_store(grant.lease_id, success=False) == []
        assert engine.stats().free_pages == 4 and engine.stats().num_leases == 0
        with pytest.raises(LeaseError, match="already completed"):
            engine.complete_store(grant.lease_id, success=False)
        assert engine.take_events() == []


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"ranks": [2]}, InvalidArgument),
        ({"ranks": [-1]}, InvalidArgument),
        ({"ranks": ["0"]}, InvalidArgument),
        ({"ranks": [True]}, InvalidArgument),
        ({"keys": [b"\x00" * 32]}, InvalidArgument),
        ({"keys": [b"\x00" * 32], "success": False}, InvalidArgument),
        ({"ranks": [5], "success": False}, InvalidArgument),
    ],
)
def test_complete_store_bad_arguments_change_nothing(
    kwargs: dict[str, Any], error: type[KVServerError]
) -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        grant = engine.prepare_store(ns, make_keys(2))
        assert grant is not None
        before = snapshot(engine)
        with pytest.raises(error):
            engine.complete_store(grant.lease_id, **kwargs)
        assert snapshot(engine) == before


def test_complete_store_rejects_a_load_lease() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        store(engine, ns, make_keys(1))
        load = engine.prepare_load(ns, make_keys(1))
        with pytest.raises(LeaseError, match="load lease"):
            engine.complete_store(load.lease_id)
        with pytest.raises(LeaseError, match="load lease"):
            engine.write_part(load.lease_id, make_keys(1)[0], 0, bytes(PAGE))


# ============================================================================ load path


@pytest.mark.parametrize("policy", ALL)
def test_prepare_load_of_a_missing_key_pins_nothing(policy: str) -> None:
    with make_engine(policy) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        store(engine, ns, k[:2])
        engine.prepare_store(ns, [k[2]])  # WRITING
        before = snapshot(engine)
        for keys in ([k[0], make_keys(1, tag="missing")[0]], [k[0], k[1], k[2]]):
            with pytest.raises(UnknownKey):
                engine.prepare_load(ns, keys)
        assert snapshot(engine) == before
        assert engine.stats().pinned_pages == 0


def test_load_round_trip_and_complete_load_twice() -> None:
    with make_engine() as engine:
        spec = make_spec()
        ns = engine.register_namespace(spec)
        keys = make_keys(3)
        store(engine, ns, keys)
        load = engine.prepare_load(ns, keys[::-1])
        assert load.keys == keys[::-1] and len(load.locations) == 3
        assert engine.stats().pinned_pages == 3
        for key in keys:
            assert read_back(engine, load.lease_id, key, 0) == pattern(key, 0, spec.part_bytes)
        engine.complete_load(load.lease_id)
        assert engine.stats().pinned_pages == 0
        with pytest.raises(LeaseError, match="already completed") as info:
            engine.complete_load(load.lease_id)
        assert type(info.value) is LeaseError
        with pytest.raises(LeaseError):
            engine.read_part(load.lease_id, keys[0], 0)
        assert engine.stats().totals.loaded_chunks == 3


@pytest.mark.parametrize("policy", ALL)
def test_prepare_load_touches_the_loaded_keys(policy: str) -> None:
    with make_engine(policy, num_pages=3) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(4)
        store_each(engine, ns, k[:3])
        engine.complete_load(engine.prepare_load(ns, [k[0]]).lease_id)
        store(engine, ns, [k[3]])
        assert ready_keys(engine, ns, k) == [k[0], k[2], k[3]]


def test_complete_load_rejects_a_store_lease() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        grant = engine.prepare_store(ns, make_keys(1))
        assert grant is not None
        with pytest.raises(LeaseError, match="store lease"):
            engine.complete_load(grant.lease_id)
        assert engine.complete_store(grant.lease_id) == make_keys(1)


def test_duplicate_keys_in_a_load_pin_twice_and_release_both() -> None:
    with make_engine(num_pages=2) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        store(engine, ns, k[:2])
        load = engine.prepare_load(ns, [k[0], k[0]])
        assert engine.entries()[(0, k[0])].pins == 2
        engine.complete_load(load.lease_id)
        assert engine.entries()[(0, k[0])].pins == 0
        assert engine.stats().pinned_pages == 0
        engine.check_invariants()


@pytest.mark.parametrize("policy", ALL)
def test_load_lease_expiry_releases_pins_and_holds_its_chunks_for_the_quarantine(
    policy: str,
) -> None:
    """An expired load lease's pins go, but its chunks stay READY and are kept from eviction
    for default_lease_s (a stalled co-located reader may still copy out of their pages); then
    they are evictable again. Was: evicted, their pages reused, at the expiry."""
    clock = FakeClock()
    with make_engine(policy, num_pages=2, clock=clock, default_lease_s=5.0) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(4)
        store(engine, ns, k[:2])
        load = engine.prepare_load(ns, k[:2], lease_s=2.0)
        assert engine.prepare_store(ns, [k[2]]) is None
        clock.advance(2.0)
        assert engine.prepare_store(ns, k[2:]) is None  # held: not handed out
        stats = engine.stats()
        assert stats.pinned_pages == 0 and stats.totals.expired_leases == 1
        assert stats.quarantined_load_pages == 2 and stats.ready_pages == 0
        assert stats.totals.quarantined_load_chunks == 2 and stats.quarantined_pages == 0
        assert engine.lookup(ns, k[:2]) == 2  # still served
        with pytest.raises(LeaseExpired):
            engine.complete_load(load.lease_id)
        engine.check_invariants()
        clock.advance(4.999)
        assert engine.prepare_store(ns, k[2:]) is None
        clock.advance(0.001)
        grant = engine.prepare_store(ns, k[2:])
        assert grant is not None and grant.num_evicted == 2
        assert engine.stats().quarantined_load_pages == 0
        engine.check_invariants()


def test_expired_load_pages_are_never_handed_to_a_reservation_before_their_time() -> None:
    """A load lease expires: no reservation gets its chunks' pages before the quarantine
    ends, also when another load of the same chunks ends first; a completed load and a
    released client hold nothing."""
    clock = FakeClock()
    with make_engine(num_pages=8, clock=clock, default_lease_s=5.0) as engine:
        ns = engine.register_namespace(make_spec())
        a, b = make_keys(2, tag="a"), make_keys(2, tag="b")
        store(engine, ns, a + b)
        stale = engine.prepare_load(ns, a, client="late", lease_s=1.0)
        other = engine.prepare_load(ns, a, client="other")
        done = engine.prepare_load(ns, b[:1], client="quick", lease_s=1.0)
        engine.complete_load(done.lease_id)
        gone = engine.prepare_load(ns, b[1:], client="gone", lease_s=1.0)
        engine.release_client("gone")
        clock.advance(1.0)
        engine.expire()
        engine.complete_load(other.lease_id)  # the other reader is done: a is still held
        stats = engine.stats()
        assert stats.quarantined_load_pages == 2 and stats.totals.quarantined_load_chunks == 2
        fresh = engine.prepare_store(ns, make_keys(6, tag="c"))
        assert fresh is not None and fresh.num_evicted == 2  # b's, never a's
        stale_offsets = {off for part in stale.locations for ext in part for off, _ in ext}
        fresh_offsets = {off for part in fresh.locations for ext in part for off, _ in ext}
        assert not stale_offsets & fresh_offsets
        assert engine.lookup(ns, a) == 2 and gone.keys == b[1:]
        engine.check_invariants()
        clock.advance(4.999)
        assert engine.prepare_store(ns, make_keys(2, tag="d")) is None
        clock.advance(0.001)
        grant = engine.prepare_store(ns, make_keys(2, tag="d"))
        assert grant is not None and grant.num_evicted == 2
        engine.check_invariants()


def test_a_hold_outlasts_a_ttl_pin_and_a_new_load_of_its_chunks() -> None:
    """Pins taken and dropped while a chunk is held move its pages between pinned and held,
    never to evictable, until the hold ends."""
    clock = FakeClock()
    with make_engine(num_pages=4, clock=clock, default_lease_s=5.0) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        store(engine, ns, k[:1])
        engine.prepare_load(ns, k[:1], lease_s=1.0)
        clock.advance(1.0)
        engine.expire()
        assert engine.stats().quarantined_load_pages == 1
        assert engine.pin(ns, k[:1], 2.0) == 1
        stats = engine.stats()
        assert stats.quarantined_load_pages == 0 and stats.pinned_pages == 1
        load = engine.prepare_load(ns, k[:1])
        assert engine.unpin(ns, k[:1]) == 1
        engine.complete_load(load.lease_id)
        stats = engine.stats()
        assert stats.quarantined_load_pages == 1 and stats.pinned_pages == 0
        engine.check_invariants()
        assert engine.prepare_store(ns, make_keys(4, tag="x")) is None
        clock.advance(5.0)
        assert engine.stats().quarantined_load_pages == 0
        assert engine.prepare_store(ns, make_keys(4, tag="x")) is not None
        engine.check_invariants()


def test_read_part_bad_arguments() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        a, b = make_keys(2)
        store(engine, ns, [a, b])
        load = engine.prepare_load(ns, [a])
        with pytest.raises(InvalidArgument):
            engine.read_part(load.lease_id, a, 2)
        with pytest.raises(InvalidArgument):
            engine.read_part(load.lease_id, b, 0)  # present but not pinned by this lease
        with pytest.raises(LeaseError):
            engine.read_part(load.lease_id + 100, a, 0)


# ============================================================================ payload


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize(
    "spec_kwargs",
    [
        {},
        {"tp_world_size": 2},
        {"part_bytes_override": 2 * PAGE + 123, "tp_world_size": 2},
        {"part_bytes_override": 100},
    ],
)
def test_write_part_read_part_byte_exact(policy: str, spec_kwargs: dict[str, Any]) -> None:
    spec = make_spec(**spec_kwargs)
    with make_engine(policy, num_pages=32) as engine:
        ns = engine.register_namespace(spec)
        keys = make_keys(4)
        store(engine, ns, keys)
        load = engine.prepare_load(ns, keys)
        for key in keys:
            for rank in range(spec.tp_world_size):
                views = engine.read_part(load.lease_id, key, rank)
                assert sum(v.nbytes for v in views) == spec.part_bytes
                assert read_back(engine, load.lease_id, key, rank) == pattern(
                    key, rank, spec.part_bytes
                )
        engine.complete_load(load.lease_id)


def test_write_part_accepts_any_buffer() -> None:
    spec = make_spec(part_bytes_override=64)
    with make_engine() as engine:
        ns = engine.register_namespace(spec)
        (key,) = make_keys(1)
        grant = engine.prepare_store(ns, [key])
        assert grant is not None
        engine.write_part(grant.lease_id, key, 0, memoryview(bytearray(range(64))))
        engine.complete_store(grant.lease_id)
        load = engine.prepare_load(ns, [key])
        assert read_back(engine, load.lease_id, key, 0) == bytes(range(64))


@pytest.mark.parametrize("size", [0, PAGE - 1, PAGE + 1, 2 * PAGE])
def test_write_part_wrong_payload_size(size: int) -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        (key,) = make_keys(1)
        grant = engine.prepare_store(ns, [key])
        assert grant is not None
        with pytest.raises(InvalidArgument, match="size"):
            engine.write_part(grant.lease_id, key, 0, b"\xff" * size)
        assert engine.arena.read(grant.locations[0][0]) == bytes(PAGE)


def test_write_part_bad_rank_or_key() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        a, b = make_keys(2)
        grant = engine.prepare_store(ns, [a])
        assert grant is not None
        for rank in (-1, 2, "0", 1.0):
            with pytest.raises(InvalidArgument):
                engine.write_part(grant.lease_id, a, rank, bytes(PAGE))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            engine.write_part(grant.lease_id, b, 0, bytes(PAGE))


def test_payload_of_other_entries_untouched_by_eviction_and_reuse() -> None:
    spec = make_spec(part_bytes_override=PAGE + 1)  # 2 pages, the second nearly empty
    with make_engine(num_pages=6) as engine:
        ns = engine.register_namespace(spec)
        k = make_keys(5)
        store(engine, ns, k[:3])
        engine.pin(ns, [k[1]], 100.0)
        store(engine, ns, k[3:4])  # evicts k0 and reuses its pages
        store(engine, ns, k[4:5])  # evicts k2
        load = engine.prepare_load(ns, [k[1], k[3], k[4]])
        for key in (k[1], k[3], k[4]):
            assert read_back(engine, load.lease_id, key, 0) == pattern(key, 0, spec.part_bytes)


@pytest.mark.parametrize("policy", ALL)
def test_victims_parts_are_recycled_by_the_store_that_evicts_them(policy: str) -> None:
    """A store that evicts chunks with parts of its own page count takes their parts as they
    are (pages and extents, with the byte size fixed up when it differs); the victims' other
    pages are freed and allocated to the rest; every byte read back is the stored one."""
    same = make_spec(model="test/same", part_bytes_override=2 * PAGE)
    shorter = make_spec(model="test/shorter", part_bytes_override=2 * PAGE - 100)
    small = make_spec(model="test/small")  # one page per part
    with make_engine(policy, num_pages=8) as engine:
        a, b, c = (engine.register_namespace(spec) for spec in (same, shorter, small))
        k = make_keys(12)
        store_each(engine, a, k[:2])
        store(engine, c, k[2:6])
        old = {key: engine.entries()[(0, key)].pages for key in k[:2]}
        engine.touch(c, k[2:6])  # the two 2-page chunks are the oldest: evicted first
        grant = store(engine, b, k[6:8])  # evicts k0, k1: same page count, fewer bytes
        assert engine.lookup(a, k[:2]) == 0
        assert sorted(engine.entries()[(1, key)].pages for key in k[6:8]) == sorted(old.values())
        for key, extents in zip(grant.keys, grant.locations, strict=True):
            assert sum(length for _, length in extents[0]) == shorter.part_bytes
            assert engine.entries()[(1, key)].extents == extents
        engine.check_invariants()
        engine.touch(c, k[2:6])  # b's 2-page chunks are the least used now, for every policy
        store(engine, c, k[8:12])  # evicts 2-page chunks for 1-page parts: freed, reallocated
        engine.check_invariants()
        assert engine.allocator.num_free == 0
        load = engine.prepare_load(c, k[8:12])
        for key in k[8:12]:
            assert read_back(engine, load.lease_id, key, 0) == pattern(key, 0, small.part_bytes)
        engine.complete_load(load.lease_id)
        owned = [p for e in engine.entries().values() for part in e.pages for p in part]
        assert len(owned) == len(set(owned)) == 8


# ============================================================================ TTL pins


@pytest.mark.parametrize("policy", ALL)
def test_ttl_pin_keeps_until_the_clock_passes(policy: str) -> None:
    clock = FakeClock()
    with make_engine(policy, num_pages=2, clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(4)
        store(engine, ns, k[:2])
        assert engine.pin(ns, k[:2], 30.0) == 2
        clock.advance(29.9)
        assert engine.prepare_store(ns, [k[2]]) is None
        assert engine.stats().pinned_pages == 2
        clock.advance(0.1)
        assert engine.stats().pinned_pages == 0
        assert engine.prepare_store(ns, k[2:]) is not None
        assert engine.lookup(ns, k[:2]) == 0
        engine.check_invariants()


@pytest.mark.parametrize("policy", ALL)
def test_unpin_releases(policy: str) -> None:
    clock = FakeClock()
    with make_engine(policy, num_pages=2, clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        store(engine, ns, k[:2])
        engine.pin(ns, k[:2], 30.0)
        assert engine.unpin(ns, [k[0], k[2]]) == 1
        assert engine.unpin(ns, [k[0]]) == 0
        assert engine.stats().pinned_pages == 1
        grant = engine.prepare_store(ns, [k[2]])
        assert grant is not None and grant.num_evicted == 1
        assert ready_keys(engine, ns, k[:2]) == [k[1]]
        clock.advance(30.0)  # the stale heap item of k0's pin is harmless
        assert engine.stats().pinned_pages == 0
        engine.check_invariants()


def test_pin_extends_never_shortens() -> None:
    clock = FakeClock()
    with make_engine(num_pages=1, clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(2)
        store(engine, ns, k[:1])
        engine.pin(ns, k[:1], 100.0)
        engine.pin(ns, k[:1], 10.0)  # shorter: ignored
        clock.advance(50.0)
        assert engine.prepare_store(ns, k[1:]) is None
        engine.pin(ns, k[:1], 100.0)  # extends to t+150
        clock.advance(60.0)
        assert engine.prepare_store(ns, k[1:]) is None
        clock.advance(40.0)
        assert engine.prepare_store(ns, k[1:]) is not None


def test_pin_and_load_pin_combine() -> None:
    clock = FakeClock()
    with make_engine(num_pages=1, clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(2)
        store(engine, ns, k[:1])
        load = engine.prepare_load(ns, k[:1], lease_s=100.0)
        engine.pin(ns, k[:1], 10.0)
        clock.advance(10.0)
        assert engine.stats().pinned_pages == 1  # still load-pinned
        engine.check_invariants()
        engine.pin(ns, k[:1], 10.0)
        engine.complete_load(load.lease_id)
        assert engine.stats().pinned_pages == 1  # still TTL-pinned
        assert engine.unpin(ns, k[:1]) == 1
        assert engine.stats().pinned_pages == 0
        engine.check_invariants()


def test_pin_counts_only_ready_keys() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        store(engine, ns, k[:1])
        engine.prepare_store(ns, k[1:2])
        assert engine.pin(ns, k, 5.0) == 1
        assert engine.stats().pinned_pages == 1


# ============================================================================ clients


@pytest.mark.parametrize("policy", ALL)
def test_release_client_releases_only_that_client(policy: str) -> None:
    with make_engine(policy, num_pages=16) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(8)
        store(engine, ns, k[:4])
        a_load = engine.prepare_load(ns, k[:2], client="a")
        b_load = engine.prepare_load(ns, k[1:3], client="b")
        a_store = engine.prepare_store(ns, k[4:6], client="a")
        b_store = engine.prepare_store(ns, k[6:8], client="b")
        assert a_store is not None and b_store is not None
        engine.pin(ns, [k[3]], 60.0)
        assert engine.release_client("a") == 2
        assert engine.release_client("a") == 0
        assert engine.release_client("nobody") == 0
        pins = [engine.entries()[(0, key)].pins for key in k[:4]]
        assert pins == [0, 1, 1, 0]
        stats = engine.stats()
        assert stats.reserved_pages == 2 and stats.pinned_pages == 3  # k1, k2 (b), k3 (TTL)
        assert stats.num_leases == 2
        with pytest.raises(LeaseError, match="released"):
            engine.complete_load(a_load.lease_id)
        with pytest.raises(LeaseError, match="released"):
            engine.complete_store(a_store.lease_id)
        engine.complete_load(b_load.lease_id)
        assert engine.complete_store(b_store.lease_id) == k[6:8]
        assert engine.lookup(ns, k[4:6]) == 0
        totals = engine.stats().totals
        assert totals.released_leases == 2 and totals.expired_leases == 0
        assert event_keys(engine.take_events(), BlockStored) == k[:4] + k[6:8]
        engine.check_invariants()


# ============================================================================ reuse gating


@pytest.mark.parametrize("policy", ALL)
def test_store_threshold_admits_after_two_recorded_lookups(policy: str) -> None:
    with make_engine(policy, store_threshold=2) as engine:
        ns = engine.register_namespace(make_spec())
        a, b = make_keys(2)
        grant = engine.prepare_store(ns, [a])
        assert grant is not None and grant.filtered == [a] and grant.keys == []
        assert grant.lease_id == 0
        engine.lookup(ns, [a, b], record=True)
        engine.lookup(ns, [a, b])  # not recorded
        engine.lookup(ns, [a, b], touch=True)  # not recorded either
        grant = engine.prepare_store(ns, [a, b])
        assert grant is not None and grant.filtered == [a, b] and grant.keys == []
        engine.lookup(ns, [a], record=True)
        grant = engine.prepare_store(ns, [a, b])
        assert grant is not None and grant.keys == [a] and grant.filtered == [b]
        engine.complete_store(grant.lease_id)
        assert engine.lookup(ns, [a, b]) == 1
        assert engine.stats().totals.filtered_chunks == 4
        assert engine.stats().namespaces[ns]["filtered_chunks"] == 4


@pytest.mark.parametrize("threshold", [0, 1])
def test_store_threshold_zero_or_one_does_not_gate(threshold: int) -> None:
    with make_engine(store_threshold=threshold) as engine:
        ns = engine.register_namespace(make_spec())
        grant = store(engine, ns, make_keys(2))
        assert grant.filtered == [] and len(grant.keys) == 2
        assert len(engine.reuse) == 0


def test_gating_is_per_namespace() -> None:
    with make_engine(store_threshold=2) as engine:
        a = engine.register_namespace(make_spec())
        b = engine.register_namespace(make_spec(model="test/other"))
        (key,) = make_keys(1)
        engine.lookup(a, [key], record=True)
        engine.lookup(a, [key], record=True)
        grant_b = engine.prepare_store(b, [key])
        assert grant_b is not None and grant_b.filtered == [key]
        grant_a = engine.prepare_store(a, [key])
        assert grant_a is not None and grant_a.keys == [key]


# ============================================================================ namespaces


@pytest.mark.parametrize("policy", ALL)
def test_namespaces_with_different_part_sizes_share_one_budget(policy: str) -> None:
    small = make_spec()  # 1 page per chunk
    big = make_spec(model="test/big", tp_world_size=2, part_bytes_override=2 * PAGE + 1)  # 6
    with make_engine(policy, num_pages=8) as engine:
        a, b = engine.register_namespace(small), engine.register_namespace(big)
        ka, kb = make_keys(8, tag="a"), make_keys(2, tag="b")
        store_each(engine, a, ka)
        engine.take_events()
        grant = store(engine, b, kb[:1])
        assert grant.num_evicted == 6
        assert ready_keys(engine, a, ka) == ka[6:]
        removed, stored = engine.take_events()
        assert isinstance(removed, BlockRemoved) and removed.ns_id == a
        assert removed.keys == tuple(ka[:6])
        assert isinstance(stored, BlockStored) and stored.ns_id == b and stored.keys == (kb[0],)
        stats = engine.stats()
        assert stats.free_pages == 0
        assert stats.namespaces[a]["entries"] == 2 and stats.namespaces[a]["bytes"] == 2 * PAGE
        assert stats.namespaces[b]["entries"] == 1
        assert stats.namespaces[b]["bytes"] == 2 * big.part_bytes
        # And back: a small chunk evicts the big one when it is the oldest evictable.
        store(engine, a, ka[:1])  # 1 page: evicts ka[6] (oldest)
        assert ready_keys(engine, a, ka) == [ka[0], ka[7]]
        engine.touch(a, [ka[0], ka[7]])
        store(engine, a, ka[1:3])  # evicts the big chunk: 6 pages freed, 2 used
        assert engine.lookup(b, kb[:1]) == 0
        assert engine.stats().free_pages == 4
        engine.check_invariants()


def test_same_key_in_two_namespaces_is_two_entries() -> None:
    spec_a, spec_b = make_spec(), make_spec(dtype="bfloat16")
    with make_engine() as engine:
        a, b = engine.register_namespace(spec_a), engine.register_namespace(spec_b)
        (key,) = make_keys(1)
        store(engine, a, [key])
        assert engine.lookup(b, [key]) == 0
        grant = engine.prepare_store(b, [key])
        assert grant is not None and grant.keys == [key]
        engine.write_part(grant.lease_id, key, 0, b"\x07" * spec_b.part_bytes)
        engine.complete_store(grant.lease_id)
        load_a, load_b = engine.prepare_load(a, [key]), engine.prepare_load(b, [key])
        assert read_back(engine, load_a.lease_id, key, 0) == pattern(key, 0, spec_a.part_bytes)
        assert read_back(engine, load_b.lease_id, key, 0) == b"\x07" * spec_b.part_bytes


def test_register_namespace_idempotent_and_capacity_checked() -> None:
    with make_engine(num_pages=4) as engine:
        spec = make_spec()
        ns = engine.register_namespace(spec)
        assert engine.register_namespace(make_spec(label="again")) == ns
        assert engine.namespaces == {ns: spec} and engine.namespace(ns) == spec
        assert engine.register_namespace(make_spec(tp_world_size=2, num_kv_heads=2)) != ns
        with pytest.raises(CapacityError):
            engine.register_namespace(make_spec(tp_world_size=4, part_bytes_override=PAGE + 1))
        assert len(engine.namespaces) == 2


def test_registrations_past_the_namespace_bound_are_capacity() -> None:
    """A client could register a namespace per hash seed without end (the daemon's memory,
    and replies listing them, grew with it); the registered ones stay usable."""
    with make_engine(num_pages=4) as engine:
        specs = [make_spec(hash_seed=f"s{i}") for i in range(MAX_NAMESPACES)]
        ids = [engine.register_namespace(spec) for spec in specs]
        with pytest.raises(CapacityError, match="too many namespaces"):
            engine.register_namespace(make_spec(hash_seed="one-more"))
        assert engine.register_namespace(make_spec(hash_seed="s7")) == ids[7]  # idempotent
        assert len(engine.namespaces) == MAX_NAMESPACES
        assert engine.lookup(ids[-1], make_keys(1)) == 0


# ============================================================================ bad input

CALLS: dict[str, Callable[[StorageEngine, str, Any], Any]] = {
    "lookup": lambda e, ns, keys: e.lookup(ns, keys, record=True, touch=True),
    "touch": lambda e, ns, keys: e.touch(ns, keys),
    "prepare_store": lambda e, ns, keys: e.prepare_store(ns, keys),
    "prepare_load": lambda e, ns, keys: e.prepare_load(ns, keys),
    "pin": lambda e, ns, keys: e.pin(ns, keys, 10.0),
    "unpin": lambda e, ns, keys: e.unpin(ns, keys),
}

BAD_KEYS: dict[str, tuple[Any, type[KVServerError]]] = {
    "short key": ([b"\x01" * 31], InvalidArgument),
    "long key": ([b"\x01" * 33], InvalidArgument),
    "xxhash-sized key": ([b"\x01" * 16], InvalidArgument),
    "str key": (["a" * 32], InvalidArgument),
    "bytearray key": ([bytearray(32)], InvalidArgument),
    "int key": ([7], InvalidArgument),
    "None key": ([None], InvalidArgument),
    "bad key after good": ([*make_keys(2), b"x"], InvalidArgument),
    "keys is bytes": (b"\x01" * 32, InvalidArgument),
    "keys is a set": ({b"\x01" * 32}, InvalidArgument),
    "keys is a generator": ((k for k in make_keys(1)), InvalidArgument),
    "keys is None": (None, InvalidArgument),
    "too many keys": (make_keys(5), InvalidArgument),
}


def loaded_engine(policy: str = "lru") -> tuple[StorageEngine, str]:
    """An engine with some of everything: ready, writing, load-pinned and TTL-pinned entries."""
    engine = make_engine(policy, num_pages=8, max_keys_per_request=4, store_threshold=2)
    ns = engine.register_namespace(make_spec())
    k = make_keys(4)
    for _ in range(2):
        engine.lookup(ns, k, record=True)
    store(engine, ns, k[:3])
    engine.prepare_store(ns, k[3:])
    engine.prepare_load(ns, k[:1])
    engine.pin(ns, k[1:2], 30.0)
    return engine, ns


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("case", sorted(BAD_KEYS))
def test_bad_keys_are_typed_errors_and_change_nothing(call: str, case: str) -> None:
    keys, error = BAD_KEYS[case]
    engine, ns = loaded_engine()
    with engine:
        before, stats = snapshot(engine), engine.stats()
        with pytest.raises(error) as info:
            CALLS[call](engine, ns, keys)
        assert isinstance(info.value, KVServerError)
        assert snapshot(engine) == before
        assert engine.stats() == stats


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("ns", ["0123456789abcdef", "", None, 0])
def test_unknown_namespace(call: str, ns: Any) -> None:
    engine, _ = loaded_engine()
    with engine:
        before, stats = snapshot(engine), engine.stats()
        with pytest.raises(UnknownNamespace):
            CALLS[call](engine, ns, make_keys(1))
        with pytest.raises(UnknownNamespace):
            engine.namespace(ns)
        assert snapshot(engine) == before and engine.stats() == stats


BAD_DURATIONS = [0, 0.0, -1.0, 600.001, math.inf, math.nan, "5", [5]]


@pytest.mark.parametrize("call", ["prepare_store", "prepare_load"])
@pytest.mark.parametrize("lease_s", BAD_DURATIONS, ids=repr)
def test_bad_lease_durations(call: str, lease_s: Any) -> None:
    engine, ns = loaded_engine()
    with engine:
        before, stats = snapshot(engine), engine.stats()
        keys = make_keys(1) if call == "prepare_load" else make_keys(1, tag="new")
        with pytest.raises(InvalidArgument):
            getattr(engine, call)(ns, keys, lease_s=lease_s)
        assert snapshot(engine) == before and engine.stats() == stats


@pytest.mark.parametrize(
    "ttl", [*BAD_DURATIONS[:3], 24 * 3600.0 + 1, math.inf, math.nan, "5"], ids=repr
)
def test_bad_ttl(ttl: Any) -> None:
    engine, ns = loaded_engine()
    with engine:
        before, stats = snapshot(engine), engine.stats()
        with pytest.raises(InvalidArgument):
            engine.pin(ns, make_keys(3), ttl)
        assert snapshot(engine) == before and engine.stats() == stats


def test_max_durations_are_accepted() -> None:
    with make_engine(num_pages=4) as engine:
        ns = engine.register_namespace(make_spec())
        store(engine, ns, make_keys(1), lease_s=600)
        engine.prepare_load(ns, make_keys(1), lease_s=600.0)
        assert engine.pin(ns, make_keys(1), 24 * 3600) == 1


def test_keys_sized_for_the_namespace_hash() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec(hash_algo="xxhash_cbor"))
        keys = make_keys(2, size=16)
        store(engine, ns, keys)
        assert engine.lookup(ns, keys) == 2
        with pytest.raises(InvalidArgument):
            engine.lookup(ns, make_keys(1))


def test_cut_keys_are_whole_keys_checked_once_when_cut() -> None:
    """Keys cut from one buffer (gRPC packed_keys) serve every call like a list of the same
    keys; cut at another namespace's size they get the per-key check and its error."""
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        keys = make_keys(5)
        keys[2] = keys[2][:-2] + b"\x00\x00"  # trailing NULs are part of the key
        cut = CutKeys(b"".join(keys), 32)
        assert list(cut) == keys and all(type(k) is bytes for k in cut)
        store(engine, ns, list(cut[:3]))
        assert engine.lookup(ns, cut) == 3
        assert engine.pin(ns, cut, 30.0) == 3
        with pytest.raises(InvalidArgument, match="32 bytes"):
            engine.lookup(ns, CutKeys(b"".join(keys), 16))
        with pytest.raises(ValueError, match="whole keys"):
            CutKeys(bytes(33), 32)
        assert CutKeys(b"", 32) == ()


def test_hashed_keys_skip_the_per_key_check_only_at_their_namespace_size() -> None:
    """Digests of the namespace's own hasher (the daemon's token paths) serve every call like a
    list of the same keys without a per-key check; marked with another size they get it."""
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        keys = make_keys(5)
        hashed = HashedKeys(keys, 32)
        assert list(hashed) == keys and hashed.key_size == 32
        store(engine, ns, keys[:3])
        assert engine.lookup(ns, hashed) == 3
        assert engine.missing(ns, hashed) == keys[3:]
        assert engine.pin(ns, hashed, 30.0) == 3
        short = HashedKeys([k[:16] for k in keys], 16)  # not this namespace's size: checked
        with pytest.raises(InvalidArgument, match="32 bytes"):
            engine.lookup(ns, short)


# ============================================================================ events


@pytest.mark.parametrize("policy", ALL)
def test_events_batched_per_operation_with_gap_free_sequence(policy: str) -> None:
    with make_engine(policy, num_pages=4) as engine:
        a = engine.register_namespace(make_spec())
        b = engine.register_namespace(make_spec(model="test/b"))
        ka, kb = make_keys(3, tag="a"), make_keys(3, tag="b")
        grant = engine.prepare_store(a, ka)
        assert grant is not None
        assert engine.take_events() == []  # reserving announces nothing
        engine.complete_store(grant.lease_id)
        first = engine.take_events()
        assert [(type(e), e.ns_id, e.keys) for e in first] == [(BlockStored, a, tuple(ka))]
        assert engine.take_events() == []
        store(engine, b, kb[:1])
        order = [key for n, key in engine.policy if n == 0]  # type: ignore[misc]
        store(engine, b, kb[1:])  # evicts two of ka (ka[0], ka[1] for LRU): one BlockRemoved
        rest = engine.take_events()
        assert [(type(e), e.ns_id, e.keys) for e in rest] == [
            (BlockStored, b, (kb[0],)),
            (BlockRemoved, a, tuple(order[:2])),
            (BlockStored, b, tuple(kb[1:])),
        ]
        seqs = [e.seq for e in first + rest]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert all(e.medium == "CPU" for e in first + rest)


def test_one_removed_event_per_namespace_per_eviction() -> None:
    with make_engine(num_pages=4) as engine:
        a = engine.register_namespace(make_spec())
        b = engine.register_namespace(make_spec(model="test/b"))
        c = engine.register_namespace(make_spec(model="test/c"))
        ka, kb = make_keys(2, tag="a"), make_keys(2, tag="b")
        store(engine, a, ka[:1])
        store(engine, b, kb[:1])
        store(engine, a, ka[1:])
        store(engine, b, kb[1:])
        engine.take_events()
        store(engine, c, make_keys(3, tag="c"))
        removed = [e for e in engine.take_events() if isinstance(e, BlockRemoved)]
        assert sorted((e.ns_id, e.keys) for e in removed) == sorted(
            [(a, (ka[0], ka[1])), (b, (kb[0],))]
        )


# ============================================================================ stats


def test_stats_counters_and_page_accounting() -> None:
    clock = FakeClock()
    with make_engine(num_pages=8, clock=clock) as engine:
        spec = make_spec(tp_world_size=2)
        ns = engine.register_namespace(spec)
        k = make_keys(6)
        store(engine, ns, k[:3])  # 6 pages ready
        assert engine.lookup(ns, k) == 3  # 3 hits, 3 misses
        engine.prepare_load(ns, k[:1])  # 2 pinned
        grant = engine.prepare_store(ns, k[3:5])  # 4 pages: 2 free + evict k1 (2 pages)
        assert grant is not None and grant.num_evicted == 1
        stats = engine.stats()
        assert stats.capacity_bytes == 8 * PAGE and stats.page_size == PAGE
        assert (stats.free_pages, stats.reserved_pages, stats.ready_pages, stats.pinned_pages) == (
            0,
            4,
            2,
            2,
        )
        assert stats.num_entries == 2 and stats.num_writing == 2 and stats.num_leases == 2
        assert stats.used_bytes == 8 * PAGE
        t = stats.totals
        assert (t.lookups, t.hit_chunks, t.miss_chunks) == (1, 3, 3)
        assert (t.stored_chunks, t.loaded_chunks, t.evicted_chunks) == (3, 1, 1)
        assert stats.policy == "lru"
        assert stats.namespaces[ns]["entries"] == 2
        assert stats.namespaces[ns]["bytes"] == 2 * 2 * spec.part_bytes
        assert stats.namespaces[ns]["hit_chunks"] == 3
        as_dict = stats.to_dict()
        assert as_dict["used_bytes"] == 8 * PAGE and as_dict["totals"]["hit_chunks"] == 3
        engine.check_invariants()


# ============================================================================ lifetime


def test_close_removes_the_shm_file() -> None:
    engine = make_engine()
    path = engine.arena.path
    assert os.path.exists(path)
    with engine:
        pass
    assert not os.path.exists(path)
    engine.close()  # idempotent


def test_close_with_outstanding_read_views() -> None:
    with make_engine() as engine:
        ns = engine.register_namespace(make_spec())
        store(engine, ns, make_keys(1))
        load = engine.prepare_load(ns, make_keys(1))
        views = engine.read_part(load.lease_id, make_keys(1)[0], 0)
        path = engine.arena.path
    assert not os.path.exists(path)
    del views


@pytest.mark.parametrize(
    "config",
    [{"store_threshold": -1}, {"max_tracker_size": 0}, {"policy": "fifo"}, {"page_size": 1000}],
)
def test_bad_config_leaks_no_shm_file(tmp_path: Path, config: dict[str, Any]) -> None:
    """A config rejected after the arena was created left its shm file behind."""
    with pytest.raises(InvalidArgument):
        StorageEngine(EngineConfig(dram_bytes=16 * PAGE, shm_dir=str(tmp_path), **config))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "config",
    [
        {"dram_bytes": PAGE - 1, "page_size": PAGE},
        {"default_lease_s": 0},
        {"default_lease_s": 700.0},
        {"max_keys_per_request": 0},
    ],
)
def test_bad_engine_config(config: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        EngineConfig(**config)


def test_complete_store_with_no_ranks_is_an_error() -> None:
    """A worker reporting an empty rank list gets an error instead of a silent no-op."""
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2, num_kv_heads=2))
        grant = engine.prepare_store(ns, make_keys(1))
        assert grant is not None
        with pytest.raises(InvalidArgument, match="at least one rank"):
            engine.complete_store(grant.lease_id, ranks=[])
        assert engine.complete_store(grant.lease_id, ranks=[0, 1]) == grant.keys


def test_rejected_store_changes_no_counter() -> None:
    """prepare_store returning None (cache full of pinned entries) leaves the counters alone."""
    with make_engine(num_pages=4, store_threshold=2) as engine:
        ns = engine.register_namespace(make_spec())
        keys = make_keys(6)
        engine.lookup(ns, keys, record=True)
        engine.lookup(ns, keys[:5], record=True)
        store(engine, ns, keys[:4])
        engine.prepare_load(ns, keys[:4])
        before = engine.stats().totals
        assert engine.prepare_store(ns, keys[4:]) is None
        after = engine.stats().totals
        assert after.filtered_chunks == before.filtered_chunks
        assert after.store_rejections == before.store_rejections + 1


def _chain_full_of_conversations(engine: StorageEngine) -> tuple[str, list[bytes], Any]:
    """Teach ``chain`` (an engine of 57 pages: the prompt + 4 x 14 chunks) that documents (a
    prompt, then many chunks nobody reads again) leave unread, until the conversations fill
    the cache; then look a new document up. Returns (namespace, the document, ``serve``: a
    planning lookup of a whole chain, then its missing keys stored; False if none was)."""
    ns = engine.register_namespace(make_spec())
    assert engine.policy.admits
    prompt = make_keys(1, tag="sys")

    def serve(keys: list[bytes]) -> bool:
        hits = engine.lookup(ns, keys, record=True, touch=True)
        grant = engine.prepare_store(ns, keys[hits:])
        if grant is None or (grant.filtered and not grant.keys):
            return False
        if grant.keys:
            write_all(engine, grant)
            engine.complete_store(grant.lease_id)
        return True

    for r in range(7):
        for c in range(4):
            assert serve(prompt + make_keys(2 * (r + 1), tag=f"c{c}-"))
            if c % 2 and r < 3:
                serve(prompt + make_keys(40, tag=f"d{r}{c}-"))
    # the conversations fill the cache: the documents have left
    assert all(ready_keys(engine, ns, prompt + make_keys(14, tag=f"c{c}-")) for c in range(4))
    assert engine.allocator.num_free == 0
    doc = prompt + make_keys(40, tag="late-")
    assert engine.lookup(ns, doc, record=True, touch=True) == 1
    return ns, doc, serve


def test_chain_declines_a_document_store_through_the_engine() -> None:
    """The engine shows an admitting policy a store's new keys: once ``chain`` has seen
    documents leave unread, a document whose store would displace the conversations is
    refused (nothing changed; the new keys come back as not admitted, ``filtered``, counted
    as reuse gating's are, not as a store rejection) and the conversations' next turns are
    stored."""
    with make_engine("chain", num_pages=57) as engine:
        ns, doc, serve = _chain_full_of_conversations(engine)
        before = snapshot(engine)
        totals = engine.stats().totals
        rejections, not_admitted = totals.store_rejections, totals.filtered_chunks
        declined = engine.prepare_store(ns, doc[1:])
        assert declined is not None and engine.policy.declined
        assert (declined.lease_id, declined.keys, declined.filtered) == (0, [], doc[1:])
        assert snapshot(engine) == before
        totals = engine.stats().totals
        assert totals.store_rejections == rejections
        assert totals.filtered_chunks == not_admitted + len(doc) - 1
        assert serve(make_keys(1, tag="sys") + make_keys(15, tag="c0-"))
        engine.check_invariants()


def test_chain_never_declines_a_placement() -> None:
    """A ``gated=False`` store (an SSD promotion, a peer fetch's placement: chunks a load asked
    for, which a lower tier or a peer holds) is not shown to admission: the same document
    ``chain`` declines as a client's store is placed whole, evicting what it must, so the
    load that asked for it finds it (before, it came back ``filtered`` and the load missed
    every chunk of it)."""
    with make_engine("chain", num_pages=57) as engine:
        ns, doc, _ = _chain_full_of_conversations(engine)
        grant = engine.prepare_store(ns, doc[1:], gated=False)
        assert grant is not None and not engine.policy.declined
        assert (grant.keys, grant.filtered, grant.num_evicted) == (doc[1:], [], len(doc) - 1)
        write_all(engine, grant)
        assert engine.settle_store(grant.lease_id, grant.keys) == doc[1:]
        assert engine.lookup(ns, doc) == len(doc)
        engine.check_invariants()
