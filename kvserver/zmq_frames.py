"""Receiving one multipart ZMQ message frame by frame within a budget: at most N frames kept,
whose bytes (plus a cost per frame) stay within B; past it the rest are received, counted and
dropped.

Runs wherever a ZMQ socket is read for messages whose sender is not trusted with memory: the
daemon's ROUTER (``daemon/zmq_receive.py``, on its event loop: a request keeps what it may
carry) and a client's DEALER (``client/replies.py``, on the thread or loop that owns the socket:
a reply keeps what its request may bring back). Not thread-safe: an :class:`Incoming` is one
message, used by the socket's owner only.

Why not ``recv_multipart``: ZMQ bounds a frame's bytes (``MAXMSGSIZE``), not a message's frame
count, and hands a multipart message over only once all of it has arrived. A message of a
million empty frames (2 bytes each on the wire) made ``recv_multipart`` build a ``zmq.Frame`` of
each (~190 bytes, plus the list's slot), three times what libzmq itself holds of them (~64 bytes
a frame): ~245 MB of a daemon's memory. Here each frame is received on its own (``copy=False``)
and kept only while the message stays within its budget; past it the frames kept but the first
(the header, which the answer needs) are let go, and the rest are received and dropped one at a
time, counted, so that the error can say how far past the budget the message went.

Call order: receive the first frame (the header) yourself and decide the budget from it (the
request's op, the reply's request) → ``Incoming(header, keep, ...)`` → :meth:`Incoming.take`
until it returns True (with ``limit``: a few frames per turn of an event loop) → ``frames``,
or ``over``.

What is *not* bounded here: libzmq holds a multipart message whole (every frame's bytes) before
its first frame can be read, so the bytes of an oversized message are in memory once while it
arrives whatever the receiver does; only the handshake that admitted the other end bounds that
(``docs/security.md``).
"""

from __future__ import annotations

import sys
from typing import Any

import zmq


class Incoming:
    """One message being received within its budget.

    Invariants: ``frames[0]`` is the header; ``count`` and ``size`` are every frame received so
    far, the header included; not ``over``: ``frames`` holds all of them, ``count <= keep``
    and (with ``max_bytes``) ``size + frame_cost * count <= max_bytes`` once a frame followed
    the header; ``over``: ``frames`` is the header alone, and stays so.
    """

    __slots__ = ("count", "frame_cost", "frames", "keep", "max_bytes", "over", "size")

    def __init__(
        self, header: Any, keep: int, max_bytes: int | None = None, frame_cost: int = 0
    ) -> None:
        """``header``: the message's first frame (a ``zmq.Frame``, received with ``more``);
        ``keep``: the frames it may keep, the header included; ``max_bytes``: what they may
        cost, each its bytes plus ``frame_cost`` (None: frames alone decide)."""
        self.frames: list[Any] = [header]
        self.keep = keep
        self.max_bytes = max_bytes
        self.frame_cost = frame_cost
        self.count = 1
        self.size = len(header)
        self.over = False

    @property
    def cost(self) -> int:
        """What the frames received so far cost: their bytes plus ``frame_cost`` each."""
        return self.size + self.frame_cost * self.count

    def take(self, sock: zmq.Socket[Any], limit: int | None = None) -> bool:
        """Receive the message's next frames from ``sock`` (``NOBLOCK``, ``copy=False``),
        keeping them while within the budget; True once its last frame is in, False after
        ``limit`` frames with more to come (call again). REQUIRES: the last frame received
        had ``more`` (libzmq delivers a message's frames together, so none is waited for);
        raises ``zmq.Again`` otherwise."""
        frames, keep, count, size, over = self.frames, self.keep, self.count, self.size, self.over
        cost, cap = self.frame_cost, self.max_bytes
        more = True
        for _ in range(limit if limit is not None else sys.maxsize):
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            more = frame.more
            count += 1
            size += len(frame)
            if not over:
                if count <= keep and (cap is None or size + cost * count <= cap):
                    frames.append(frame)
                else:  # past the budget: let go of what was kept; count the rest only
                    over = True
                    del frames[1:]
            del frame
            if not more:
                break
        self.count, self.size, self.over = count, size, over
        return not more
