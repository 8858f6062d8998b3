"""benchmarks/fetch_instructions.py drives the tree's own peer fetch, both daemons' sides: each
phase still runs (the fetch granted every key, A's answer handed every view to its socket,
the phases ended in the order the callgrind dumps are read in), without valgrind, for the
daemon's default policy and LRU, 256 KiB and 1 MiB parts; and it leaves the caller's garbage
collector as it was."""

from __future__ import annotations

import gc
import time

import pytest

from benchmarks.fetch_instructions import PHASES, run


@pytest.mark.parametrize("part_bytes", [256 << 10, 1 << 20])
@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_every_phase_runs_for_one_fetch(policy: str, part_bytes: int) -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    seconds = run(1, policy, time.perf_counter, part_bytes)
    assert sorted(seconds) == sorted(PHASES)
    assert all(s > 0 for s in seconds.values())
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
