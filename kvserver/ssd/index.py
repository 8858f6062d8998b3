"""The SSD tier's index: which chunk lives in which slot, slot allocation, byte accounting and
the tier's own eviction policy.

Pure in-process state (no I/O, no locks): owned by the tier on the daemon's event loop. The
disk work it implies (write a slot, discard a slot) is done by the caller, which reports back
(:meth:`commit`, :meth:`abort`, :meth:`discarded`).

Slot life::

    free ──reserve──► WRITING ──commit──► READY ──evict / remove──► discarding ──discarded──► free
                         └─────abort─────────────────────────────────────┘
    free (spare) ──to_release──► releasing ──released──► free (no disk blocks)

Disk space: the slots no entry holds, their states and which go back to the filesystem are
the index's :class:`~kvserver.ssd.space.SlotSpace` (``space``; ``discarded``,
``discard_failed``, ``released`` are its methods): while the tier runs, its files hold about
the capacity plus ``slack_bytes`` in spare slots, whatever the mix of slot sizes.

Invariants (:meth:`check_invariants`):
- every slot below a file's high-water mark is exactly one of: free, held by one entry
  (WRITING or READY), doomed (removed while read), discarding, or quarantined (its discard
  failed);
- ``used_bytes`` is the sum of the slot sizes of all entries and never exceeds the capacity;
- the policy tracks exactly the READY entries; a WRITING entry is invisible to ``ready()``;
- an entry with readers (a read in flight) is never evicted and its slot is never freed;
  :meth:`remove` of a read entry defers the slot's release to the last :meth:`unpin`;
- sequence numbers are unique and increase; a rebuilt index continues after the largest seen;
- a releasing slot is in no other state; spare slots are free (``space.py``; ``slots.py``
  says what an *unlisted* slot is: never handed out; start-up memory is bounded by the
  capacity, not by a file's length).

Check-then-act: :meth:`reserve` either returns the new entry (and the victims it evicted) or
None with nothing changed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserver.policies import make_policy
from kvserver.ssd.format import BLOCK, ChunkHeader
from kvserver.ssd.selection import Slot as Slot
from kvserver.ssd.selection import select
from kvserver.ssd.space import SlotSpace

IndexKey = tuple[str, bytes]


class SsdState(enum.IntEnum):
    WRITING = 0
    READY = 1


@dataclass(slots=True, eq=False)
class SsdEntry:
    """One chunk on SSD (all TP parts in one slot)."""

    ns_id: str
    key: bytes
    slot_bytes: int
    slot: int
    seq: int
    state: SsdState
    #: reads in flight (the slot must not be freed under them).
    readers: int = 0
    #: removed from the index while read: its slot is released by the last unpin.
    doomed: bool = False

    @property
    def location(self) -> Slot:
        return (self.slot_bytes, self.slot)


@dataclass(slots=True)
class RestoreResult:
    recovered: list[SsdEntry] = field(default_factory=list)
    #: slots to discard: invalid headers, older duplicates, orphans, over capacity.
    discard: list[Slot] = field(default_factory=list)
    duplicates: int = 0
    orphans: int = 0
    over_capacity: int = 0
    invalid: int = 0
    #: data files to cut (slot size → slots kept): nothing live beyond that length.
    trimmed: dict[int, int] = field(default_factory=dict)


class SsdIndex:
    """See the module docstring."""

    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy)
        self._entries: dict[IndexKey, SsdEntry] = {}
        #: the slots no entry holds (see ``space.py``)
        self.space = space = SlotSpace(capacity_bytes)
        self._next_seq = 1
        self.used_bytes = 0
        self.num_writing = 0
        self.slack_bytes = space.slack_bytes
        self.discarded = space.discarded
        self.discard_failed = space.discard_failed
        self.released = space.released

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries) - self.num_writing

    def get(self, ns_id: str, key: bytes) -> SsdEntry | None:
        """The entry of ``key`` in any state (None if absent)."""
        return self._entries.get((ns_id, key))

    def ready(self, ns_id: str, key: bytes) -> SsdEntry | None:
        entry = self._entries.get((ns_id, key))
        return entry if entry is not None and entry.state is SsdState.READY else None

    def entries(self) -> Iterable[SsdEntry]:
        return self._entries.values()

    def held_keys(self) -> dict[str, list[bytes]]:
        """The READY (visible) chunk keys per namespace id: what the fleet index mirrors."""
        out: dict[str, list[bytes]] = {}
        for (ns_id, key), entry in self._entries.items():
            if entry.state is SsdState.READY:
                out.setdefault(ns_id, []).append(key)
        return out

    @property
    def num_discarding(self) -> int:
        return self.space.num_discarding

    @property
    def spare_bytes(self) -> int:
        """Bytes of the free slots that hold disk blocks (O(files))."""
        return self.space.spare_bytes

    @property
    def num_releasing(self) -> int:
        return self.space.num_releasing

    @property
    def can_release(self) -> bool:
        """False once a release failed (the filesystem cannot punch holes): spares are kept."""
        return self.space.can_release

    @property
    def reserved_bytes(self) -> int:
        return sum(e.slot_bytes for e in self._entries.values() if e.state is SsdState.WRITING)

    @property
    def pinned_bytes(self) -> int:
        return sum(e.slot_bytes for e in self._entries.values() if e.readers)

    def usage_by_namespace(self) -> dict[str, tuple[int, int]]:
        """ns_id → (READY entries, their slot bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for e in self._entries.values():
            if e.state is SsdState.READY:
                n, b = out.get(e.ns_id, (0, 0))
                out[e.ns_id] = (n + 1, b + e.slot_bytes)
        return out

    def slot_state(self, slot: Slot) -> str:
        """ "held", "free", "discarding", "releasing", "doomed", "quarantined", "unlisted"
        (past the bound of a file restored longer, see ``slots.py``) or "unused" (beyond the end);
        O(entries): for tests and debugging."""
        return self.space.state(slot, any(e.location == slot for e in self._entries.values()))

    def touch(self, ns_id: str, keys: Iterable[bytes]) -> None:
        self.policy.touch([(ns_id, k) for k in keys])

    # ------------------------------------------------------------------ write path

    def reserve(
        self, ns_id: str, key: bytes, slot_bytes: int
    ) -> tuple[SsdEntry, list[SsdEntry]] | None:
        """A WRITING entry in a free slot for ``key``, evicting READY unread entries if the
        capacity is short. Returns (entry, victims); the victims' slots are now discarding.
        None — nothing changed — if the key is present or room cannot be made.
        """
        if (ns_id, key) in self._entries or slot_bytes > self.capacity_bytes:
            return None
        victims: list[SsdEntry] = []
        shortfall = self.used_bytes + slot_bytes - self.capacity_bytes
        if shortfall > 0:
            entries = self._entries
            chosen = self.policy.evict(
                -(-shortfall // BLOCK),
                lambda k: entries[k].slot_bytes // BLOCK,  # type: ignore[index]
                lambda k: entries[k].readers == 0,  # type: ignore[index]
            )
            if chosen is None:
                return None
            for k in chosen:
                victim = entries.pop(k)  # type: ignore[call-overload]
                self.used_bytes -= victim.slot_bytes
                self.space.discard(victim.location)
                victims.append(victim)
        slot = self.space.take(slot_bytes)
        entry = SsdEntry(ns_id, key, slot_bytes, slot, self._next_seq, SsdState.WRITING)
        self._next_seq += 1
        self._entries[(ns_id, key)] = entry
        self.used_bytes += slot_bytes
        self.num_writing += 1
        return entry, victims

    def commit(self, entry: SsdEntry) -> None:
        """The entry's slot is written: it becomes READY (visible, evictable)."""
        assert entry.state is SsdState.WRITING and self.get(entry.ns_id, entry.key) is entry
        entry.state = SsdState.READY
        self.num_writing -= 1
        self.policy.insert((entry.ns_id, entry.key))

    def abort(self, entry: SsdEntry) -> Slot:
        """The write failed: forget the entry; its slot (maybe half written) is discarding."""
        assert entry.state is SsdState.WRITING and self.get(entry.ns_id, entry.key) is entry
        del self._entries[(entry.ns_id, entry.key)]
        self.used_bytes -= entry.slot_bytes
        self.num_writing -= 1
        self.space.discard(entry.location)
        return entry.location

    # ------------------------------------------------------------------ read path

    def pin(self, entry: SsdEntry) -> None:
        entry.readers += 1

    def unpin(self, entry: SsdEntry) -> Slot | None:
        """End one read. Returns the slot to discard if this released a removed entry."""
        entry.readers -= 1
        if entry.readers == 0 and entry.doomed:
            entry.doomed = False
            self.space.end_doom(entry.location)
            return entry.location
        return None

    def remove(self, entry: SsdEntry) -> Slot | None:
        """Drop a READY entry (failed verification). Returns its slot to discard now, or None
        if reads are in flight (then the last :meth:`unpin` returns it)."""
        assert entry.state is SsdState.READY and self.get(entry.ns_id, entry.key) is entry
        del self._entries[(entry.ns_id, entry.key)]
        self.policy.remove((entry.ns_id, entry.key))
        self.used_bytes -= entry.slot_bytes
        if entry.readers:
            entry.doomed = True
            self.space.doom(entry.location)
            return None
        self.space.discard(entry.location)
        return entry.location

    # ------------------------------------------------------------------ slot recycling

    def to_release(self) -> list[Slot]:
        """Spare slots whose disk blocks should go back to the filesystem now: see
        :meth:`SlotSpace.to_release <kvserver.ssd.space.SlotSpace.to_release>`; report each
        back with :meth:`released`."""
        return self.space.to_release(self.used_bytes)

    # ------------------------------------------------------------------ rebuild

    def restore(
        self,
        chunks: Iterable[tuple[int, int, ChunkHeader]],
        num_slots: dict[int, int],
        invalid: Iterable[Slot],
        geometry: dict[str, tuple[int, int]],
        blank: Iterable[Slot] = (),
    ) -> RestoreResult:
        """Rebuild from a scan: ``chunks`` (slot_bytes, slot, header), the files' lengths in
        slots, the invalid slots, ``geometry`` ns_id → (part_bytes, num_parts) of the
        namespaces this daemon serves (chunks of others are orphans), and the ``blank`` slots
        that hold disk blocks (they are spare; other free slots are holes).

        Only the free slots below a file's bound (``capacity // slot size``) are listed; the
        others are unlisted (memory in proportion to the capacity, not to a file's length: a
        huge sparse file is cut at start-up, see :meth:`plan_moves`).

        Keeps what ``selection.select`` keeps; every other non-blank slot is returned for
        discarding, except those past the last live slot of their file: the file is cut there
        (``trimmed``). REQUIRES: empty index.
        """
        assert not self._entries and not self.space.files, "restore into an empty index only"
        sel = select(chunks, invalid, geometry, self.capacity_bytes)
        result = RestoreResult(
            discard=sel.discard,
            duplicates=sel.duplicates,
            orphans=sel.orphans,
            over_capacity=sel.over_capacity,
            invalid=sel.invalid,
        )
        for slot_bytes, slot, h in sel.kept:  # oldest first: LRU order by age
            entry = SsdEntry(h.ns_id, h.key, slot_bytes, slot, h.seq, SsdState.READY)
            self._entries[(h.ns_id, h.key)] = entry
            self.policy.insert((h.ns_id, h.key))
            self.used_bytes += slot_bytes
            result.recovered.append(entry)
        live: dict[int, int] = {}
        for slot_bytes, slot, _h in sel.kept:
            live[slot_bytes] = max(live.get(slot_bytes, 0), slot + 1)
        result.trimmed, result.discard = self.space.restore(
            num_slots, live, result.discard, sel.taken, list(blank)
        )
        self._next_seq = sel.max_seq + 1
        return result

    # ------------------------------------------------------------------ start-up compaction

    def past_bound(self) -> bool:
        """Whether some entry lies at or past its file's bound (see :meth:`plan_moves`)."""
        return any(e.slot >= self.capacity_bytes // e.slot_bytes for e in self._entries.values())

    def plan_moves(self) -> list[tuple[SsdEntry, int, int]]:
        """After :meth:`restore`, before any other write: the entries lying at or past their
        file's bound (``capacity // slot size`` slots: a restart with a smaller capacity kept
        the newest chunks wherever they lie), each with a free slot below the bound to be
        copied into and a new sequence number, highest slots first. The targets leave the
        free list; report each back with :meth:`moved` or :meth:`move_failed`, then
        :meth:`cut`."""
        plan: list[tuple[SsdEntry, int, int]] = []
        late = sorted(
            (e for e in self._entries.values() if e.slot >= self.capacity_bytes // e.slot_bytes),
            key=lambda e: e.slot,
            reverse=True,
        )
        for e in late:
            slot = self.space.take_below(e.slot_bytes, self.capacity_bytes // e.slot_bytes)
            if slot is not None:
                plan.append((e, slot, self._next_seq))
                self._next_seq += 1
        return plan

    def moved(self, entry: SsdEntry, slot: int, seq: int, *, cleared: bool) -> None:
        """``entry`` was copied into ``slot`` with sequence number ``seq``; its old slot is
        free if its header was ``cleared``, quarantined otherwise."""
        old = entry.location
        entry.slot, entry.seq = slot, seq
        self.space.moved_from(old, cleared=cleared)

    def move_failed(self, slot_bytes: int, slot: int, *, touched: bool) -> None:
        """A planned copy into ``slot`` failed (the entry stays where it was): the slot is
        free again if nothing was written to it, else (it may hold a torn copy) not reused in
        this run."""
        self.space.move_failed(slot_bytes, slot, touched=touched)

    def cut(self) -> dict[int, int]:
        """Shorten each file to just past its last slot in use (held, discarding, doomed or
        quarantined); returns slot size → slots kept for the files that shrank."""
        return self.space.cut([e.location for e in self._entries.values()])

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Recompute the accounting from scratch and compare (tests; O(slots))."""
        used = writing = 0
        held: set[Slot] = set()
        seqs: set[int] = set()
        for (ns_id, key), e in self._entries.items():
            assert (e.ns_id, e.key) == (ns_id, key) and not e.doomed
            assert e.location not in held, "two entries share a slot"
            held.add(e.location)
            assert e.seq not in seqs and e.seq < self._next_seq
            seqs.add(e.seq)
            used += e.slot_bytes
            tracked = (ns_id, key) in self.policy
            if e.state is SsdState.WRITING:
                writing += 1
                assert not tracked
            else:
                assert tracked, "ready entry not tracked by the policy"
        assert used == self.used_bytes <= self.capacity_bytes, (used, self.used_bytes)
        assert writing == self.num_writing
        assert len(self.policy) == len(self._entries) - writing
        self.space.check(held)
