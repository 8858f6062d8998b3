"""Receiving one ROUTER message frame by frame, keeping no more of it than a request may carry;
the same budget for a local-channel message (:func:`local_frames`).

Runs in the daemon process, on its event loop (the ROUTER's reader callback in
``zmq_server.py``, and its local-channel messages). Not thread-safe: one :class:`FrameReceiver`
per ROUTER, used from the loop only.

Received frame by frame within a budget (``kvserver/zmq_frames.py``, which says why not
``recv_multipart``): a peer admitted at the handshake could send one message of a million empty
frames, which held ~245 MB of the daemon's memory and ~4 s of its loop before it was refused.
The budget of a message:

- a request whose header names an op that carries no payload (every op but ``put`` and
  ``write_parts``, read with :func:`~kvserver.wire_requests.peek_op` once a second frame
  follows the header) keeps its header only;
- so does one whose header carries no valid token when the daemon requires one (a peer the
  handshake admitted without a token: any key of a CURVE daemon without a clients
  directory): it is refused, so its payload is not kept; an empty header (vLLM's replay
  request, ``[b"", seq]``, carries no token) keeps two frames;
- any other keeps at most :data:`~kvserver.wire_schema.MAX_FRAMES` frames whose bytes plus
  :data:`FRAME_COST` each stay within ``max_message_bytes``, so a message's frames hold at most
  about ``max_message_bytes`` of the daemon's memory however small they are.

Past the budget the message becomes an :class:`Overflow` (its header, its true frame count and
bytes), answered with one error like any other request (``zmq_requests.py``). A message is
received over several wake-ups of the loop when it has more than :data:`FRAMES_PER_CALL`
frames, so other work on the loop runs meanwhile (the reader keeps the message's state; the
ROUTER is read nowhere else).

A local-channel message is in the daemon's memory whole when it is read (its bytes bounded by
``local_inflight_bytes``), but not yet its frames: :func:`local_frames` applies the same budget
from its framing (count, first length, the header's op) before a view of any other frame is
made. A ``hello`` with 2,000,000 empty frames (16 MB) made 2M views and ``LocalFrame`` objects,
+521 MB and ~6 s of the loop, before it was refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import zmq

from kvserver import wire, wire_local
from kvserver.daemon.auth import Authenticator
from kvserver.errors import InvalidArgument, Unauthenticated
from kvserver.zmq_frames import Incoming

#: what a kept frame costs the daemon beyond its bytes (its ``zmq.Frame``, ~190 bytes, and the
#: list slot), counted against ``max_message_bytes``.
FRAME_COST = 256
#: frames one call of :meth:`FrameReceiver.receive` takes before it yields to the loop.
FRAMES_PER_CALL = 1 << 16


@dataclass(slots=True)
class Overflow:
    """A message received past its budget: its header kept, the rest counted and dropped."""

    frames: list[Any]  # the header (zmq.Frame, or a local message's view; none if it had none)
    count: int  # the message's frames after the routing id, all of them
    size: int  # their bytes
    op: str | None  # the op its header names, as far as peek_op could read it

    def error(self, max_message_bytes: int) -> InvalidArgument:
        """The error the request is answered with (after its token is checked)."""
        if not self.frames or not len(self.frames[0]):  # not a replay request: garbage
            return InvalidArgument("empty header frame", frames=self.count)
        if self.op is not None and self.op in wire.OPS and self.op not in wire.OPS_WITH_PAYLOAD:
            return InvalidArgument(f"{self.op} takes no payload frames", frames=self.count - 1)
        if self.count > wire.MAX_FRAMES:
            return InvalidArgument("message has too many frames", frames=self.count,
                                   max=wire.MAX_FRAMES)  # fmt: skip
        return InvalidArgument(
            f"message too large (each frame counts {FRAME_COST} bytes besides its own)",
            size=self.size + FRAME_COST * self.count,
            max=max_message_bytes,
        )


@dataclass(slots=True)
class _Partial:
    """A message whose frames are still being received."""

    peer: bytes
    incoming: Incoming
    op: str | None


class FrameReceiver:
    """Receives the ROUTER's messages within their budgets; see the module docstring."""

    def __init__(self, max_message_bytes: int, auth: Authenticator | None = None) -> None:
        self._max_bytes = max_message_bytes
        self._auth = auth if auth is not None and auth.required else None
        self._partial: _Partial | None = None

    def receive(self, raw: zmq.Socket[Any]) -> tuple[bytes, list[zmq.Frame] | Overflow] | None:
        """The next message, as ``(routing id, frames after it)``, or an :class:`Overflow`
        in place of the frames; None when its frames are not all taken yet (call again, from a
        later callback). Raises ``zmq.Again`` when no message is queued."""
        part = self._partial
        if part is None:
            peer = raw.recv(zmq.NOBLOCK)
            if not raw.getsockopt(zmq.RCVMORE):
                return peer, []
            header = raw.recv(zmq.NOBLOCK, copy=False)
            if not header.more:  # the common case: a request without payload
                return peer, [header]
            op = wire.peek_op(header.buffer)
            no_payload = op in wire.OPS and op not in wire.OPS_WITH_PAYLOAD
            if not len(header):  # vLLM's replay request ([b"", seq], no token) or garbage
                keep = 2
            elif no_payload or (self._auth is not None and not _admitted(self._auth, header)):
                keep = 1  # its header is all its answer needs
            else:
                keep = wire.MAX_FRAMES
            part = _Partial(peer, Incoming(header, keep, self._max_bytes, FRAME_COST), op)
        self._partial = None
        if not part.incoming.take(raw, FRAMES_PER_CALL):
            self._partial = part
            return None
        incoming = part.incoming
        if incoming.over:
            return part.peer, Overflow(incoming.frames, incoming.count, incoming.size, part.op)
        return part.peer, incoming.frames


def _admitted(auth: Authenticator, header: zmq.Frame) -> bool:
    """True if ``header``'s token is one ``auth`` admits (the request is checked again, and
    answered, by ``zmq_requests.py``)."""
    try:
        auth.check(wire.peek_auth(header.buffer)[0])
    except (InvalidArgument, Unauthenticated):
        return False
    return True


def local_frames(body: memoryview, max_message_bytes: int) -> list[memoryview] | Overflow:
    """The frames of a local message's ``body`` (``wire_local.decode``), or an
    :class:`Overflow` holding its header when they are past the budget of a ROUTER message,
    decided from the framing alone. Raises InvalidArgument as ``wire_local.decode`` does."""
    if body.nbytes >= wire_local.COUNT.size + 8:
        (count,) = wire_local.COUNT.unpack_from(body)
        start = wire_local.overhead(count)
        if 1 < count <= wire.MAX_FRAMES and start <= body.nbytes:
            (first,) = _LENGTH.unpack_from(body, wire_local.COUNT.size)
            if start + first <= body.nbytes:
                header = body[start : start + first]
                op = wire.peek_op(header)
                keep = 1 if op in wire.OPS and op not in wire.OPS_WITH_PAYLOAD else wire.MAX_FRAMES
                size = body.nbytes - start
                if count > keep or size + FRAME_COST * count > max_message_bytes:
                    return Overflow([header], count, size, op)
    return wire_local.decode(body)


#: one frame length of the local framing.
_LENGTH = struct.Struct(">Q")
