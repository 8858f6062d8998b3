"""When the daemon leases a worker's co-located copies run under end, and what a late copy is.

Runs in the worker process, on the worker's thread (the connector's, worker/kv_connector.py,
its only user); not thread-safe. A co-located worker copies into a store grant's pages and
out of a load grant's pages in the daemon's arena itself. Once a lease has expired the daemon
has rolled the reservation back, or dropped the load's pins, and after a quarantine (its
default lease, docs/architecture.md "Leases") hands those pages to other keys. So:

- a copy whose lease has expired before it is submitted does not start (:meth:`expired`);
- a load whose copies were seen landed (``Transfer.landed_at``) only at or after its deadline
  fails, whatever it copied (:meth:`landed_late`): the blocks may hold another prompt's KV.

Each lease's deadline is ``RequestTransfers.expires_in_s`` (the time its lease had left when
the scheduler shipped it) after the metadata first arrived, on this process's clock, so never
later than the daemon's. A lease whose producer says nothing (an older scheduler) has none and
is not checked. Call order per lease: :meth:`note` (bind, flush) → :meth:`take` (submit) →
:meth:`watch` (a load planned on the arena) → :meth:`landed_late` (collected).
"""

from __future__ import annotations

import time

from step_protocol import ConnectorMetadata
from worker.transfer import Transfer

#: (is_load, req_id, lease_id): one lease of one request (the connector's ``JobId``).
JobId = tuple[bool, str, int]


class LeaseDeadlines:
    """The deadlines of the leases a worker copies under; see the module docstring."""

    def __init__(self) -> None:
        #: leases not submitted yet -> when they expire (this process's clock)
        self._pending: dict[JobId, float] = {}
        #: co-located loads in flight -> their deadline (checked when they land)
        self._watched: dict[JobId, float] = {}
        #: co-located stores failed because their lease had expired before the copy started
        self.expired_stores = 0
        #: co-located loads failed because their lease expired before the copy started or
        #: before it was seen landed
        self.expired_loads = 0

    def note(self, meta: ConnectorMetadata) -> None:
        """Record when each lease of ``meta`` that says how long it has left expires (the
        first time a metadata is seen: ``flush`` or bind)."""
        now = time.monotonic()
        pending = self._pending
        for is_load, transfers in ((False, meta.stores), (True, meta.loads)):
            for t in transfers:
                if t.expires_in_s is not None:
                    pending.setdefault((is_load, t.req_id, t.lease_id), now + t.expires_in_s)

    def take(self, job: JobId) -> float | None:
        """The deadline of ``job``, which is being submitted (None: not known)."""
        return self._pending.pop(job, None)

    def expired(self, job: JobId, deadline: float | None) -> bool:
        """Whether ``job``'s copy must not start: its ``deadline`` has passed (counted)."""
        if deadline is None or time.monotonic() < deadline:
            return False
        if job[0]:
            self.expired_loads += 1
        else:
            self.expired_stores += 1
        return True

    def watch(self, job: JobId, deadline: float | None) -> None:
        """``job``, a load copied from the arena, is checked when it lands."""
        if deadline is not None:
            self._watched[job] = deadline

    def landed_late(self, transfer: Transfer) -> bool:
        """Whether ``transfer`` (collected, tagged with its JobId) is a watched load whose
        copies were seen landed only at or after its deadline (counted). A load that failed
        every key already is not counted."""
        deadline = self._watched.pop(transfer.tag, None)
        if deadline is None or len(transfer.failed_keys) >= len(transfer.keys):
            return False
        landed = transfer.landed_at
        if landed is not None and landed < deadline:
            return False
        self.expired_loads += 1
        return True

    def clear(self) -> None:
        """Forget every lease (the scheduler forgot them: the worker's ``forget``)."""
        self._pending.clear()
        self._watched.clear()

    @property
    def num_watched(self) -> int:
        """Loads in flight whose landing is checked against their deadline."""
        return len(self._watched)
