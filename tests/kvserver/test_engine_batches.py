"""Tests of the storage engine's batch calls (``settle_store``, ``write_parts``, ``read_parts``,
``missing``), the reservation that recycles victims' parts whole, and ``KVService.put`` over
them: each does for a batch what the per-key calls do, and a failure in the middle of a batch
leaves nothing half-visible.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvserver.daemon.service import KVService
from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig, EntryState
from kvserver.errors import InvalidArgument, InvalidState, LeaseError, LeaseExpired, UnknownKey
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
)
from tests.kvserver.test_engine import snapshot

ALL = sorted(POLICIES)


def arena_bytes(engine: StorageEngine, ns_id: str, keys: list[bytes]) -> list[bytes]:
    """The bytes at every part of ``keys`` (READY or WRITING), read straight from the arena."""
    ns = engine.namespace_index(ns_id)
    entries = engine.entries()
    return [engine.arena.read(ext) for key in keys for ext in entries[(ns, key)].extents]


def parts_of(engine: StorageEngine, ns_id: str, keys: list[bytes]) -> list[bytes]:
    """The pattern payload of every part of ``keys``, key-major."""
    spec = engine.namespace(ns_id)
    return [pattern(k, r, spec.part_bytes) for k in keys for r in range(spec.tp_world_size)]


# ============================================================================ settle_store


@pytest.mark.parametrize("policy", ALL)
def test_settle_store_makes_the_written_keys_ready_and_rolls_back_the_rest(policy: str) -> None:
    with make_engine(policy, num_pages=8) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(4)
        grant = engine.prepare_store(ns, k)
        assert grant is not None
        engine.take_events()
        for key in (k[0], k[2]):
            engine.write_part(grant.lease_id, key, 0, pattern(key, 0, PAGE))
        assert engine.settle_store(grant.lease_id, [k[2], k[0], k[2]]) == [k[2], k[0]]
        assert engine.missing(ns, k) == [k[1], k[3]]
        assert all((engine.namespace_index(ns), key) not in engine.entries() for key in k[1::2])
        events = engine.take_events()
        assert [(type(e), e.keys) for e in events] == [(BlockStored, (k[2], k[0]))]
        assert engine.allocator.num_free == 6
        counters = engine.stats().totals
        assert (counters.stored_chunks, counters.rolled_back_chunks) == (2, 2)
        with pytest.raises(LeaseError):
            engine.complete_store(grant.lease_id)
        load = engine.prepare_load(ns, [k[0], k[2]])
        assert read_back(engine, load.lease_id, k[2], 0) == pattern(k[2], 0, PAGE)
        engine.check_invariants()


def test_settle_store_of_every_key_rolls_nothing_back() -> None:
    with make_engine(num_pages=8) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        k = make_keys(3)
        grant = engine.prepare_store(ns, k)
        assert grant is not None
        engine.complete_store(grant.lease_id, ranks=[1], keys=[k[1]])  # one part completed
        assert engine.settle_store(grant.lease_id, k) == k
        assert engine.missing(ns, k) == []
        assert engine.stats().totals.rolled_back_chunks == 0
        engine.check_invariants()


def test_settle_store_of_nothing_rolls_everything_back_and_announces_nothing() -> None:
    with make_engine(num_pages=8) as engine:
        ns = engine.register_namespace(make_spec())
        grant = engine.prepare_store(ns, make_keys(3))
        assert grant is not None
        engine.take_events()
        assert engine.settle_store(grant.lease_id, []) == []
        assert engine.take_events() == []
        assert engine.allocator.num_free == 8 and not engine.entries()
        engine.check_invariants()


def test_settle_store_refuses_a_key_the_lease_does_not_hold_and_changes_nothing() -> None:
    with make_engine(num_pages=8) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(4)
        grant = engine.prepare_store(ns, k[:3])
        assert grant is not None
        before = snapshot(engine)
        with pytest.raises(InvalidArgument, match="not reserved"):
            engine.settle_store(grant.lease_id, [k[0], k[3]])
        assert snapshot(engine) == before
        assert engine.settle_store(grant.lease_id, k[:3]) == k[:3]


def test_settle_store_of_an_expired_lease_raises_lease_expired() -> None:
    clock = FakeClock()
    with make_engine(num_pages=8, clock=clock) as engine:
        ns = engine.register_namespace(make_spec())
        grant = engine.prepare_store(ns, make_keys(2), lease_s=5.0)
        assert grant is not None
        clock.advance(6.0)
        with pytest.raises(LeaseExpired):
            engine.settle_store(grant.lease_id, grant.keys)
        assert not engine.entries()
        engine.check_invariants()


# ============================================================================ write_parts


def test_write_parts_writes_every_part_in_key_major_order() -> None:
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        k = make_keys(3)
        grant = engine.prepare_store(ns, k)
        assert grant is not None
        engine.write_parts(grant.lease_id, k, [0, 1], parts_of(engine, ns, k))
        assert engine.complete_store(grant.lease_id) == k
        assert arena_bytes(engine, ns, k) == parts_of(engine, ns, k)


def test_write_parts_of_one_rank_then_the_other() -> None:
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        k = make_keys(2)
        grant = engine.prepare_store(ns, k)
        assert grant is not None
        size = engine.namespace(ns).part_bytes
        for rank in (1, 0):
            engine.write_parts(grant.lease_id, k, [rank], [pattern(x, rank, size) for x in k])
            engine.complete_store(grant.lease_id, ranks=[rank], keys=k)
        assert engine.missing(ns, k) == []
        assert arena_bytes(engine, ns, k) == parts_of(engine, ns, k)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("size of the last part", InvalidArgument),
        ("a key not reserved", InvalidArgument),
        ("a part completed before", InvalidState),
        ("a rank out of range", InvalidArgument),
        ("a rank named twice", InvalidArgument),
        ("a part too few", InvalidArgument),
    ],
)
def test_a_bad_part_in_the_middle_of_write_parts_writes_nothing(case: str, error: type) -> None:
    """Every part is checked before the first is copied: the arena is unchanged."""
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        k = make_keys(4)
        grant = engine.prepare_store(ns, k[:3])
        assert grant is not None
        engine.complete_store(grant.lease_id, ranks=[0], keys=[k[1]])
        keys, ranks = k[:3], [1]
        parts: list[Any] = [pattern(x, 1, engine.namespace(ns).part_bytes) for x in keys]
        if case == "size of the last part":
            parts[-1] = parts[-1][:-1]
        elif case == "a key not reserved":
            keys = [k[0], k[3], k[2]]
        elif case == "a part completed before":
            ranks = [0]
        elif case == "a rank out of range":
            ranks = [2]
        elif case == "a rank named twice":
            ranks, parts = [1, 1], parts + parts
        else:
            parts = parts[:-1]
        before = arena_bytes(engine, ns, k[:3])
        with pytest.raises(error):
            engine.write_parts(grant.lease_id, keys, ranks, parts)
        assert arena_bytes(engine, ns, k[:3]) == before
        assert engine.missing(ns, k) == k
        engine.check_invariants()


# ============================================================================ read_parts


def test_read_parts_gives_the_views_key_major() -> None:
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec(tp_world_size=2))
        k = make_keys(3)
        store(engine, ns, k)
        load = engine.prepare_load(ns, k)
        views = engine.read_parts(load.lease_id, [k[2], k[0]], [1, 0])
        got = [b"".join(bytes(v) for v in part) for part in views]
        size = engine.namespace(ns).part_bytes
        assert got == [pattern(k[2], 1, size), pattern(k[2], 0, size),
                       pattern(k[0], 1, size), pattern(k[0], 0, size)]  # fmt: skip
        # the lease's own keys (no membership test), one rank and both
        for ranks in ([1], [0, 1]):
            views = engine.read_parts(load.lease_id, list(k), ranks)
            got = [b"".join(bytes(v) for v in part) for part in views]
            assert got == [pattern(key, r, size) for key in k for r in ranks]


def test_read_parts_refuses_a_key_the_lease_does_not_pin_or_a_bad_rank() -> None:
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(3)
        store(engine, ns, k)
        load = engine.prepare_load(ns, k[:2])
        with pytest.raises(InvalidArgument, match="not pinned"):
            engine.read_parts(load.lease_id, [k[0], k[2]], [0])
        with pytest.raises(InvalidArgument, match="rank"):
            engine.read_parts(load.lease_id, [k[0]], [1])
        with pytest.raises(LeaseError):
            engine.read_parts(load.lease_id + 1, [k[0]], [0])


# ============================================================================ missing


def test_missing_names_the_keys_not_ready_in_order_writing_ones_included() -> None:
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(5)
        assert engine.missing(ns, k) == k
        store(engine, ns, [k[1], k[3]])
        grant = engine.prepare_store(ns, [k[4]])  # WRITING: not ready
        assert grant is not None
        assert engine.missing(ns, k) == [k[0], k[2], k[4]]
        assert engine.missing(ns, iter([k[3], k[0], k[0]])) == [k[0], k[0]]
        assert engine.missing(ns, [k[1], k[3]]) == []


# ============================================================================ recycling victims


@pytest.mark.parametrize("policy", ALL)
def test_victims_of_the_same_part_size_and_another_tp_world_are_recycled(policy: str) -> None:
    """One-page parts in a TP-2 namespace and a TP-1 one: a victim hands over its parts
    whole, a surplus part is freed, and each side's bytes survive the other's stores."""
    with make_engine(policy, num_pages=4) as engine:
        tp2 = engine.register_namespace(
            make_spec(model="test/tp2", tp_world_size=2, part_bytes_override=PAGE)
        )
        tp1 = engine.register_namespace(make_spec(model="test/tp1", part_bytes_override=PAGE))
        a, b = make_keys(4, tag="a"), make_keys(4, tag="b")
        store(engine, tp2, a[:2])  # the arena is full
        store(engine, tp1, [b[0]])  # evicts one TP-2 chunk: one of its parts is surplus
        engine.check_invariants()
        assert engine.allocator.num_free == 1
        store(engine, tp1, b[1:3])  # one free page, then another TP-2 chunk's two parts
        engine.check_invariants()
        assert engine.missing(tp2, a[:2]) == a[:2]
        store(engine, tp1, [b[3]])  # the last free page: full of TP-1 chunks
        assert engine.allocator.num_free == 0
        store(engine, tp2, [a[2]])  # two TP-1 victims become one TP-2 chunk's parts
        engine.check_invariants()
        removed = [e for e in engine.take_events() if isinstance(e, BlockRemoved)]
        assert sum(len(e.keys) for e in removed) == 4
        held = [key for key in b if not engine.missing(tp1, [key])]
        assert len(held) == 2
        for ns, keys in ((tp2, [a[2]]), (tp1, held)):
            load = engine.prepare_load(ns, keys)
            spec = engine.namespace(ns)
            for key in keys:
                for rank in range(spec.tp_world_size):
                    assert read_back(engine, load.lease_id, key, rank) == pattern(key, rank, PAGE)
            engine.complete_load(load.lease_id)
        assert engine.entries()[(engine.namespace_index(tp2), a[2])].state is EntryState.READY


# ============================================================================ KVService.put


def test_put_that_fails_in_the_middle_of_its_copies_leaves_nothing_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault injected at the third part's copy (a real arena cannot fail one): the error
    comes out of ``put``, no key of the batch is READY or announced, the pages are free."""
    service = KVService(EngineConfig(dram_bytes=16 * PAGE, page_size=PAGE))
    try:
        engine = service.engine
        ns = service.register_namespace(make_spec())["ns_id"]
        k = make_keys(5)
        store(engine, ns, k[:1])
        service.publish()
        last_seq = service.events.last_seq
        calls = 0
        write = engine.arena.write

        def failing_write(extents: Any, data: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise OSError("injected: the copy failed")
            write(extents, data)

        monkeypatch.setattr(engine.arena, "write", failing_write)
        with pytest.raises(OSError, match="injected"):
            service.put(ns, k, parts_of(engine, ns, k), client="c")
        assert calls == 3
        assert engine.missing(ns, k) == k[1:]
        assert not any(isinstance(e, BlockStored) for e in service.events.replay(last_seq + 1))
        assert engine.allocator.num_free == 15 and len(engine.entries()) == 1
        assert len(engine.leases) == 0
        engine.check_invariants()
        monkeypatch.undo()
        r = service.put(ns, k, parts_of(engine, ns, k), client="c")
        assert (r.stored, r.present) == (k[1:], k[:1])
        assert arena_bytes(engine, ns, k) == parts_of(engine, ns, k)
    finally:
        service.close()


# ============================================================================ prepare_load


def test_a_load_batch_with_a_key_missing_in_the_middle_pins_nothing_and_names_it() -> None:
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec())
        k = make_keys(4)
        store(engine, ns, [k[0], k[1], k[3]])
        grant = engine.prepare_store(ns, [k[2]])  # WRITING: not loadable either
        assert grant is not None
        before = snapshot(engine)
        with pytest.raises(UnknownKey) as caught:
            engine.prepare_load(ns, k)
        assert caught.value.context["key"] == k[2]
        assert snapshot(engine) == before
        assert engine.stats().pinned_pages == 0


def test_a_load_of_no_keys_is_an_empty_grant_even_before_any_store() -> None:
    with make_engine(num_pages=16) as engine:
        ns = engine.register_namespace(make_spec())
        load = engine.prepare_load(ns, [])
        assert (load.keys, load.locations) == ([], [])
        engine.complete_load(load.lease_id)
