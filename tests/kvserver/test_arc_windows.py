"""Why ``kvserver bench --policy arc`` cannot run its remote rounds: on a full tier whose every
earlier batch was stored and loaded, a put sent as two store requests (the client's windows)
loses its first window to its second under ARC, by design (the first window's chunks are new,
ARC's T1, and T1 is evicted before T2's loaded chunks while no ghost hit has raised T1's
target). The engine evicts what the policy chooses: the same requests under every other policy
keep both windows, and ARC keeps them when the put is one request."""

from __future__ import annotations

import pytest

from kvserver.errors import UnknownKey
from kvserver.policies import POLICIES
from tests.kvserver.builders import make_engine, make_keys, make_spec, store

BATCH = 4  # chunks per put; the tier holds three puts


def run_rounds(policy: str, windows: int) -> None:
    """Five rounds of the bench's remote round (a put of ``BATCH`` new chunks in ``windows``
    store requests, then a load of them all) on a tier of ``3 * BATCH`` chunks."""
    with make_engine(policy, num_pages=3 * BATCH) as engine:
        ns = engine.register_namespace(make_spec())
        step = BATCH // windows
        for r in range(5):
            keys = make_keys(BATCH, start=r * BATCH)
            for w in range(0, BATCH, step):
                store(engine, ns, keys[w : w + step])
            engine.complete_load(engine.prepare_load(ns, keys).lease_id)


def test_arc_evicts_a_puts_first_window_for_its_second_once_the_tier_is_full() -> None:
    run_rounds("arc", windows=1)
    with pytest.raises(UnknownKey, match="chunk not present"):
        run_rounds("arc", windows=2)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"arc"}))
def test_every_other_policy_keeps_both_windows(policy: str) -> None:
    run_rounds(policy, windows=2)
