"""The ROUTER's receiver (``kvserver/daemon/zmq_receive.py``) on a real ROUTER/DEALER pair: a
message keeps no more frames than its request may carry, and one of many frames is received
over several calls; a local-channel message gets the same budget from its framing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserver import wire, wire_local
from kvserver.daemon.auth import Authenticator
from kvserver.daemon.zmq_receive import (
    FRAME_COST,
    FRAMES_PER_CALL,
    FrameReceiver,
    Overflow,
    local_frames,
)
from kvserver.errors import InvalidArgument


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://receive")
    dealer.connect("inproc://receive")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def received(receiver: FrameReceiver, router: zmq.Socket[Any]) -> list[zmq.Frame] | Overflow:
    """The next message's frames (calling again while it is only partly taken)."""
    assert router.poll(5000)
    calls = 0
    while (got := receiver.receive(router)) is None:
        calls += 1
    assert calls <= 64
    return got[1]


def test_a_request_keeps_its_frames_within_the_budget(pair: Any) -> None:
    """A one-frame request and a put whose parts fit are received whole, byte-exact."""
    router, dealer = pair
    receiver = FrameReceiver(1 << 20)
    dealer.send(wire.encode_request(1, wire.HELLO, {}))
    frames = received(receiver, router)
    assert isinstance(frames, list) and len(frames) == 1
    put = [wire.encode_request(2, wire.PUT, {}), *(bytes([i]) * 100 for i in range(50))]
    dealer.send_multipart(put)
    frames = received(receiver, router)
    assert isinstance(frames, list) and [f.bytes for f in frames] == put


def test_an_op_without_payload_keeps_its_header_only(pair: Any) -> None:
    """A hello followed by 200,000 empty frames: an Overflow holding the header, counting every
    frame, answered as before ("hello takes no payload frames (frames=200000)")."""
    router, dealer = pair
    receiver = FrameReceiver(1 << 30)
    header = wire.encode_request(3, wire.HELLO, {}, auth="t")
    dealer.send_multipart([header] + [b""] * 200_000)
    got = received(receiver, router)
    assert isinstance(got, Overflow)
    assert [f.bytes for f in got.frames] == [header]
    assert (got.count, got.size, got.op) == (200_001, len(header), wire.HELLO)
    assert str(got.error(1 << 30)) == "hello takes no payload frames (frames=200000)"


def test_frames_past_the_byte_budget_are_dropped(pair: Any) -> None:
    """A put of 1-byte frames costs FRAME_COST + 1 each against max_message_bytes: past it the
    frames kept are let go; the error names the counted size. The next message is whole."""
    router, dealer = pair
    limit = 1000 * (FRAME_COST + 1)
    receiver = FrameReceiver(limit)
    header = wire.encode_request(4, wire.PUT, {})
    dealer.send_multipart([header] + [b"x"] * 5000)
    got = received(receiver, router)
    assert isinstance(got, Overflow) and [f.bytes for f in got.frames] == [header]
    assert got.count == 5001 and got.size == len(header) + 5000
    error = str(got.error(limit))
    assert error.startswith("message too large") and f"max={limit}" in error
    dealer.send_multipart([header, b"y"])
    frames = received(receiver, router)
    assert isinstance(frames, list) and [f.bytes for f in frames] == [header, b"y"]


def test_a_request_without_a_valid_token_keeps_its_header_only(pair: Any) -> None:
    """A daemon that requires a token: a put whose header carries a wrong one (a peer the
    handshake admitted without it: any key of a CURVE daemon without a clients directory)
    is refused, so its 100 payload frames are dropped as they come; the right token's put
    keeps them."""
    router, dealer = pair
    receiver = FrameReceiver(1 << 30, Authenticator.single("the-daemons-token"))
    for token, whole in (("a-wrong-token", False), ("the-daemons-token", True), (None, False)):
        put = [wire.encode_request(6, wire.PUT, {}, auth=token), *([b"p"] * 100)]
        dealer.send_multipart(put)
        got = received(receiver, router)
        if whole:
            assert isinstance(got, list) and len(got) == 101
        else:
            assert isinstance(got, Overflow) and [f.bytes for f in got.frames] == put[:1]
            assert got.count == 101
    dealer.send_multipart([b"", bytes(8)])  # vLLM's replay request: no token, served whole
    frames = received(receiver, router)
    assert isinstance(frames, list) and [f.bytes for f in frames] == [b"", bytes(8)]
    dealer.send_multipart([b"", bytes(8), b"x", b"y"])
    got = received(receiver, router)
    assert isinstance(got, Overflow) and got.count == 4 and len(got.frames) == 1
    assert str(got.error(1 << 30)) == "empty header frame (frames=4)"


def test_a_header_the_peek_cannot_read_gets_the_general_budget(pair: Any) -> None:
    """vLLM's replay request ([b"", seq]) and a garbage header with frames are kept within
    the byte budget (the op decides nothing it cannot read)."""
    router, dealer = pair
    receiver = FrameReceiver(1 << 20)
    dealer.send_multipart([b"", bytes(8)])
    frames = received(receiver, router)
    assert isinstance(frames, list) and [f.bytes for f in frames] == [b"", bytes(8)]
    dealer.send_multipart([b"\xde\xad", b"a", b"b"])
    frames = received(receiver, router)
    assert isinstance(frames, list) and len(frames) == 3


def test_a_message_of_many_frames_takes_several_calls(pair: Any) -> None:
    """More than FRAMES_PER_CALL frames: receive() returns None (the loop runs meanwhile)
    until the last frame, then the message; the routing id is the sender's."""
    router, dealer = pair
    receiver = FrameReceiver(1 << 30)
    header = wire.encode_request(5, wire.WRITE_PARTS, {})
    dealer.send_multipart([header] + [b"p"] * (2 * FRAMES_PER_CALL + 10))
    assert router.poll(5000)
    assert receiver.receive(router) is None
    assert receiver.receive(router) is None
    got = receiver.receive(router)
    assert got is not None
    peer, frames = got
    assert isinstance(peer, bytes) and peer
    assert isinstance(frames, list) and len(frames) == 2 * FRAMES_PER_CALL + 11


def local_body(frames: list[bytes]) -> memoryview:
    """A local-channel message as the daemon holds it: everything after its size field."""
    data = b"".join(bytes(b) for b in wire_local.encode(frames))
    return memoryview(data)[wire_local.SIZE.size :]


def test_a_local_message_gets_the_same_budget_from_its_framing() -> None:
    """local_frames: a hello with extra frames and a put past the byte budget are Overflows
    holding the header (the other frames never cut into views); a put within it, and any
    one-frame message, are decoded as wire_local.decode does; bad framing is still refused."""
    hello = wire.encode_request(1, wire.HELLO, {})
    got = local_frames(local_body([hello] + [b""] * 1000), 1 << 30)
    assert isinstance(got, Overflow) and [bytes(v) for v in got.frames] == [hello]
    assert str(got.error(1 << 30)) == "hello takes no payload frames (frames=1000)"
    put = [wire.encode_request(2, wire.PUT, {}), *(b"x" for _ in range(100))]
    over = local_frames(local_body(put), 50 * FRAME_COST)
    assert isinstance(over, Overflow) and over.count == 101 and over.op == wire.PUT
    assert str(over.error(50 * FRAME_COST)).startswith("message too large")
    within = local_frames(local_body(put), 1 << 20)
    assert isinstance(within, list) and [bytes(v) for v in within] == put
    assert [bytes(v) for v in local_frames(local_body([hello]), 1)] == [hello]  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="bad frame count"):
        local_frames(memoryview(wire_local.COUNT.pack(3) + bytes(16)), 1 << 20)


@settings(max_examples=300, deadline=None)
@given(
    op=st.sampled_from([*sorted(wire.OPS), "bogus"]),
    sizes=st.lists(st.integers(0, 40), max_size=40),
    budget=st.integers(0, 60 * (FRAME_COST + 40)),
)
def test_local_frames_agrees_with_the_framing_or_overflows_exactly(
    op: str, sizes: list[int], budget: int
) -> None:
    """Any header and payload frames, any budget: local_frames returns wire_local.decode's
    frames when they fit, else an Overflow naming the true count and bytes and holding the
    header; which one follows the documented rule."""
    header = wire.encode_request(3, op, {})
    frames = [header, *(bytes([i % 251]) * n for i, n in enumerate(sizes))]
    body = local_body(frames)
    got = local_frames(body, budget)
    size = sum(map(len, frames))
    no_payload = op in wire.OPS and op not in wire.OPS_WITH_PAYLOAD
    over = len(frames) > 1 and (no_payload or size + FRAME_COST * len(frames) > budget)
    if over:
        assert isinstance(got, Overflow)
        assert (got.count, got.size, got.op) == (len(frames), size, op)
        assert [bytes(v) for v in got.frames] == [header]
    else:
        assert [bytes(v) for v in got] == frames  # type: ignore[union-attr]
