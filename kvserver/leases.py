"""Leases: every reservation and every pin carries a deadline.

A client that crashes between ``prepare_*`` and ``complete_*`` must not hold memory forever. The
engine records each grant as a :class:`Lease`; :meth:`LeaseTable.pop_expired` yields those whose
deadline has passed so the engine can roll back reservations and release pins. Expired ids are
remembered (bounded) so a late ``complete_*`` gets ``LeaseExpired`` rather than a generic
"unknown lease".

Single owner (the storage engine); no locks. Time comes from the engine's injected clock.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserver.errors import LeaseError, LeaseExpired

#: how many expired/cancelled lease ids are remembered for error messages.
EXPIRED_MEMORY = 65536


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


class LeaseTable:
    """Live leases by id, plus a deadline heap (lazy deletion)."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._heap: list[tuple[float, int]] = []
        self._next_id = 1
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
