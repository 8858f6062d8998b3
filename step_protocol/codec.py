"""The step protocol's framing and field checks, shared by both ends (scheduler and worker).

A message is a msgpack map ``{"v": STEP_PROTOCOL_VERSION, "kind": str, "body": ...}``;
:func:`encode` / :func:`encode_body` build it, :func:`decode` checks it. The ``from_wire``
helpers below raise ``InvalidArgument`` for anything malformed and never anything else.
Stateless; safe from any thread.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvserver.errors import InvalidArgument, UnsupportedVersion

STEP_PROTOCOL_VERSION = 1


def to_plain(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {name: to_plain(getattr(obj, name)) for name in obj.__dataclass_fields__}
    if isinstance(obj, list | tuple):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def encode(kind: str, message: Any) -> bytes:
    """Frame a message dataclass (or plain dict) as msgpack with its kind and version."""
    data: bytes = msgpack.packb(
        {"v": STEP_PROTOCOL_VERSION, "kind": kind, "body": to_plain(message)},
        use_bin_type=True,
    )
    return data


def decode(data: bytes) -> tuple[str, dict[str, Any]]:
    """Unframe; returns (kind, body) with the body as plain values. Raises InvalidArgument."""
    try:
        frame = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidArgument(f"undecodable step message: {exc}") from None
    if not isinstance(frame, dict) or "v" not in frame:
        raise InvalidArgument("step message is not a versioned map")
    if frame["v"] != STEP_PROTOCOL_VERSION:
        raise UnsupportedVersion(
            "step protocol version mismatch", got=frame["v"], want=STEP_PROTOCOL_VERSION
        )
    kind, body = frame.get("kind"), frame.get("body")
    if not isinstance(kind, str) or not isinstance(body, dict):
        raise InvalidArgument("step message needs a kind and a body map")
    return kind, body


def encode_body(kind: str, body: dict[str, Any]) -> bytes:
    """Like :func:`encode` for a body that is already plain (a ``to_wire()`` result): no walk
    over every token id."""
    data: bytes = msgpack.packb(
        {"v": STEP_PROTOCOL_VERSION, "kind": kind, "body": body}, use_bin_type=True
    )
    return data


def as_map(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a map")
    return value


def checked(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgument(f"{name} must be {kind.__name__}", got=type(value).__name__)
    return value


def count(value: Any, name: str, least: int = 0) -> int:
    """An int of at least ``least`` (a count, a position, a block id), else InvalidArgument:
    a negative one slipped past ``checked`` into a worker's indexing (an IndexError there
    ended the worker process)."""
    checked(value, int, name)
    if value < least:
        raise InvalidArgument(f"{name} must be at least {least}", got=value)
    return int(value)


def count_field(d: dict[str, Any], name: str, least: int = 0) -> int:
    if name not in d:
        raise InvalidArgument(f"missing field {name}")
    return count(d[name], name, least)


def count_list(value: Any, name: str) -> list[int]:
    ids = int_list(value, name)
    if ids and min(ids) < 0:
        raise InvalidArgument(f"{name} must hold integers >= 0")
    return ids


def typed_field(d: dict[str, Any], name: str, kind: type) -> Any:
    if name not in d:
        raise InvalidArgument(f"missing field {name}")
    return checked(d[name], kind, name)


def int_list(value: Any, name: str) -> list[int]:
    return [checked(x, int, name) for x in checked(value, list, name)]
