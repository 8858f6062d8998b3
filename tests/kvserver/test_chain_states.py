"""Tests of kvserver.policies.chain.states: the return chance ``chain`` learns per state."""

from __future__ import annotations

import pytest

from kvserver.policies.chain.states import HALF_LIFE, StateOdds


def test_a_late_turn_seen_rarely_is_ranked_by_its_turn_not_by_the_documents() -> None:
    """Chats whose fifth turns mostly return (often in turns of 8-16 chunks, twice in turns of
    4-7), and one-off documents of 2,000 chunks that never do: the rarely seen state is
    shrunk towards its neighbours in size and its turn, where chats return 9 times in 10, not
    towards the rate over all states that the documents' chunks pull down (before: p 0.15,
    its conversations evicted before ended ones), and a document's state stays near 0."""
    odds = StateOdds()
    for _ in range(20):
        odds.count((1, 11), 2000, returned=False, first=True)
    for i in range(300):
        odds.count((5, 5), 16, returned=i % 10 != 0, first=True)
    for i in range(100):
        odds.count((5, 4), 8, returned=i % 10 != 0, first=True)
    odds.count((5, 3), 4, returned=True, first=True)
    odds.count((5, 3), 4, returned=False, first=True)
    assert odds.return_chance((5, 3)) > 0.7
    assert odds.return_chance((1, 11)) < 0.05
    assert odds.turn_counted[5] == 300 * 16 + 100 * 8 + 8


def test_a_return_after_the_outcome_adds_a_return_only() -> None:
    odds = StateOdds()
    odds.count((2, 3), 5, returned=False, first=True)
    odds.count((2, 3), 5, returned=True, first=False)
    assert odds.counted[(2, 3)] == 5 and odds.returned[(2, 3)] == 5
    assert odds.outcomes[(2, 3)] == 1 and odds.turn_returned[2] == 5


def test_halving_keeps_the_turn_sums_those_of_the_states() -> None:
    """A state's counts are halved at ``HALF_LIFE`` chunks; the turn's sums follow."""
    odds = StateOdds()
    odds.count((3, 2), 3, returned=True, first=True)
    for _ in range(HALF_LIFE // 1024 + 1):
        odds.count((3, 11), 1024, returned=True, first=True)
    assert odds.counted[(3, 11)] < HALF_LIFE
    assert odds.turn_counted[3] == pytest.approx(sum(odds.counted.values()))
    assert odds.turn_returned[3] == pytest.approx(sum(odds.returned.values()))


def test_before_any_outcome_every_state_is_at_even_odds() -> None:
    odds = StateOdds()
    assert odds.return_chance((1, 1)) == odds.return_chance((9, 4)) == pytest.approx(0.5)
