"""Tests of kvserver.reuse: the store_threshold gate and its LRU-bounded sighting counter."""

from __future__ import annotations

import pytest

from kvserver.errors import InvalidArgument
from kvserver.reuse import ReuseTracker


@pytest.mark.parametrize("threshold", [0, 1])
def test_threshold_zero_or_one_disables_gating(threshold: int) -> None:
    tracker = ReuseTracker(threshold)
    assert not tracker.enabled
    assert tracker.admits("never-seen")
    tracker.record(["a", "b"])
    assert len(tracker) == 0 and tracker.count("a") == 0


@pytest.mark.parametrize("threshold", [2, 3, 5])
def test_admits_after_threshold_sightings(threshold: int) -> None:
    tracker = ReuseTracker(threshold)
    assert tracker.enabled
    for seen in range(threshold):
        assert tracker.count("k") == seen
        assert not tracker.admits("k")
        tracker.record(["k"])
    assert tracker.admits("k")
    tracker.record(["k"])
    assert tracker.admits("k") and tracker.count("k") == threshold + 1
    assert not tracker.admits("other")


def test_each_key_counted_independently() -> None:
    tracker = ReuseTracker(2)
    tracker.record(["a", "b"])
    tracker.record(["a"])
    assert tracker.admits("a") and not tracker.admits("b")


def test_tracker_is_lru_bounded() -> None:
    tracker = ReuseTracker(2, max_tracker_size=3)
    tracker.record(["a", "b", "c"])
    tracker.record(["a"])  # a becomes most recent (count 2)
    tracker.record(["d"])  # evicts b, the least recently seen
    assert len(tracker) == 3
    assert tracker.count("b") == 0
    assert tracker.count("a") == 2 and tracker.admits("a")
    tracker.record(["e", "f", "g"])  # one call over the bound trims to the newest 3
    assert len(tracker) == 3
    assert [tracker.count(k) for k in "efg"] == [1, 1, 1]
    assert tracker.count("a") == 0 and not tracker.admits("a")


@pytest.mark.parametrize(("threshold", "size"), [(-1, 10), (2, 0), (2, -5)])
def test_invalid_parameters(threshold: int, size: int) -> None:
    with pytest.raises(InvalidArgument):
        ReuseTracker(threshold, size)
