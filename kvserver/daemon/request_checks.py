"""The checks of a data request's shape that every front end shares: its payload parts and
its keys and ranks, refused before anything is held or written.

Pure functions of the request's typed values (no state, no I/O), called on the daemon's event
loop by :class:`~kvserver.daemon.service.KVService` (``put``, ``get``) and by the ZMQ ops
(``zmq_ops.py``: ``prepare_load``, ``read_parts``, store completions' frames). Each raises
:class:`~kvserver.errors.InvalidArgument`; nothing has changed when it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserver.errors import InvalidArgument


def check_parts(parts: Sequence[Any], expected: int, part_bytes: int | None) -> None:
    """Refuse a payload with the wrong number of parts or (when given) of the wrong size."""
    if len(parts) != expected:
        raise InvalidArgument(
            "wrong number of payload frames", frames=len(parts), expected=expected
        )
    if part_bytes is not None:
        for i, part in enumerate(parts):
            size = part.nbytes if isinstance(part, memoryview) else len(part)
            if size != part_bytes:
                raise InvalidArgument(
                    "payload size does not match the slot",
                    frame=i,
                    size=size,
                    part_bytes=part_bytes,
                )


def check_unique(op: str, keys: Sequence[bytes], ranks: Sequence[int] = ()) -> None:
    """Refuse a request that names a key or a rank twice where its reply has an entry per
    key and rank named (``get``, ``read_parts``: the part, copied on the local channel and
    for small parts; ``prepare_load``: the part's extents): a short request could make the
    daemon build a reply far larger than its tiers (1,024 copies of one key of a 4,096-rank
    namespace made a 33 MB grant, its event loop busy for a second)."""
    if len(set(keys)) != len(keys):
        raise InvalidArgument(f"{op}: duplicate keys")
    if len(set(ranks)) != len(ranks):
        raise InvalidArgument(f"{op}: duplicate ranks")
