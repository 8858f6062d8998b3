"""The storage engine's seams for lower tiers (kvserver/engine/core.py): the ``on_evict`` hook sees
every victim while its pages still hold its bytes, ``prepare_store(gated=False)`` bypasses
reuse gating for promotions, ``Entry.uses`` counts uses for the SSD admission rule, and
``announce`` puts another tier's events into the one gap-free sequence."""

from __future__ import annotations

import pytest

from kvserver.engine.types import Entry
from kvserver.errors import UnknownNamespace
from kvserver.events import BlockRemoved, BlockStored
from kvserver.namespace import NamespaceSpec
from kvserver.policies import POLICIES
from tests.kvserver.builders import make_engine, make_keys, make_spec, pattern, store

POLICY_NAMES = sorted(POLICIES)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_on_evict_sees_the_victims_bytes_before_their_pages_are_freed(policy: str) -> None:
    spec = make_spec(tp_world_size=2)
    seen: dict[bytes, list[bytes]] = {}
    with make_engine(policy, num_pages=4) as engine:
        ns_id = engine.register_namespace(spec)

        def hook(s: NamespaceSpec, victims: list[Entry]) -> None:
            assert s == spec
            for e in victims:
                assert not engine.contains(ns_id, e.key), "already out of the index"
                seen[e.key] = [b"".join(engine.arena.views(e.extents[r])) for r in range(2)]

        engine.on_evict = hook
        first, second = make_keys(2, tag="a"), make_keys(2, tag="b")
        store(engine, ns_id, first)
        store(engine, ns_id, second)  # evicts both chunks of ``first``
        assert sorted(seen) == sorted(first)
        for key in first:
            assert seen[key] == [pattern(key, r, spec.part_bytes) for r in range(2)]
        engine.check_invariants()


def test_a_failing_hook_does_not_break_eviction(caplog: pytest.LogCaptureFixture) -> None:
    with make_engine(num_pages=2) as engine:
        ns_id = engine.register_namespace(make_spec())

        def hook(spec: NamespaceSpec, victims: list[Entry]) -> None:
            raise RuntimeError("lower tier broke")

        engine.on_evict = hook
        store(engine, ns_id, make_keys(2, tag="a"))
        store(engine, ns_id, make_keys(2, tag="b"))
        assert engine.lookup(ns_id, make_keys(2, tag="b")) == 2
        assert "on_evict hook failed" in caplog.text
        engine.check_invariants()


def test_ungated_store_bypasses_reuse_gating() -> None:
    with make_engine(store_threshold=2) as engine:
        ns_id = engine.register_namespace(make_spec())
        keys = make_keys(2)
        grant = engine.prepare_store(ns_id, keys)
        assert grant is not None and grant.keys == [] and grant.filtered == keys
        grant = engine.prepare_store(ns_id, keys, gated=False)
        assert grant is not None and grant.keys == keys
        engine.complete_store(grant.lease_id, success=False)
        engine.check_invariants()


def test_uses_count_stores_loads_and_touching_lookups() -> None:
    uses: dict[bytes, int] = {}
    with make_engine(num_pages=2) as engine:
        ns_id = engine.register_namespace(make_spec())
        engine.on_evict = lambda spec, victims: uses.update({e.key: e.uses for e in victims})
        a, b = make_keys(2, tag="u")
        store(engine, ns_id, [a, b])
        engine.lookup(ns_id, [a, b])  # a router query: not a use
        engine.lookup(ns_id, [a], record=True)
        engine.lookup(ns_id, [a], touch=True)
        grant = engine.prepare_load(ns_id, [a, b])
        engine.complete_load(grant.lease_id)
        store(engine, ns_id, make_keys(2, tag="v"))
        assert uses == {a: 4, b: 2}


def test_announce_numbers_other_tiers_events_in_the_same_sequence() -> None:
    with make_engine() as engine:
        ns_id = engine.register_namespace(make_spec())
        keys = make_keys(2)
        store(engine, ns_id, keys)
        engine.announce(ns_id, keys, "STORAGE", stored=True)
        engine.announce(ns_id, [], "STORAGE", stored=False)  # nothing to say: no event
        engine.announce(ns_id, keys[:1], "STORAGE", stored=False)
        events = engine.take_events()
        assert [e.seq for e in events] == [1, 2, 3]
        assert isinstance(events[1], BlockStored) and events[1].medium == "STORAGE"
        assert isinstance(events[2], BlockRemoved) and events[2].keys == (keys[0],)
        with pytest.raises(UnknownNamespace):
            engine.announce("ffffffffffffffff", keys, "STORAGE", stored=True)
