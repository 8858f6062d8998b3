"""One multipart message received frame by frame within a budget (``kvserver/zmq_frames.py``),
on a real PAIR of sockets: within it every frame is kept, byte-exact; past its frames or its
bytes only the header is kept and every frame is still counted; ``limit`` takes a message over
several calls."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvserver.zmq_frames import Incoming


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    receiver.bind("inproc://frames")
    sender.connect("inproc://frames")
    yield sender, receiver
    sender.close(0)
    receiver.close(0)
    ctx.term()


def started(receiver: zmq.Socket[Any], keep: int, *budget: int) -> Incoming:
    """The next message's header received, its budget ``keep`` frames (and bytes, cost)."""
    assert receiver.poll(5000)
    header = receiver.recv(zmq.NOBLOCK, copy=False)
    assert header.more
    return Incoming(header, keep, *budget)


def test_a_message_within_its_budget_is_kept_whole(pair: Any) -> None:
    sender, receiver = pair
    message = [b"head", *(bytes([i]) * (i + 1) for i in range(9))]
    sender.send_multipart(message)
    incoming = started(receiver, 10, 4 + 45 + 10 * 3, 3)  # exactly the bytes and the cost
    assert incoming.take(receiver)
    assert not incoming.over
    assert [f.bytes for f in incoming.frames] == message
    assert (incoming.count, incoming.size, incoming.cost) == (10, 49, 79)


@pytest.mark.parametrize(("keep", "budget"), [(9, ()), (10, (78, 3))], ids=["frames", "bytes"])
def test_past_its_budget_the_header_alone_is_kept_and_every_frame_counted(
    pair: Any, keep: int, budget: tuple[int, ...]
) -> None:
    """One frame or one byte over: the frames kept are let go, the rest received and counted,
    and the next message is received from its own first frame."""
    sender, receiver = pair
    sender.send_multipart([b"head", *(bytes([i]) * (i + 1) for i in range(9))])
    sender.send_multipart([b"next", b"x"])
    incoming = started(receiver, keep, *budget)
    assert incoming.take(receiver)
    assert incoming.over
    assert [f.bytes for f in incoming.frames] == [b"head"]
    assert (incoming.count, incoming.size) == (10, 49)
    following = started(receiver, 2)
    assert following.take(receiver) and [f.bytes for f in following.frames] == [b"next", b"x"]


def test_a_limit_takes_a_message_over_several_calls(pair: Any) -> None:
    sender, receiver = pair
    sender.send_multipart([b"head"] + [b"p"] * 25)
    incoming = started(receiver, 1000)
    calls = [incoming.take(receiver, limit=10) for _ in range(3)]
    assert calls == [False, False, True]
    assert len(incoming.frames) == 26 and incoming.count == 26
