"""benchmarks/store_instructions.py drives the tree's own store and load paths: each kind
still does what it counts (its assertions), without valgrind, for the daemon's default policy
and LRU (a policy that may decline stores, as an admitting one can, would refuse its batches)."""

from __future__ import annotations

import pytest

from benchmarks.store_instructions import KINDS, run_kinds


@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_every_kind_runs_one_batch_against_the_engine(policy: str) -> None:
    seconds = run_kinds(1, policy, None)
    assert sorted(seconds) == sorted(KINDS)
