"""Tests of kvserver.policies.chain.admission: when ``chain`` declines a store."""

from __future__ import annotations

from kvserver.policies.chain.admission import MIN_OUTCOMES, declines, proven
from kvserver.policies.chain.states import HI, StateOdds


def test_two_documents_of_neighbouring_sizes_are_evidence_for_the_size_between() -> None:
    """One document of 300 chunks and one of 1,500 left unread (states (1, 9) and (1, 11)):
    a first document of 800 chunks (state (1, 10), no outcome of its own) is declined, since
    its return chance is pooled with theirs (before: it needed two outcomes of its own, so
    every new size of document was stored first and flushed the conversations)."""
    odds = StateOdds()
    odds.count((1, 9), 300, returned=False, first=True)
    odds.count((1, 11), 1500, returned=False, first=True)
    offset = odds.log_odds
    assert proven((1, 10), odds, offset) == offset((1, 10)) < -1.0
    assert proven((1, 5), odds, offset) == HI  # a chat's first turn: nothing seen near it
    document = [f"d{j}" for j in range(800)]
    assert declines(document, 0.0, 1, {}, {}, {}, odds, offset)
    assert not declines(document, offset((1, 10)), 1, {}, {}, {}, odds, offset)


def test_one_outcome_is_no_evidence() -> None:
    """A document left unread once is not enough to decline the next of its size."""
    odds = StateOdds()
    odds.count((1, 10), 800, returned=False, first=True)
    assert MIN_OUTCOMES > 1 and proven((1, 10), odds, odds.log_odds) == HI
    assert not declines([f"d{j}" for j in range(800)], 0.0, 1, {}, {}, {}, odds, odds.log_odds)
