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


def test_cold_rounds_flush_the_caches_before_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cold``: the flush runs before every step of every measured round, not in the
    warm-up; the steps still see a full tier and are timed."""
    import benchmarks.round_instructions as ri

    flushes: list[int] = []
    monkeypatch.setattr(ri, "cold_flush", lambda nbytes: lambda: flushes.append(nbytes))
    seconds = run_rounds("lru", 64, 3, None, cold=True)
    assert list(seconds) == list(STEPS) and all(s > 0 for s in seconds.values())
    assert flushes == [ri.COLD_BYTES] * (3 * len(STEPS))
    flushes.clear()
    run_rounds("lru", 64, 3, None)
    assert flushes == []


def test_cold_needs_wall(capsys: pytest.CaptureFixture[str]) -> None:
    """Under callgrind a cache miss costs no instruction: ``--cold`` alone is refused."""
    import sys

    from benchmarks.round_instructions import main

    argv = sys.argv
    sys.argv = ["round_instructions", "--cold"]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = argv
    assert exc.value.code == 2
    assert "--cold needs --wall" in capsys.readouterr().err
