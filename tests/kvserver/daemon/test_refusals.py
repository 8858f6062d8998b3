"""The throttle of error replies to unauthenticated ZMQ requests (``kvserver/daemon/refusals.py``),
on a fake clock: the decision of each reply (now, held for how long, dropped) and its counters."""

from __future__ import annotations

import pytest

from kvserver.daemon.refusals import RefusalThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def throttle(clock: Clock, **kw: int) -> RefusalThrottle:
    kw.setdefault("burst", 3)
    return RefusalThrottle(1.0, clock=clock, **kw)


def test_the_burst_is_answered_at_once_then_one_per_interval(clock: Clock) -> None:
    t = throttle(clock)
    assert [t.refuse(b"a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [t.refuse(b"a") for _ in range(3)] == [1.0, 2.0, 3.0]
    assert t.stats() == {"refused": 6, "held_back": 3, "dropped": 0, "held": 3, "connections": 1}


def test_connections_are_throttled_apart(clock: Clock) -> None:
    t = throttle(clock, burst=1)
    assert t.refuse(b"a") == 0.0
    assert t.refuse(b"a") == 1.0
    assert t.refuse(b"b") == 0.0  # another connection: its own allowance


def test_the_allowance_comes_back_with_time(clock: Clock) -> None:
    t = throttle(clock)
    for _ in range(3):
        t.refuse(b"a")
    assert t.refuse(b"a") == 1.0
    t.sent(b"a")
    clock.now += 10.0  # quiet for a while: a full burst again
    assert [t.refuse(b"a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert t.refuse(b"a") == 1.0


def test_past_the_bounds_replies_are_dropped(clock: Clock) -> None:
    t = throttle(clock, burst=1, max_held_per_connection=2, max_held=3)
    assert [t.refuse(b"a") for _ in range(4)] == [0.0, 1.0, 2.0, None]  # 2 held per connection
    assert [t.refuse(b"b") for _ in range(3)] == [0.0, 1.0, None]  # 3 held in all
    assert t.stats()["dropped"] == 2 and t.stats()["held"] == 3
    t.sent(b"a")  # one of a's held replies left: room for one more of b's
    assert t.refuse(b"b") == 2.0
    assert t.stats()["held"] == 3


def test_a_valid_token_lifts_the_penalty(clock: Clock) -> None:
    t = throttle(clock, burst=1)
    assert t.refuse(b"a") == 0.0
    t.forgive(b"a")
    assert t.refuse(b"a") == 0.0  # the penalty was lifted: answered at once again
    assert t.refuse(b"a") == 1.0
    t.forgive(b"a")  # a reply is still held: the record stays until it leaves
    assert t.refuse(b"a") == 2.0
    t.sent(b"a")
    t.sent(b"a")
    t.forgive(b"a")
    assert t.refuse(b"a") == 0.0 and t.stats()["held"] == 0


def test_the_connections_remembered_are_bounded(clock: Clock) -> None:
    t = throttle(clock, burst=1, max_connections=2)
    assert t.refuse(b"a") == 0.0 and t.refuse(b"a") == 1.0
    t.refuse(b"b")
    t.refuse(b"c")  # a, the oldest, is forgotten, and its held reply no longer counts
    assert t.stats()["connections"] == 2 and t.stats()["held"] == 0
    t.sent(b"a")  # its reply left after all: nothing to count down
    assert t.stats()["held"] == 0
    assert t.refuse(b"a") == 0.0  # a new record


def test_refused_bytes_are_limited_across_connections(clock: Clock) -> None:
    t = throttle(clock, burst=100, bytes_burst=100, bytes_per_s=10)
    assert t.refuse(b"a", 60) == 0.0 and t.refuse(b"b", 40) == 0.0  # the daemon-wide burst
    assert t.refuse(b"c", 20) == pytest.approx(2.0)  # a new connection gains nothing
    assert t.refuse(b"d", 0) == pytest.approx(2.0)  # a small request waits behind the flood
    clock.now += 100.0  # quiet: the whole byte allowance is back
    assert t.refuse(b"e", 100) == 0.0


def test_a_request_over_the_byte_burst_is_answered_when_the_budget_is_whole(clock: Clock) -> None:
    t = throttle(clock, burst=100, bytes_burst=100, bytes_per_s=10)
    assert t.refuse(b"a", 10_000) == 0.0  # counts as the whole burst, not more
    assert t.refuse(b"b", 1) == pytest.approx(0.1)
