"""Prompts sent as token ids: their limits and their packed wire form, one home for every end.

Runs anywhere (constants and pure functions, thread-safe). Imported by the wire format
(``wire.py``: ``lookup_tokens``' ``token_ids``), the clients (``client/calls.py`` packs), the
daemon (``daemon/service.py``, ``daemon/zmq_ops.py``) and ``cluster/rpc.py`` (ScoreHosts),
which may not import the daemon (``tests/test_layers.py``): so the limits live here, not in
either.

Limits: a prompt has at most :data:`MAX_PROMPT_TOKENS` token ids and makes at most as many
chunks as one request may carry keys (:func:`check_prompt_size`, before any hashing). On ZMQ a
prompt's ids travel either as a msgpack list of ints (at most ``wire.MAX_ARRAY_LEN``, 65,536:
longer lists are refused at their array header, before any of it is decoded — decoding 1M ints
holds the daemon's GIL for tens of ms in one C call) or packed (capability
``packed_token_ids``): one bin of little-endian unsigned 32-bit ids, read as an
``array('I')`` in one copy (:func:`unpack_token_ids`), which the hasher takes as it is.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

from kvserver.errors import InvalidArgument

#: most token ids in one prompt (2M: far beyond any context window).
MAX_PROMPT_TOKENS = 1 << 21
#: bytes per id of the packed form.
PACKED_ID_BYTES = 4

assert array.array("I").itemsize == PACKED_ID_BYTES  # every platform the daemon runs on


def check_prompt_size(num_tokens: int, chunk_tokens: int, max_chunks: int) -> None:
    """Refuse a prompt of ``num_tokens`` that is too long, or makes more chunks of
    ``chunk_tokens`` tokens than ``max_chunks`` (a request's keys): InvalidArgument."""
    if num_tokens > MAX_PROMPT_TOKENS:
        raise InvalidArgument("too many tokens", count=num_tokens, max=MAX_PROMPT_TOKENS)
    if num_tokens // chunk_tokens > max_chunks:
        raise InvalidArgument(
            "prompt has more chunks than one request may carry",
            tokens=num_tokens,
            max_chunks=max_chunks,
        )


def pack_token_ids(token_ids: Sequence[int]) -> bytes | None:
    """``token_ids`` in the packed form; None when one is not in 0..2**32-1 (send a list)."""
    try:
        ids = array.array("I", token_ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def is_packed(value: bytes) -> bool:
    """Whether ``value`` is a well-formed packed form (whole ids)."""
    return len(value) % PACKED_ID_BYTES == 0


def unpack_token_ids(value: bytes | list[int]) -> Sequence[int]:
    """The ids of a ``token_ids`` argument as checked by ``wire`` (a list is returned as it
    is; a packed form as an ``array('I')``, one copy)."""
    if isinstance(value, list):
        return value
    ids = array.array("I")
    ids.frombytes(value)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids
