"""Receiving one reply from a DEALER frame by frame, keeping no more frames than its request
may bring back.

Runs in client processes (and in a daemon's peer links, which are clients), on the thread or
event loop that owns the socket; not thread-safe.

Received frame by frame within a budget (``kvserver/zmq_frames.py``, which says why not
``recv_multipart``): a reply's payload frames are kept up to its request's budget
(:func:`payload_frames` of its :class:`~kvserver.client.calls.Call`: a ``get`` of N keys and R
ranks at most N x R parts of at most ``part_bytes // MIN_EXTENT + 1`` frames each, a
``read_parts`` N parts, any other op none); past it the frames kept are let go and the rest
received and dropped, and the reply becomes an :class:`Oversized`: the caller fails its request
with :meth:`Oversized.error` and treats the connection as faulty (replaces it). A daemon (or a
peer a fetching daemon asks) that answered with a million empty frames made ``recv_multipart``
build a ``zmq.Frame`` of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from kvserver.errors import InvalidArgument
from kvserver.zmq_frames import Incoming

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
    """A reply received past its budget: its payload frames counted and dropped."""

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


def receive(sock: zmq.Socket[Any], header: Any, keep: int) -> list[Any] | Oversized:
    """The reply whose first frame ``header`` was received (``copy=False``): its frames, its
    payload frames kept up to ``keep`` (what its request may bring back, decided by the caller
    from the header it decoded), or an :class:`Oversized`. REQUIRES: ``header`` is a message's
    first frame (libzmq delivers a message's frames together: none is waited for)."""
    if not header.more:
        return [header]
    incoming = Incoming(header, keep + 1)  # the header besides its payload frames
    incoming.take(sock)
    if incoming.over:
        return Oversized(incoming.count - 1, incoming.size - len(header), keep)
    return incoming.frames
