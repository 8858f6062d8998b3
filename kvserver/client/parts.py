"""Parts on the client side: the payload frames of ``put``/``get``/``write_parts`` and the
arena copies of the shared-memory path.

Runs in client processes; used by the sans-I/O core (kvserver/client/common.py) and by both
clients (sync and asyncio). Stateless functions; thread safety is the caller's (one client
object, one thread). A part is the bytes of one chunk for one TP rank (docs/wire.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeAlias

from kvserver.allocator import Extents
from kvserver.arena import ArenaView
from kvserver.errors import InvalidArgument, LeaseExpired

#: per key: one buffer (TP=1) or one buffer per rank (index = rank).
Parts: TypeAlias = Sequence[Any]


def frame_buffer(frame: Any) -> memoryview:
    """A received frame's bytes: a ``zmq.Frame``'s buffer, or a view from the local channel."""
    return frame if isinstance(frame, memoryview) else frame.buffer


def check_live(lease_id: int, deadline: float) -> None:
    """Raise LeaseExpired unless ``deadline`` (a grant's: this process's monotonic clock,
    counted from the request's send, so never later than the daemon's) is still ahead.

    A co-located client calls it before it copies into a store grant's pages: once the lease
    has expired the daemon has taken the reservation back, and after a quarantine (the
    daemon's default lease, docs/architecture.md "Leases") hands its pages to another key, so
    a client that wakes up late must not write at all.
    """
    if time.monotonic() >= deadline:
        raise LeaseExpired("the grant's lease has expired: nothing copied", lease=lease_id)


def check_copied_in_time(lease_id: int, deadline: float) -> None:
    """Raise LeaseExpired unless ``deadline`` (a load grant's, as for :func:`check_live`) is
    still ahead now that a copy out of its pages has finished.

    A co-located reader calls it after it copied out of a load grant's pages: once the lease
    has expired the daemon has dropped its pins, and after a quarantine (the daemon's default
    lease, docs/architecture.md "Leases") may hand the pages to another key, so bytes copied
    by a reader that was late may be another key's. They must not be used.
    """
    if time.monotonic() >= deadline:
        raise LeaseExpired(
            "the grant's lease expired before the copy out of it finished: bytes discarded",
            lease=lease_id,
        )


def check_extents(arena: ArenaView, extents: Extents) -> int:
    """The bytes of one part's ``extents`` (a grant's, from the daemon): each ``(offset,
    length)`` integers inside the mapped arena, in total at most its size (a part's pages are
    distinct pages of it). Raises InvalidArgument otherwise, before anything is copied or
    allocated: a memoryview slice past the arena's end is silently shorter, and a negative
    offset counts from its end (another key's pages)."""
    size, total = arena.size, 0
    for offset, length in extents:
        if not _inside(size, offset, length):
            raise InvalidArgument("grant extent outside the mapped arena", offset=offset,
                                  length=length, arena_bytes=size)  # fmt: skip
        total += length
    if total > size:
        raise InvalidArgument("grant part larger than the mapped arena", size=total,
                              arena_bytes=size)  # fmt: skip
    return total


def check_grant_extents(arena: ArenaView, locations: Sequence[Sequence[Extents]]) -> None:
    """:func:`check_extents` of every part of a grant, and their total at most the arena's
    size (every part the grant names is in the arena at once, on pages of its own). Raises
    InvalidArgument."""
    size, total = arena.size, 0
    for row in locations:
        for extents in row:
            total += check_extents(arena, extents)
    if total > size:
        raise InvalidArgument("grant parts larger than the mapped arena", size=total,
                              arena_bytes=size)  # fmt: skip


def _inside(size: int, offset: Any, length: Any) -> bool:
    return (
        type(offset) is int and type(length) is int and offset >= 0 and 0 <= length <= size - offset
    )


def write_part(arena: ArenaView, extents: Extents, data: Any) -> None:
    """Copy one part into the arena: a one-extent part of bytes-like ``data`` is one slice
    assignment (one memcpy, as the memcpy reference does); anything else (several extents,
    other formats, a wrong size: ``ArenaView.write`` says what) takes the checked path.
    Extents outside the arena (:func:`check_extents`) raise InvalidArgument, nothing
    written."""
    if len(extents) == 1:
        offset, length = extents[0]
        try:  # inside the arena (a slice past it would be shorter, a negative offset wrap)
            if offset >= 0 and 0 <= length <= arena.size - offset:
                arena.buf[offset : offset + length] = data
                return
        except (TypeError, ValueError):  # not a byte buffer of exactly this length, or
            pass  # not integers: check_extents says which
    check_extents(arena, extents)
    arena.write(extents, data)


def readinto_part(arena: ArenaView, extents: Extents, out: bytearray | memoryview) -> None:
    """Copy one part out of the arena into ``out`` (exactly its size); one slice assignment
    for a one-extent part, else ``ArenaView.readinto``. Extents outside the arena
    (:func:`check_extents`) raise InvalidArgument, nothing copied."""
    if len(extents) == 1:
        offset, length = extents[0]
        try:  # inside the arena, as in write_part
            if offset >= 0 and 0 <= length <= arena.size - offset:
                dst = out if type(out) is memoryview else memoryview(out)
                dst[:] = arena.buf[offset : offset + length]  # a memoryview never resizes
                return
        except (TypeError, ValueError):  # another format or shape, the wrong size, or not
            pass  # integers: check_extents says which
    check_extents(arena, extents)
    arena.readinto(extents, out)


def flatten_parts(keys: Sequence[bytes], parts: Parts) -> list[Any]:
    """Key-major payload frames: a buffer per key, or a sequence of buffers (one per rank)."""
    if len(parts) != len(keys):
        raise InvalidArgument("need one entry of parts per key", keys=len(keys), parts=len(parts))
    flat: list[Any] = []
    counts = set()
    for entry in parts:
        try:
            memoryview(entry)
        except TypeError:
            flat.extend(entry)
            counts.add(len(entry))
        else:
            flat.append(entry)
            counts.add(1)
    if len(counts) > 1:
        raise InvalidArgument("every key needs the same number of parts (one per TP rank)")
    return flat


def split_parts(
    result: dict[str, Any],
    frames: list[memoryview],
    num_keys: int,
    part_bytes: int | None = None,
    per_key: int | None = None,
) -> list[list[memoryview]]:
    """Group a GET reply's payload ``frames`` (its ``result`` says how many frames make each
    part): key-major, len(ranks) parts per key, joined if split. ``part_bytes``: the size
    every part must have (the namespace's, when known): a split part whose frames add up to
    another size is refused (InvalidArgument) before it is joined, so a malformed or hostile
    reply (``part_frames`` naming thousands of frames as one part) is not copied into a
    second buffer of its whole size (the bytes are already in memory once, as ZMQ's frames).
    Raises InvalidArgument when ``part_frames`` does not describe the frames, or the parts
    are not ``num_keys`` x ``per_key`` (the ranks asked for, or the namespace's TP world size,
    when known; else any whole number per key): a reply short of parts would have made rows
    of fewer parts, or none, without an error."""
    counts = result.get("part_frames")
    if counts is None:
        parts = frames
    else:
        if not isinstance(counts, list) or any(type(n) is not int or n < 1 for n in counts):
            raise InvalidArgument("malformed part_frames in a reply")
        if sum(counts) != len(frames):
            raise InvalidArgument(
                "reply part_frames do not add up to its frames", frames=len(frames)
            )
        parts, pos = [], 0
        for n in counts:
            group = frames[pos : pos + n]
            if part_bytes is not None:
                size = sum(f.nbytes for f in group)
                if size != part_bytes:
                    raise InvalidArgument(
                        "reply part of the wrong size", size=size, part_bytes=part_bytes
                    )
            parts.append(memoryview(b"".join(group)))
            pos += n
    per = per_key if per_key is not None else max(1, len(parts) // num_keys if num_keys else 0)
    if len(parts) != num_keys * per:
        raise InvalidArgument("reply carries another number of parts than asked",
                              parts=len(parts), keys=num_keys, per_key=per_key)  # fmt: skip
    return [parts[i * per : (i + 1) * per] for i in range(num_keys)]
