"""The slots of one SSD data file as the index sees them: its length, its free slots (reused
lowest first) and which of them still hold disk blocks.

Pure in-process state (no I/O, no locks), owned by :class:`~kvserver.ssd.space.SlotSpace` (the
index's) on the daemon's event loop; it decides *when* slots are free, spare or released, this
class keeps them in order.

Invariants (checked by ``SlotSpace.check``, from ``SsdIndex.check_invariants``):
- ``free`` is a heap of distinct slots below ``num_slots``; ``spare`` ⊆ ``free``;
- a spare slot holds disk blocks (discarded: its payload is still there); another free slot
  holds none that matter (a hole, a released slot, never written);
- slots from ``listed`` to ``num_slots`` that no one holds are *unlisted*: a file restored
  longer than the capacity bound lists its free slots only below it (memory in proportion to
  the capacity, not to the file's length); they are never handed out.
"""

from __future__ import annotations

import heapq

#: spare slots (free with disk blocks) kept beyond the capacity: a fraction of it, at most this
SLACK_MAX = 64 << 20
SLACK_FRACTION = 16


def slack_bytes_for(capacity_bytes: int) -> int:
    """The disk space a tier of ``capacity_bytes`` may hold beyond its capacity in spare slots
    (also its files' preallocation step): 1/16 of it, at most 64 MiB."""
    return min(SLACK_MAX, capacity_bytes // SLACK_FRACTION)


class SlotFile:
    """See the module docstring. ``slot_bytes`` is the file's slot size."""

    __slots__ = ("free", "listed", "num_slots", "slot_bytes", "spare")

    def __init__(self, slot_bytes: int, num_slots: int = 0) -> None:
        self.slot_bytes = slot_bytes
        #: slots 0..num_slots-1 exist (the file's high-water mark)
        self.num_slots = num_slots
        self.free: list[int] = []  # heap: lowest slot reused first
        #: free slots that hold disk blocks
        self.spare: set[int] = set()
        self.listed = 1 << 62

    @property
    def spare_bytes(self) -> int:
        return len(self.spare) * self.slot_bytes

    def take(self) -> int:
        """A slot to write into: the lowest free one, else a new one at the end."""
        if not self.free:
            self.num_slots += 1
            return self.num_slots - 1
        slot = heapq.heappop(self.free)
        self.spare.discard(slot)
        return slot

    def lowest_free(self) -> int | None:
        return self.free[0] if self.free else None

    def put(self, slot: int, *, spare: bool) -> None:
        """``slot`` is free again; ``spare``: it still holds disk blocks."""
        heapq.heappush(self.free, slot)
        if spare:
            self.spare.add(slot)

    def take_spare(self, count: int) -> list[int]:
        """The ``count`` highest spare slots, taken off the free list (ascending)."""
        chosen = sorted(self.spare)[-count:] if count > 0 else []
        if chosen:
            self.spare.difference_update(chosen)
            gone = set(chosen)
            self.free = [s for s in self.free if s not in gone]
            heapq.heapify(self.free)
        return chosen

    def restore(self, listed: int, taken: set[int], blank: set[int]) -> None:
        """After a scan: the slots below ``min(num_slots, listed)`` not ``taken`` are free,
        those of them in ``blank`` (all-zero header, disk blocks present) spare."""
        self.listed = listed
        self.free = [s for s in range(min(self.num_slots, listed)) if s not in taken]
        self.spare = {s for s in self.free if s in blank}  # ascending list: already a heap

    def cut(self, keep: int) -> bool:
        """Shorten to ``keep`` slots (those past it are free or unlisted); False if the file
        was not longer."""
        if keep >= self.num_slots:
            return False
        self.num_slots = keep
        self.free = [s for s in self.free if s < keep]
        heapq.heapify(self.free)
        self.spare = {s for s in self.spare if s < keep}
        return True
