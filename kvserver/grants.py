"""The grants of the data plane: what ``prepare_store`` and ``prepare_load`` hand a client,
the store completions a client hands back, and the forms both travel in.

Made by the storage engine (``kvserver/engine.py``), carried by the data-plane wire
(``kvserver/wire.py``, ``docs/wire.md``: a grant as a reply map, :func:`grant_to_wire` /
:func:`store_grant_from_wire` / :func:`load_grant_from_wire`; completions as
``prepare_store``'s ``completions`` argument and result) and used by every client; defined
here, beside the wire, so both ends import one definition. Pure data and functions,
thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
