"""Leases: every reservation and every pin carries a deadline.

A client that crashes between ``prepare_*`` and ``complete_*`` must not hold memory forever. The
engine records each grant as a :class:`Lease`; :meth:`LeaseTable.pop_expired` yields those whose
deadline has passed so the engine can roll back reservations and release pins. Expired ids are
remembered (bounded) so a late ``complete_*`` gets ``LeaseExpired`` rather than a generic
"unknown lease".

A store lease tracks which parts of its keys are written; its own methods change that, in this
order: :meth:`Lease.select_ranks` / :meth:`Lease.select_keys` (validate a completion's
selection), :meth:`Lease.check_part` (before a part is written), :meth:`Lease.record_parts`
(atomic: raises with nothing recorded), :meth:`Lease.finish` (keys completed or rolled back
leave the lease). The checks raise before anything changes.

Lease ids are unique across daemon incarnations, not only within one: a table numbers its
leases up from a random first id (below 2**52, so ids stay exact in any JSON reader and far
from the wire's 2**63 bound). A client of a daemon that was killed and restarted on the same
port may still send ``complete_store`` / ``complete_load`` for a lease of the killed one (its
DEALER reconnects by itself, and the request runs before a reply tells it the daemon changed);
were ids counted from 1 in every incarnation, such a late completion would end the new
daemon's lease of the same number: make another client's unwritten reservation READY, or
release another client's load pins while it still reads the pages. With random first ids it
gets "unknown lease".

Single owner (the storage engine); no locks. Time comes from the engine's injected clock.
"""

from __future__ import annotations

import enum
import heapq
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvserver.errors import InvalidArgument, InvalidState, LeaseError, LeaseExpired

#: how many expired/cancelled lease ids are remembered for error messages.
EXPIRED_MEMORY = 65536
#: a table's first lease id is drawn from [1, FIRST_ID_SPAN] (module docstring).
FIRST_ID_SPAN = 1 << 52


class LeaseKind(enum.Enum):
    STORE = "store"
    LOAD = "load"


@dataclass(slots=True, eq=False)
class Lease:
    """A grant held by a client: a store reservation or a set of load pins."""

    lease_id: int
    kind: LeaseKind
    client: str
    ns: int
    #: store: keys reserved and still being written; load: keys pinned (one pin per element).
    keys: list[bytes]
    deadline: float
    #: store leases: TP ranks whose part has been written, per key.
    done_ranks: dict[bytes, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ store-lease parts

    def select_ranks(self, ranks: Iterable[int] | None, world: int) -> int:
        """Bit mask of the TP ranks ``ranks`` names (``None``: every rank of ``world``)."""
        if ranks is None:
            return (1 << world) - 1
        mask = 0
        ranks = list(ranks)
        if not ranks:
            raise InvalidArgument("ranks must name at least one rank", lease=self.lease_id)
        for r in ranks:
            if type(r) is not int or not 0 <= r < world:
                raise InvalidArgument("rank out of range", rank=r, tp_world_size=world)
            mask |= 1 << r
        return mask

    def select_keys(self, keys: Iterable[bytes] | None) -> list[bytes]:
        """The keys ``keys`` names, duplicates removed (``None``: every key still held)."""
        if keys is None:
            return list(self.keys)
        selected = list(dict.fromkeys(keys))
        in_lease = set(self.keys)
        for key in selected:
            if key not in in_lease:
                raise InvalidArgument(
                    "key is not reserved by this lease", key=key, lease=self.lease_id
                )
        return selected

    def check_part(self, key: bytes, rank: int, world: int) -> None:
        """Raise unless ``rank``'s part of ``key`` is reserved here and not written yet."""
        if type(rank) is not int or not 0 <= rank < world:
            raise InvalidArgument("rank out of range", rank=rank)
        if key not in self.keys:
            raise InvalidArgument("key is not reserved by this lease", key=key, lease=self.lease_id)
        if self.done_ranks.get(key, 0) >> rank & 1:
            raise InvalidState("part already completed", key=key, rank=rank)

    def check_parts(self, keys: Sequence[bytes], mask: int) -> None:
        """Raise unless the parts ``mask`` of each of ``keys`` are reserved here and not
        completed yet (:meth:`check_part` for a batch)."""
        held = set(self.keys)
        if not held.issuperset(keys):
            key = next(k for k in keys if k not in held)
            raise InvalidArgument("key is not reserved by this lease", key=key, lease=self.lease_id)
        done = self.done_ranks
        if done:
            for key in keys:
                if done.get(key, 0) & mask:
                    raise InvalidState("part already completed", key=key, lease=self.lease_id)

    def record_parts(self, keys: list[bytes], mask: int, world: int) -> list[bytes]:
        """Record the parts ``mask`` of ``keys`` as written; returns the keys now complete.

        Atomic: raises InvalidState, with nothing recorded, if any of those parts was recorded
        before. A complete key's progress is forgotten (it is the caller's to make READY, then
        :meth:`finish`).
        """
        done = self.done_ranks
        for key in keys:
            if done.get(key, 0) & mask:
                raise InvalidState("part completed twice", key=key, lease=self.lease_id)
        all_mask = (1 << world) - 1
        complete: list[bytes] = []
        for key in keys:
            got = done.get(key, 0) | mask
            if got == all_mask:
                done.pop(key, None)
                complete.append(key)
            else:
                done[key] = got
        return complete

    def finish(self, keys: Iterable[bytes]) -> None:
        """Drop ``keys`` (completed or rolled back) and their progress from a store lease."""
        finished = set(keys)
        for key in finished:
            self.done_ranks.pop(key, None)
        self.keys = [k for k in self.keys if k not in finished]

    def settle(self, keys: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Drop every key: returns (the keys of ``keys``, duplicates removed, in their order;
        the others still held, in lease order). Raises InvalidArgument, with nothing changed,
        if a key of ``keys`` is not held."""
        done = list(dict.fromkeys(keys))
        held = set(self.keys)
        if not held.issuperset(done):
            key = next(k for k in done if k not in held)
            raise InvalidArgument("key is not reserved by this lease", key=key, lease=self.lease_id)
        if len(done) == len(held):
            rest: list[bytes] = []
        else:
            finished = set(done)
            rest = [k for k in self.keys if k not in finished]
        self.keys = []
        self.done_ranks.clear()
        return done, rest

    def finish_all(self) -> list[bytes]:
        """Drop every key (all of them complete at once); returns them."""
        keys, self.keys = self.keys, []
        self.done_ranks.clear()
        return keys


class LeaseTable:
    """Live leases by id, plus a deadline heap (lazy deletion). Ids increase by one from
    ``first_id`` (default: random, see the module docstring); never 0."""

    def __init__(self, first_id: int | None = None) -> None:
        self._leases: dict[int, Lease] = {}
        self._heap: list[tuple[float, int]] = []
        self._next_id = secrets.randbelow(FIRST_ID_SPAN) + 1 if first_id is None else first_id
        if self._next_id < 1:
            raise InvalidArgument("lease ids start at 1 or above", first_id=first_id)
        self._gone: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._leases.values()))

    def new(
        self, kind: LeaseKind, client: str, ns: int, keys: list[bytes], deadline: float
    ) -> Lease:
        lease = Lease(self._next_id, kind, client, ns, keys, deadline)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._heap, (deadline, lease.lease_id))
        return lease

    def find(self, lease_id: int) -> Lease | None:
        """The live lease ``lease_id`` of any kind, or None."""
        return self._leases.get(lease_id)

    def get(self, lease_id: int, kind: LeaseKind) -> Lease:
        """The live lease ``lease_id`` of ``kind``; raises LeaseExpired / LeaseError otherwise."""
        lease = self._leases.get(lease_id)
        if lease is None:
            why = self._gone.get(lease_id)
            if why == "expired":
                raise LeaseExpired("lease expired and was reclaimed", lease=lease_id)
            if why is not None:
                raise LeaseError(f"lease already {why}", lease=lease_id)
            raise LeaseError("unknown lease", lease=lease_id)
        if lease.kind is not kind:
            raise LeaseError(
                f"lease is a {lease.kind.value} lease, not {kind.value}", lease=lease_id
            )
        return lease

    def end(self, lease: Lease, why: str) -> None:
        """Forget a lease (completed, released, expired). Its heap item is dropped lazily."""
        del self._leases[lease.lease_id]
        self._gone[lease.lease_id] = why
        if len(self._gone) > EXPIRED_MEMORY:
            self._gone.popitem(last=False)

    def pop_expired(self, now: float) -> list[Lease]:
        """Leases whose deadline is <= now, removed from the table (marked expired)."""
        out: list[Lease] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                self.end(lease, "expired")
                out.append(lease)
        return out

    def by_client(self, client: str) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.client == client]
