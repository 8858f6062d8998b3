"""Tests of kvserver.policies.chain.states: the return chance ``chain`` learns per state."""

from __future__ import annotations

import pytest

from kvserver.policies.chain.states import HALF_LIFE, Chain, StateOdds


def test_a_later_turns_outcomes_of_every_size_are_one_estimate() -> None:
    """Turn 3 of many chats, mostly in turns of 8-15 chunks, 9 in 10 returning; three turn-3
    stays of 4-7 chunks happened to be evicted before they returned. A later turn's state is
    the turn's, whatever it added, so a 4-chunk turn 3 is ranked by the turn's 0.9 (before:
    its own state, shrunk towards its neighbours in size and the turn, p 0.71 from three
    evictions), while a first turn keeps its size: a 2,000-chunk document never returning
    has a state of its own, near 0."""
    odds = StateOdds()
    for _ in range(20):
        document = Chain(1, (1, 0), 0, 0)
        document.enter(2000, 0)
        odds.count(document.state, document.weight, returned=False, first=True)
    chat = Chain(3, (1, 0), 0, 0)
    for i in range(200):
        chat.enter(12, i)
        odds.count(chat.state, chat.weight, returned=i % 10 != 0, first=True)
    small = Chain(3, (1, 0), 0, 0)
    for i in range(3):
        small.enter(5, i)
        odds.count(small.state, small.weight, returned=False, first=True)
    assert odds.return_chance(small.state) > 0.85
    assert small.state == chat.state == (3, 0)
    first = Chain(1, (1, 0), 0, 0)
    first.enter(4, 0)
    assert first.state == (1, 3) and document.state == (1, 11)
    assert odds.return_chance(document.state) < 0.05


def test_a_return_after_the_outcome_adds_a_return_only() -> None:
    odds = StateOdds()
    odds.count((2, 3), 5, returned=False, first=True)
    odds.count((2, 3), 5, returned=True, first=False)
    assert odds.counted[(2, 3)] == 5 and odds.returned[(2, 3)] == 5
    assert odds.outcomes[(2, 3)] == 1 and odds.all_returned == 5


def test_halving_keeps_a_states_rate() -> None:
    """A state's counts are halved at ``HALF_LIFE`` chunks, its returns with them."""
    odds = StateOdds()
    for i in range(HALF_LIFE // 1024 + 1):
        odds.count((3, 0), 1024, returned=i % 2 == 0, first=True)
    assert odds.counted[(3, 0)] < HALF_LIFE
    assert odds.returned[(3, 0)] / odds.counted[(3, 0)] == pytest.approx(0.5, abs=0.05)


def test_before_any_outcome_every_state_is_at_even_odds() -> None:
    odds = StateOdds()
    assert odds.return_chance((1, 1)) == odds.return_chance((9, 4)) == pytest.approx(0.5)
