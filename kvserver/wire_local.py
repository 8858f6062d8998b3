"""Framing of the local channel: ZMQ-style multipart messages over a Unix-domain stream socket.

Runs in the daemon (``kvserver/daemon/local_server.py``) and in both clients
(``kvserver/client/links.py``, ``kvserver/client/aio_transport.py``). Pure constants and
functions: no sockets, no state, thread-safe. Described for humans in ``docs/wire.md`` §1
("Local channel"); the messages themselves (headers, ops, payload frames) are exactly
those of the ZMQ data plane (:mod:`kvserver.wire`), only the framing differs. Version
:data:`LOCAL_VERSION`, announced by ``hello`` as ``local_version`` next to ``local_path``.

One message, all integers big-endian::

    size   u64                  bytes that follow this field
    count  u32                  number of frames, 1 .. MAX_FRAMES (frame 0 is the header)
    length u64 x count          each frame's size
    frames                      the frames' bytes, back to back

A stream has no message boundaries of its own, so a ``size`` above the receiver's limit cannot
be skipped: the daemon answers it with an error and closes the connection. Anything wrong
inside a message of acceptable size (count, lengths) is answered with an error and the stream
goes on with the next message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from kvserver.errors import InvalidArgument
from kvserver.wire_schema import MAX_FRAMES as MAX_FRAMES  # the data plane's bound

LOCAL_VERSION = 1
SIZE = struct.Struct(">Q")
COUNT = struct.Struct(">I")


def overhead(count: int) -> int:
    """Bytes of framing after the size field of a message of ``count`` frames."""
    return COUNT.size + 8 * count


def max_size(max_message_bytes: int) -> int:
    """The largest ``size`` field a receiver limited to ``max_message_bytes`` of frames takes."""
    return max_message_bytes + overhead(MAX_FRAMES)


#: the framing of a one-frame message (most requests and replies): size, count, length.
_ONE = struct.Struct(">QIQ")


def encode(frames: Sequence[Any]) -> list[Any]:
    """``frames`` (bytes-like) as the buffers to write: the framing, then the frames."""
    if len(frames) == 1:
        (frame,) = frames
        n = memoryview(frame).nbytes
        return [_ONE.pack(overhead(1) + n, 1, n), frame]
    lengths = [memoryview(f).nbytes for f in frames]
    count = len(lengths)
    head = SIZE.pack(overhead(count) + sum(lengths)) + COUNT.pack(count)
    return [head + struct.pack(f">{count}Q", *lengths), *frames]


def decode(body: memoryview) -> list[memoryview]:
    """The frames of one message's ``body`` (everything after ``size``), as views of it.

    Raises InvalidArgument when the count or the lengths do not describe ``body`` exactly.
    """
    if body.nbytes < COUNT.size:
        raise InvalidArgument("local message too short for its frame count", size=body.nbytes)
    (count,) = COUNT.unpack_from(body)
    if not 1 <= count <= MAX_FRAMES or overhead(count) > body.nbytes:
        raise InvalidArgument("local message has a bad frame count", count=count)
    lengths = struct.unpack_from(f">{count}Q", body, COUNT.size)
    return split_frames(lengths, body[overhead(count) :])


def split_frames(lengths: Sequence[int], data: memoryview) -> list[memoryview]:
    """Views of ``data`` cut at ``lengths`` (a message's frames, back to back), for a receiver
    that read the lengths apart (before it took the frames' bytes). Raises InvalidArgument when
    they do not add up to ``data``'s size."""
    if sum(lengths) != data.nbytes:
        raise InvalidArgument(
            "local message frame lengths do not add up to its size",
            size=data.nbytes,
            frames=sum(lengths),
        )
    views: list[memoryview] = []
    pos = 0
    for length in lengths:
        views.append(data[pos : pos + length])
        pos += length
    return views
