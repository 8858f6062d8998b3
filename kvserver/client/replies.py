"""Receiving one reply from a DEALER frame by frame, keeping no more frames than its request
may bring back.

Runs in client processes (and in a daemon's peer links, which are clients), on the thread or
event loop that owns the socket; not thread-safe.

Why not ``recv_multipart``: ZMQ bounds a frame's bytes (``MAXMSGSIZE``), not a message's frame
count. A daemon (or a peer a fetching daemon asks) that answers with a million empty frames
made ``recv_multipart`` build a ``zmq.Frame`` of each (~190 bytes, plus the list's slot),
three times what libzmq itself holds of them (~64 bytes a frame). Here a reply's payload
frames are received one at a time and kept up to its request's budget (:func:`payload_frames`
of its :class:`~kvserver.client.calls.Call`: a ``get`` of N keys and R ranks at most N x R
parts of at most ``part_bytes // MIN_EXTENT + 1`` frames each, a ``read_parts`` N parts, any
other op none); past it the frames kept are let go and the rest received and dropped, and the
reply becomes an :class:`Oversized`: the caller fails its request with
:meth:`Oversized.error` and treats the connection as faulty (replaces it).

What is *not* bounded here: libzmq holds a multipart message whole (every frame's bytes)
before its first frame can be read, so the bytes of an oversized reply are in memory once
while it arrives whatever the receiver does; only the handshake that admitted the server
bounds that (``docs/security.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvserver.errors import InvalidArgument

#: the smallest arena extent a split part's frame can be (the smallest page size).
MIN_EXTENT = 4096


def frames_per_part(part_bytes: int | None) -> int:
    """The most frames one part of ``part_bytes`` can take (a fragmented arena sends one per
    extent, each at least one page); unknown size: one part may take any number up to the
    reply's own limit on ``part_frames``."""
    if part_bytes is None:
        return 1 << 21
    return part_bytes // MIN_EXTENT + 1


@dataclass(slots=True)
class Oversized:
    """A reply received past its budget: its header kept, the rest counted and dropped."""

    header: Any  # zmq.Frame
    count: int  # payload frames, all of them
    size: int  # their bytes
    budget: int  # payload frames its request may bring back

    def error(self) -> InvalidArgument:
        """The error its request fails with (the connection is faulty: replace it)."""
        return InvalidArgument(
            "reply has more frames than its request may bring back",
            frames=self.count,
            max=self.budget,
            size=self.size,
        )


def receive(sock: zmq.Socket[Any], budget: Callable[[Any], int]) -> list[Any] | Oversized:
    """One reply from ``sock`` (frames, ``copy=False``), or an :class:`Oversized`.
    ``budget(header)``: the payload frames the reply whose header frame is ``header`` may
    carry (asked only when it has any). REQUIRES: a message is queued (libzmq delivers a
    message's frames together); raises ``zmq.Again`` otherwise."""
    header = sock.recv(zmq.NOBLOCK, copy=False)
    if not header.more:
        return [header]
    return _rest(sock, header, budget(header))


def receive_after(
    sock: zmq.Socket[Any], header: Any, budget: Callable[[Any], int]
) -> list[Any] | Oversized:
    """As :func:`receive`, ``header`` (the reply's first frame) already received."""
    if not header.more:
        return [header]
    return _rest(sock, header, budget(header))


def _rest(sock: zmq.Socket[Any], header: Any, keep: int) -> list[Any] | Oversized:
    frames = [header]
    count = size = 0
    while True:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        more = frame.more
        count += 1
        size += len(frame)
        if count <= keep:
            frames.append(frame)
        elif len(frames) > 1:
            del frames[1:]  # past the budget: let go of what was kept
        del frame
        if not more:
            break
    return frames if count <= keep else Oversized(header, count, size, keep)
