"""The local channel's framing (``kvserver/wire_local.py``): round trips and every refusal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserver import wire_local
from kvserver.errors import InvalidArgument


def body_of(frames: list[bytes]) -> memoryview:
    """The bytes after the size field, checking the size field on the way."""
    data = b"".join(bytes(b) for b in wire_local.encode(frames))
    (size,) = wire_local.SIZE.unpack_from(data)
    assert size == len(data) - wire_local.SIZE.size
    return memoryview(data)[wire_local.SIZE.size :]


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=8))
def test_frames_round_trip(frames: list[bytes]) -> None:
    assert [bytes(v) for v in wire_local.decode(body_of(frames))] == frames


def test_encode_keeps_the_frames_themselves() -> None:
    """The frames follow the framing as they are (no copy into one buffer)."""
    payload = memoryview(bytearray(b"x" * 10))
    out = wire_local.encode([b"header", payload])
    assert out[1] == b"header" and out[2] is payload


@pytest.mark.parametrize(
    "body, match",
    [
        (b"", "too short"),
        (b"\x00\x00", "too short"),
        (wire_local.COUNT.pack(0), "bad frame count"),
        (wire_local.COUNT.pack(wire_local.MAX_FRAMES + 1), "bad frame count"),
        (wire_local.COUNT.pack(3) + bytes(16), "bad frame count"),  # lengths cut short
        (wire_local.COUNT.pack(1) + wire_local.SIZE.pack(4) + b"abc", "do not add up"),
        (wire_local.COUNT.pack(1) + wire_local.SIZE.pack(2) + b"abc", "do not add up"),
        (wire_local.COUNT.pack(1) + wire_local.SIZE.pack(1 << 62) + b"a", "do not add up"),
    ],
)
def test_malformed_bodies_are_refused(body: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        wire_local.decode(memoryview(body))


def test_max_size_covers_the_largest_message_and_its_framing() -> None:
    limit = 1 << 20
    assert wire_local.max_size(limit) == limit + wire_local.overhead(wire_local.MAX_FRAMES)
    assert wire_local.overhead(2) == wire_local.COUNT.size + 16
