"""Request bookkeeping and the waiting queues (FCFS deque, priority heap)."""

from __future__ import annotations

import pytest

from kvserver.errors import InvalidArgument
from scheduler.request import FCFSQueue, PriorityQueue, Request, RequestStatus, create_queue


def req(req_id: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(req_id, [1, 2, 3], max_tokens=4, priority=priority, arrival_time=arrival)


def test_token_accounting() -> None:
    r = req("a")
    r.append_output_token(9)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (4, 3, 1)
    assert r.prompt_token_ids == [1, 2, 3] and r.output_token_ids == [9]
    assert not r.is_finished and r.finish_reason is None
    r.status = RequestStatus.FINISHED_STOPPED
    assert r.is_finished and r.finish_reason == "stop"
    assert not RequestStatus.PREEMPTED.is_finished


def test_fcfs_queue() -> None:
    q = FCFSQueue()
    a, b, c = req("a"), req("b"), req("c")
    q.add(a)
    q.add(b)
    q.prepend(c)
    assert list(q) == [c, a, b] and q.peek() is c
    other = FCFSQueue()
    other.add(req("x"))
    other.add(req("y"))
    q.prepend_all(other)
    assert [r.request_id for r in q] == ["x", "y", "c", "a", "b"]
    q.remove(a)
    assert q.pop().request_id == "x" and len(q) == 3


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    q = PriorityQueue()
    for r in (req("late", 0, 2.0), req("low", 5, 0.0), req("early", 0, 1.0)):
        q.add(r)
    assert [r.request_id for r in q] == ["early", "late", "low"]
    q.prepend(
        req("urgent", -1, 9.0)
    )  # prepend cannot jump the heap order ... unless it sorts first
    assert q.pop().request_id == "urgent"
    q.remove(next(r for r in q if r.request_id == "late"))
    assert [q.pop().request_id for _ in range(len(q))] == ["early", "low"]


def test_equal_clocks_keep_creation_order() -> None:
    first, second = req("b", 0, 1.0), req("a", 0, 1.0)
    assert first < second and not second < first


def test_create_queue_names_the_choices() -> None:
    assert isinstance(create_queue("fcfs"), FCFSQueue)
    with pytest.raises(InvalidArgument, match="fcfs, priority"):
        create_queue("lifo")
