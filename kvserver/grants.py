"""The grants of the data plane: what ``prepare_store`` and ``prepare_load`` hand a client,
the store completions a client hands back, and the forms both travel in.

Made by the storage engine (``kvserver/engine/``), carried by the data-plane wire
(``kvserver/wire.py``, ``docs/wire.md``: a grant as a reply map, :func:`grant_to_wire` /
:func:`store_grant_from_wire` / :func:`load_grant_from_wire`; a store or load grant packed for
the request that asked for it, :func:`packed_store_grant_to_wire` /
:func:`packed_store_grant_from_wire` (capability ``packed_store_grant``),
:func:`packed_load_grant_to_wire` / :func:`packed_load_grant_from_wire` (capability
``packed_load_grant``); completions as
``prepare_store``'s ``completions`` argument and result) and used by every client; defined
here, beside the wire, so both ends import one definition. Pure data and functions,
thread-safe.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from kvserver.allocator import Extents
from kvserver.errors import InvalidArgument, KVServerError, error_from_code


@dataclass(frozen=True, slots=True)
class StoreGrant:
    """Result of ``prepare_store``: where to write each new chunk's parts.

    ``keys`` are the chunks reserved by this grant (request order, duplicates removed);
    ``locations[i][rank]`` are the extents of ``keys[i]``'s part for ``rank``. The grant must be
    completed with ``complete_store(lease_id, ...)`` before ``deadline`` (engine clock) or it is
    rolled back. ``lease_id`` is 0 when nothing was reserved (every key present or filtered).
    """

    lease_id: int
    deadline: float
    ns_id: str
    keys: list[bytes]
    locations: list[list[Extents]]
    #: keys already present (ready or being written by someone else).
    present: list[bytes] = field(default_factory=list)
    #: keys refused by reuse gating (seen fewer than store_threshold times).
    filtered: list[bytes] = field(default_factory=list)
    #: number of chunks evicted to make room.
    num_evicted: int = 0
    #: the daemon incarnation that made it (see :class:`LoadGrant`).
    granted_by: str = ""


@dataclass(frozen=True, slots=True)
class LoadGrant:
    """Result of ``prepare_load``: the pinned chunks and where their parts are.

    Pinned until ``complete_load(lease_id)`` or until ``deadline`` passes.

    ``granted_by`` (both grants): the incarnation of the daemon that made the grant, i.e. its
    session id (``sid``, new at every daemon start), filled in by the client from the reply
    that carried it; "" when not known. The lease id and extents mean something only to that
    incarnation and in its arena: a co-located worker copies only when the arena it mapped
    is that incarnation's (``docs/connector.md``).
    """

    lease_id: int
    deadline: float
    ns_id: str
    keys: list[bytes]
    locations: list[list[Extents]]
    granted_by: str = ""


@dataclass(frozen=True, slots=True)
class StoreCompletion:
    """One ``complete_store`` carried by a ``prepare_store`` (capability ``store_completions``):
    the same arguments, applied by the daemon before the reservation."""

    lease_id: int
    success: bool = True
    ranks: Sequence[int] | None = None
    keys: Sequence[bytes] | None = None


@dataclass(frozen=True, slots=True)
class StoreReservation:
    """Result of ``prepare_store`` with completions: the grant (None: the cache is full) and,
    per completion in order, the keys it made ready or the error it got (its own: a failed
    completion never fails the reservation, nor the other completions)."""

    grant: StoreGrant | None
    completed: list[list[bytes] | KVServerError]


# ----------------------------------------------------------------------------- on the wire


def grant_to_wire(grant: StoreGrant | LoadGrant, now: float) -> dict[str, Any]:
    """A grant as a reply map; the deadline travels as seconds left (clocks differ)."""
    out: dict[str, Any] = {
        "lease_id": grant.lease_id,
        "expires_in_s": max(0.0, grant.deadline - now),
        "ns_id": grant.ns_id,
        "keys": grant.keys,
        "locations": grant.locations,
    }
    if isinstance(grant, StoreGrant):
        out.update(present=grant.present, filtered=grant.filtered, num_evicted=grant.num_evicted)
    return out


def store_grant_from_wire(data: Any, now: float, granted_by: str = "") -> StoreGrant:
    """Rebuild a StoreGrant from a reply map; ``deadline`` is on the receiver's clock ``now``;
    ``granted_by``: the ``sid`` of the reply that carried it."""
    try:  # built at once, not through a LoadGrant: one reply per step of a scheduler
        return StoreGrant(
            int(data["lease_id"]), now + float(data["expires_in_s"]), str(data["ns_id"]),
            list(data["keys"]), _locations(data["locations"]), list(data["present"]),
            list(data["filtered"]), int(data["num_evicted"]), granted_by,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"malformed grant in reply: {exc!r}") from None


def load_grant_from_wire(data: Any, now: float, granted_by: str = "") -> LoadGrant:
    """Rebuild a LoadGrant from a reply map; ``deadline`` is on the receiver's clock ``now``;
    ``granted_by``: the ``sid`` of the reply that carried it."""
    try:
        locations = _locations(data["locations"])
        deadline = now + float(data["expires_in_s"])
        return LoadGrant(
            int(data["lease_id"]), deadline, str(data["ns_id"]), list(data["keys"]), locations,
            granted_by,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"malformed grant in reply: {exc!r}") from None


def _locations(value: Any) -> list[list[Extents]]:
    """A grant's ``locations``: per key, per rank, the part's extents as tuples."""
    return [[_extents(part) for part in loc] for loc in value]


def _extents(part: Any) -> tuple[tuple[int, int], ...]:
    """One part's extents ``[[offset, length], ...]`` as tuples (one extent: no loop)."""
    if len(part) == 1:
        ((offset, length),) = part
        return ((offset, length),)
    return tuple([(offset, length) for offset, length in part])


# ----------------------------------------------------------------------------- packed store grant

#: a packed grant's ``status``: one byte per requested key, in request order.
GRANTED, PRESENT, FILTERED, REPEATED = 0, 1, 2, 3
#: one extent on the wire: offset and length, unsigned 64-bit little-endian.
_EXTENT = struct.Struct("<QQ")
#: a part's number of extents in ``counts``: unsigned 32-bit little-endian.
_COUNT = struct.Struct("<I")
_CODES = bytes((GRANTED, PRESENT, FILTERED, REPEATED))
_PACKED_FIELDS = frozenset(
    {"lease_id", "expires_in_s", "num_evicted", "status", "parts", "counts", "extents"}
)


def packed_store_grant_to_wire(
    grant: StoreGrant, keys: Sequence[bytes], now: float
) -> dict[str, Any]:
    """``grant`` as a packed reply map for the request that asked for ``keys`` (docs/wire.md
    §2, "Packed store grant"): no key is echoed — ``status`` says, per requested key, whether
    it was granted, present, filtered or a repeat of an earlier one — and the granted keys'
    extents are one blob.

    REQUIRES: ``grant`` is the engine's answer to ``keys`` (each distinct key granted, present
    or filtered; the granted ones in request order, each location of the namespace's
    ``tp_world_size`` parts).
    """
    n = len(keys)
    if len(grant.keys) == n:  # every key granted (so no repeat): the common case
        status = bytes(n)
    else:
        code = dict.fromkeys(grant.present, PRESENT)
        code.update(dict.fromkeys(grant.filtered, FILTERED))
        out, seen = bytearray(n), set[bytes]()
        for i, key in enumerate(keys):
            if key in seen:
                out[i] = REPEATED
            else:
                seen.add(key)
                out[i] = code.get(key, GRANTED)
        status = bytes(out)
    num_parts, counts, blob = _pack_extents(grant.locations)
    return {
        "lease_id": grant.lease_id,
        "expires_in_s": max(0.0, grant.deadline - now),
        "num_evicted": grant.num_evicted,
        "status": status,
        "parts": num_parts,
        "counts": counts,
        "extents": blob,
    }


def _pack_extents(locations: list[list[Extents]]) -> tuple[int, bytes | None, bytes]:
    """A grant's ``locations`` as its packed fields: parts per key, ``counts`` (None when every
    part is one extent), the ``extents`` blob."""
    parts = list(chain.from_iterable(locations))
    flat = list(chain.from_iterable(chain.from_iterable(parts)))  # offset, length, ...
    counts = None
    if len(flat) != 2 * len(parts):  # a fragmented arena: some part has several extents
        counts = struct.pack(f"<{len(parts)}I", *map(len, parts))
    return len(locations[0]) if locations else 1, counts, struct.pack(f"<{len(flat)}Q", *flat)


def packed_store_grant_from_wire(
    data: Any, keys: Sequence[bytes], ns_id: str, now: float, granted_by: str = ""
) -> StoreGrant:
    """Rebuild the StoreGrant of a packed reply map (:func:`packed_store_grant_to_wire`) to a
    ``prepare_store`` of ``keys`` in ``ns_id``; ``deadline`` is on the receiver's clock
    ``now``; ``granted_by``: the ``sid`` of the reply that carried it. Raises InvalidArgument
    ("malformed packed grant") for anything but exactly that form: a missing or unknown
    field, a field of the wrong type, a status not one byte per key or with an unknown code,
    a blob whose size does not match the granted keys' parts."""
    if not isinstance(data, dict) or data.keys() != _PACKED_FIELDS:
        raise InvalidArgument("malformed packed grant: not the packed grant's fields")
    lease_id, expires, num_evicted = data["lease_id"], data["expires_in_s"], data["num_evicted"]
    status, num_parts, counts, blob = data["status"], data["parts"], data["counts"], data["extents"]
    if not (_is_count(lease_id) and _is_count(num_evicted) and _is_count(num_parts)):
        raise InvalidArgument("malformed packed grant: lease_id, num_evicted, parts")
    _check_expires(expires)
    if type(status) is not bytes or len(status) != len(keys) or status.translate(None, _CODES):
        raise InvalidArgument("malformed packed grant: status", keys=len(keys))
    if type(blob) is not bytes or (counts is not None and type(counts) is not bytes):
        raise InvalidArgument("malformed packed grant: extents, counts")
    present: list[bytes] = []
    filtered: list[bytes] = []
    if not status.strip(b"\0"):  # every key granted: the common case
        granted = list(keys)
        if len(set(granted)) != len(granted):
            raise InvalidArgument("malformed packed grant: a repeated key granted twice")
    else:
        granted, seen = [], set[bytes]()
        lists = (granted, present, filtered)
        for key, code in zip(keys, status, strict=True):
            if (code == REPEATED) != (key in seen):
                raise InvalidArgument("malformed packed grant: status of a repeated key")
            if code != REPEATED:
                seen.add(key)
                lists[code].append(key)
    if granted and num_parts < 1:
        raise InvalidArgument("malformed packed grant: parts", parts=num_parts)
    locations = _packed_locations(blob, counts, len(granted), num_parts)
    deadline = now + float(expires)
    return StoreGrant(
        lease_id, deadline, ns_id, granted, locations, present, filtered, num_evicted, granted_by
    )


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _check_expires(expires: Any) -> None:
    if type(expires) not in (int, float) or not math.isfinite(expires) or expires < 0:
        raise InvalidArgument("malformed packed grant: expires_in_s", value=repr(expires))


# ----------------------------------------------------------------------------- packed load grant

_PACKED_LOAD_FIELDS = frozenset({"lease_id", "expires_in_s", "parts", "counts", "extents"})


def packed_load_grant_to_wire(grant: LoadGrant, now: float) -> dict[str, Any]:
    """``grant`` as a packed reply map (docs/wire.md §2, "Packed load grant"): no key echoed
    (a load grant pins every key requested, in request order), the extents one blob as in the
    packed store grant."""
    num_parts, counts, blob = _pack_extents(grant.locations)
    return {
        "lease_id": grant.lease_id,
        "expires_in_s": max(0.0, grant.deadline - now),
        "parts": num_parts,
        "counts": counts,
        "extents": blob,
    }


def packed_load_grant_from_wire(
    data: Any, keys: Sequence[bytes], ns_id: str, now: float, granted_by: str = ""
) -> LoadGrant:
    """Rebuild the LoadGrant of a packed reply map (:func:`packed_load_grant_to_wire`) to a
    ``prepare_load`` of ``keys`` in ``ns_id``; ``deadline`` is on the receiver's clock ``now``;
    ``granted_by``: the ``sid`` of the reply that carried it. Raises InvalidArgument
    ("malformed packed grant") for anything but exactly that form: a missing or unknown field,
    a field of the wrong type, blobs whose sizes do not match ``keys``' parts."""
    if not isinstance(data, dict) or data.keys() != _PACKED_LOAD_FIELDS:
        raise InvalidArgument("malformed packed grant: not the packed load grant's fields")
    lease_id, expires, num_parts = data["lease_id"], data["expires_in_s"], data["parts"]
    counts, blob = data["counts"], data["extents"]
    if not (_is_count(lease_id) and _is_count(num_parts)) or (keys and num_parts < 1):
        raise InvalidArgument("malformed packed grant: lease_id, parts")
    _check_expires(expires)
    if type(blob) is not bytes or (counts is not None and type(counts) is not bytes):
        raise InvalidArgument("malformed packed grant: extents, counts")
    locations = _packed_locations(blob, counts, len(keys), num_parts)
    return LoadGrant(lease_id, now + float(expires), ns_id, list(keys), locations, granted_by)


def _packed_locations(
    blob: bytes, counts: bytes | None, num_keys: int, num_parts: int
) -> list[list[Extents]]:
    """A packed grant's extents as ``locations[key][part]``. Raises InvalidArgument when the
    sizes disagree."""
    num = num_keys * num_parts
    if counts is None:  # one extent per part
        if len(blob) != num * _EXTENT.size:
            raise InvalidArgument("malformed packed grant: extents", size=len(blob), parts=num)
        extents = list(_EXTENT.iter_unpack(blob))
        if num_parts == 1:
            return [[(extent,)] for extent in extents]
        return [
            [(extent,) for extent in extents[i : i + num_parts]]
            for i in range(0, num, num_parts)
        ]  # fmt: skip
    if len(counts) != num * _COUNT.size or len(blob) % _EXTENT.size:
        raise InvalidArgument("malformed packed grant: counts", size=len(counts), parts=num)
    sizes = [n for (n,) in _COUNT.iter_unpack(counts)]
    if (sizes and min(sizes) < 1) or sum(sizes) * _EXTENT.size != len(blob):
        raise InvalidArgument("malformed packed grant: counts do not match the extents")
    extents, flat, at = list(_EXTENT.iter_unpack(blob)), [], 0
    for size in sizes:
        flat.append(tuple(extents[at : at + size]))
        at += size
    return [flat[i : i + num_parts] for i in range(0, num, num_parts)]


def completions_to_wire(completions: Sequence[StoreCompletion]) -> list[list[Any]]:
    """``prepare_store``'s ``completions`` argument."""
    return [
        [c.lease_id, c.success, None if c.ranks is None else list(c.ranks),
         None if c.keys is None else list(c.keys)]
        for c in completions
    ]  # fmt: skip


def completion_results_from_wire(data: Any, count: int) -> list[list[bytes] | KVServerError]:
    """``prepare_store``'s ``completions`` result: per completion, the keys it made ready or
    its error. Raises InvalidArgument if malformed or not ``count`` long."""
    if not isinstance(data, list) or len(data) != count:
        raise InvalidArgument("malformed completions in reply", expected=count)
    out: list[list[bytes] | KVServerError] = []
    for item in data:
        if isinstance(item, dict) and isinstance(item.get("ready"), list):
            out.append(list(item["ready"]))
            continue
        err = item.get("error") if isinstance(item, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        message = err.get("message") if isinstance(err, dict) else None
        if not isinstance(code, str) or not isinstance(message, str):
            raise InvalidArgument("malformed completion result in reply")
        out.append(error_from_code(code, message))
    return out
