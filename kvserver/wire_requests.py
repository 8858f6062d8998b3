"""Decoding and validating untrusted ZMQ request headers (the daemon's side of
:mod:`kvserver.wire`, which re-exports every public name here; import them from there).

Runs in the daemon's front ends (``kvserver/daemon/zmq_server.py``, ``zmq_requests.py``), and
:func:`unpack_header` in every client too (for replies). Pure functions: no sockets, no state,
thread-safe.

Call order on the receiving side: :func:`peek_auth` when the daemon requires a token (reads
the header's top-level keys only, skipping every other value without decoding it, so that an
unauthenticated request costs next to nothing whatever it carries) → :func:`unpack_header` →
:func:`request_id_of` (so even a request that fails validation is answered with its id, or 0)
→ :func:`parse_request`, which type-checks the envelope and the op's arguments against
:data:`~kvserver.wire_schema.OPS`. Everything that comes off a socket is untrusted: each failure
raises :class:`~kvserver.errors.InvalidArgument` (or :class:`~kvserver.errors.UnsupportedVersion`)
with a message that names the field; nothing else escapes.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from kvserver.errors import InvalidArgument, UnsupportedVersion
from kvserver.prompts import is_packed
from kvserver.wire_schema import (
    MAX_ARRAY_LEN,
    MAX_CLIENT_ID_LEN,
    MAX_COMPLETIONS,
    MAX_HEADER_BYTES,
    MAX_INT,
    MAX_KEY_BYTES,
    MAX_MAP_LEN,
    MAX_STR_LEN,
    OPS,
    SUPPORTED_VERSIONS,
    Request,
)

_ENVELOPE = frozenset({"v", "id", "op", "args", "auth", "client"})

_KIND_TEXT = {
    "str": "a string",
    "int": f"an integer in 0..{MAX_INT}",
    "float": "a finite number",
    "bool": "a boolean",
    "map": "a map",
    "keys": f"a list of byte strings (bin, <= {MAX_KEY_BYTES} bytes each)",
    "ints": f"a list of integers in 0..{MAX_INT}",
    "token_ids": (
        f"a list of at most {MAX_ARRAY_LEN} integers in 0..{MAX_INT}, or packed: a bin of "
        "little-endian u32 ids (capability packed_token_ids)"
    ),
    "str_pair": "a list of two strings",
    "completions": (
        f"a list of at most {MAX_COMPLETIONS} [lease_id: int, success: bool, ranks: [int] or"
        " nil, keys: [bin] or nil]"
    ),
}


def unpack_header(
    frame: bytes | memoryview, max_array_len: int = MAX_ARRAY_LEN, max_map_len: int = MAX_MAP_LEN
) -> Any:
    """Decode one untrusted msgpack frame with strict limits (a request's lists: at most
    :data:`MAX_ARRAY_LEN` items, its maps :data:`MAX_MAP_LEN`; a reply's lists and maps:
    ``MAX_REPLY_ARRAY_LEN``). Raises InvalidArgument."""
    size = memoryview(frame).nbytes
    if size == 0:
        raise InvalidArgument("empty header frame")
    if size > MAX_HEADER_BYTES:
        raise InvalidArgument("header frame too large", size=size, max=MAX_HEADER_BYTES)
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_LEN,
            max_bin_len=size,
            max_array_len=max_array_len,
            max_map_len=max_map_len,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        if isinstance(exc, ValueError) and "max_array_len" in str(exc):
            raise InvalidArgument(
                f"a header list has more than {max_array_len} items (a longer prompt's "
                "token_ids go packed: capability packed_token_ids, docs/wire.md)"
            ) from None
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise InvalidArgument(f"malformed msgpack header ({detail})") from None


class _Chunks:
    """A file-like view of a frame for msgpack.Unpacker: it copies only what it is asked for."""

    def __init__(self, frame: bytes | memoryview) -> None:
        self._view = memoryview(frame).cast("B")
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = self._view.nbytes if n < 0 else self._pos + n
        out = bytes(self._view[self._pos : end])
        self._pos += len(out)
        return out


def peek_auth(frame: bytes | memoryview) -> tuple[str | None, int]:
    """The ``auth`` field and request id (0 if none) of an undecoded request header, read at a
    cost that does not depend on what else the header carries: the top-level fields are read
    in order up to ``auth``; only ``v``, ``id`` and ``op`` may come before it, and only with
    scalar values (clients send ``auth`` first: :func:`encode_request`); at anything else (a
    container, ``args``) it stops and the header has no ``auth``. After ``auth`` the scalar
    ``v``, ``id`` and ``op`` that follow it are read too, for the id (an error reply to a header
    that is then refused undecoded carries it). Raises InvalidArgument for a frame that does
    not start as a msgpack map of string keys."""
    auth, req_id, _ = _peek(frame, strict=True)
    return auth, req_id


def peek_op(frame: bytes | memoryview) -> str | None:
    """The ``op`` of an undecoded request header if :func:`peek_auth`'s scan reaches it (a
    string among the scalar fields before ``args``), else None; never raises. The receiver
    reads it to know, before the payload frames, whether the request may carry any."""
    try:
        return _peek(frame, strict=False)[2]
    except InvalidArgument:
        return None


def _peek(frame: bytes | memoryview, *, strict: bool) -> tuple[str | None, int, str | None]:
    """``(auth, request id, op)`` of an undecoded header (see :func:`peek_auth`); ``strict``:
    raise InvalidArgument for a malformed start even when ``auth`` was not found."""
    view = memoryview(frame).cast("B")
    size = view.nbytes
    if size == 0:
        raise InvalidArgument("empty header frame")
    if size > MAX_HEADER_BYTES:
        raise InvalidArgument("header frame too large", size=size, max=MAX_HEADER_BYTES)
    unpacker = msgpack.Unpacker(
        _Chunks(view),
        read_size=min(size, 256),
        raw=False,
        max_buffer_size=size,
        max_str_len=MAX_STR_LEN,
        max_bin_len=MAX_STR_LEN,
        max_array_len=0,
        max_map_len=MAX_MAP_LEN,
        max_ext_len=0,
    )
    req_id = 0
    auth: Any = None
    op: Any = None
    found = False
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            pos = unpacker.tell()
            if pos >= size or view[pos] in _CONTAINER_BYTES:
                break
            if key == "auth" and not found:
                auth, found = unpacker.unpack(), True
                continue
            if key not in ("v", "id", "op"):
                break
            value = unpacker.unpack()
            if key == "id" and type(value) is int and 0 < value <= MAX_INT:
                req_id = value
            elif key == "op":
                op = value
    except (
        ValueError, TypeError, OverflowError, RecursionError, msgpack.OutOfData,
        msgpack.BufferFull,  # a truncated map16/map32 header (b"\xde")
    ) as exc:  # fmt: skip
        if strict and not found:
            raise InvalidArgument(f"malformed msgpack header ({type(exc).__name__})") from None
    return (
        auth if isinstance(auth, str) else None,
        req_id,
        op if isinstance(op, str) else None,
    )


#: first bytes of msgpack maps and arrays (fixmap, fixarray, array16/32, map16/32).
_CONTAINER_BYTES = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])


def request_id_of(obj: Any) -> int:
    """The request id of a decoded header if it has a valid one, else 0 (for error replies)."""
    if isinstance(obj, dict):
        rid = obj.get("id")
        if type(rid) is int and 0 < rid <= MAX_INT:
            return rid
    return 0


def parse_request(obj: Any) -> Request:
    """Validate a decoded request header: version first, then envelope, then the op's args."""
    if not isinstance(obj, dict):
        raise InvalidArgument("header must be a msgpack map")
    version = obj.get("v")
    if type(version) is not int:
        raise InvalidArgument("header field 'v' (protocol version) must be an integer")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"protocol version {version} is not supported", supported=list(SUPPORTED_VERSIONS)
        )
    unknown = set(obj) - _ENVELOPE
    if unknown:
        raise InvalidArgument(f"unknown header fields: {', '.join(sorted(map(str, unknown)))}")
    rid = request_id_of(obj)
    if rid == 0:
        raise InvalidArgument(f"header field 'id' must be an integer in 1..{MAX_INT}")
    op = obj.get("op")
    if not isinstance(op, str):
        raise InvalidArgument("header field 'op' must be a string")
    if op not in OPS:
        raise InvalidArgument(f"unknown op {op[:64]!r}; valid: {', '.join(OPS)}")
    auth = _opt_str(obj, "auth", MAX_STR_LEN)
    client = _opt_str(obj, "client", MAX_CLIENT_ID_LEN)
    if client == "":
        raise InvalidArgument("header field 'client' must not be empty")
    args = obj.get("args")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidArgument("header field 'args' must be a map")
    return Request(rid, op, check_args(op, args), auth, client)


def check_args(op: str, args: dict[str, Any]) -> dict[str, Any]:
    """Type-check ``args`` against ``OPS[op]``; returns every field (None where absent)."""
    schema = OPS[op]
    unknown = set(args) - set(schema)
    if unknown:
        raise InvalidArgument(f"unknown arguments for {op}: {', '.join(sorted(map(str, unknown)))}")
    out: dict[str, Any] = {}
    for name, (kind, required) in schema.items():
        value = args.get(name)
        if value is None:
            if required:
                raise InvalidArgument(f"{op}: missing required argument {name!r}")
        elif not _check_value(kind, value):
            raise InvalidArgument(f"{op}: argument {name!r} must be {_KIND_TEXT[kind]}")
        out[name] = value
    return out


def _is_uint(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_INT


def _check_value(kind: str, value: Any) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return _is_uint(value)
    if kind == "float":
        return type(value) in (int, float) and math.isfinite(value)
    if kind == "bool":
        return type(value) is bool
    if kind == "map":
        return isinstance(value, dict)
    if kind == "keys":  # without a Python loop: requests carry hundreds of keys
        return isinstance(value, list) and (
            not value
            or (set(map(type, value)) == {bytes} and max(map(len, value)) <= MAX_KEY_BYTES)
        )
    if kind == "ints":  # without a Python loop either: lookup_tokens carries 1M token ids
        return isinstance(value, list) and (
            not value
            or (set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= MAX_INT)
        )
    if kind == "token_ids":
        return _check_value("ints", value) or (isinstance(value, bytes) and is_packed(value))
    if kind == "str_pair":
        return isinstance(value, list) and len(value) == 2 and all(type(v) is str for v in value)
    if kind == "completions":
        return (
            isinstance(value, list)
            and len(value) <= MAX_COMPLETIONS
            and all(_is_completion(c) for c in value)
        )
    raise AssertionError(f"unknown argument kind {kind}")


def _is_completion(c: Any) -> bool:
    return (
        isinstance(c, list)
        and len(c) == 4
        and _is_uint(c[0])
        and type(c[1]) is bool
        and (c[2] is None or _check_value("ints", c[2]))
        and (c[3] is None or _check_value("keys", c[3]))
    )


def _opt_str(obj: dict[str, Any], name: str, max_len: int) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise InvalidArgument(f"header field {name!r} must be a string of <= {max_len} chars")
    return value
