"""The grants of the data plane: what ``prepare_store`` and ``prepare_load`` hand a client.

Made by the storage engine (``kvserver/engine.py``), carried by the data-plane wire
(``kvserver/wire.py``: ``grant_to_wire`` / ``grant_from_wire``, ``docs/wire.md``) and used by
every client; defined here, beside the wire, so both ends import one definition. Pure data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserver.allocator import Extents
from kvserver.errors import KVServerError


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
