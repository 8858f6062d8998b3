"""kvserver/engine/stats.py: the engine's counters have one owner that bumps a namespace's
counters and the totals alike, and the stats snapshot is a value of its own. (The figures of
each engine call are tested in test_engine.py, through ``stats()``.)"""

from __future__ import annotations

import pytest

from kvserver.engine.stats import COUNTER_NAMES, Counters, EngineCounters
from tests.kvserver.builders import FakeClock, make_engine, make_keys, make_spec, write_all


def counted() -> EngineCounters:
    """Two namespaces, every kind of count in each (different amounts)."""
    counters = EngineCounters()
    counters.add_namespace()
    counters.add_namespace()
    for ns in (0, 1):
        counters.looked_up(ns, hits=2 + ns, misses=1)
        counters.store_rejected(ns)
        counters.filtered(ns, 3)
        counters.loaded(ns, 4 + ns)
        counters.stored(ns, 5)
        counters.evicted(ns, 6)
        counters.rolled_back(ns, 7, quarantined=ns == 1)
        counters.held(ns, 8)
        counters.lease_ended(ns, expired=True)
        counters.lease_ended(ns, expired=ns == 0)
    return counters


def test_every_count_goes_to_its_namespace_and_to_the_totals() -> None:
    counters = counted()
    counters.check_invariants()
    first, second = counters.per_namespace
    assert (first.lookups, first.hit_chunks, first.miss_chunks) == (1, 2, 1)
    assert (second.hit_chunks, second.loaded_chunks) == (3, 5)
    assert (first.quarantined_chunks, second.quarantined_chunks) == (0, 7)
    assert (first.expired_leases, first.released_leases) == (2, 0)
    assert (second.expired_leases, second.released_leases) == (1, 1)
    totals = counters.totals
    assert (totals.rolled_back_chunks, totals.quarantined_load_chunks) == (14, 16)
    assert totals.store_rejections == 2 and totals.filtered_chunks == 6


def test_the_invariant_check_sees_a_total_that_is_not_the_sum() -> None:
    counters = counted()
    counters.per_namespace[1].stored_chunks += 1  # bumped past the owner
    with pytest.raises(AssertionError, match="stored_chunks"):
        counters.check_invariants()


def test_a_snapshot_is_a_copy_later_counts_do_not_change() -> None:
    counters = counted()
    snapshot = counters.snapshot()
    assert snapshot == counters.totals and snapshot is not counters.totals
    counters.looked_up(0, 1, 0)
    assert snapshot.lookups == 2 and counters.totals.lookups == 3
    assert tuple(Counters.__dataclass_fields__) == COUNTER_NAMES


def test_an_engine_counts_in_its_counters_and_its_stats_show_them() -> None:
    """Per namespace and in total, through the facade, the events and the lease book."""
    clock = FakeClock()
    with make_engine(num_pages=8, clock=clock) as engine:
        a = engine.register_namespace(make_spec(model="a"))
        b = engine.register_namespace(make_spec(model="b"))
        keys = make_keys(3)
        grant = engine.prepare_store(a, keys)
        assert grant is not None
        write_all(engine, grant)
        engine.complete_store(grant.lease_id)
        assert engine.lookup(a, keys + make_keys(1, tag="miss")) == 3
        reserved = engine.prepare_store(b, keys[:2])
        assert reserved is not None
        clock.advance(engine.config.max_lease_s + 1)
        assert engine.expire() == 1  # b's reservation rolled back (quarantined)
        engine.check_invariants()
        stats = engine.stats()
        row_a, row_b = stats.namespaces[a], stats.namespaces[b]
        assert (row_a["stored_chunks"], row_a["hit_chunks"], row_a["miss_chunks"]) == (3, 3, 1)
        assert (row_b["rolled_back_chunks"], row_b["expired_leases"]) == (2, 1)
        assert row_b["stored_chunks"] == 0 and row_a["expired_leases"] == 0
        assert stats.totals.stored_chunks == 3 and stats.totals.rolled_back_chunks == 2
        assert engine.totals is not stats.totals and engine.totals.lookups == 1
