"""benchmarks/round_instructions.py drives the engine's four calls of the bench's co-located
round with DRAM full (every batch granted whole: its assertion), without valgrind, for the
daemon's default policy, the policy the older figures used and LRU."""

from __future__ import annotations

import pytest

from benchmarks.round_instructions import STEPS, run_rounds


@pytest.mark.parametrize("policy", ["chain", "prefix", "lru"])
def test_every_step_runs_against_a_full_tier(policy: str) -> None:
    seconds = run_rounds(policy, 256, 2, None)
    assert list(seconds) == list(STEPS)
    assert all(s > 0 for s in seconds.values())
