"""The SSD tier's disk space: the slots of its data files that no entry holds, the state each
is in, and which of them go back to the filesystem.

Pure in-process state (no I/O, no locks), owned by :class:`~kvserver.ssd.index.SsdIndex`
(``index.space``) on the daemon's event loop. The index says when a slot leaves an entry
(:meth:`SlotSpace.discard`, :meth:`SlotSpace.doom`); the caller reports the disk work back
through the index (``discarded``, ``discard_failed``, ``released``: this class's methods).

Slot states besides *held* (the index's entries, WRITING or READY)::

    discarding ──discarded──► free (spare: keeps its disk blocks)    doomed ──end_doom──► discarding
        └──discard_failed──► quarantined (never reused in this run)
    free (spare) ──to_release──► releasing ──released──► free (no disk blocks)

Disk space: a discarded slot keeps its disk blocks (*spare*: reused in place, fast) as long as
``used_bytes + spare_bytes`` stays within the capacity plus ``slack_bytes``; past that,
:meth:`SlotSpace.to_release` hands out the highest spare slots, largest file first, for the
caller to punch (their blocks go back to the filesystem). Free slots are reused lowest first
(:class:`~kvserver.ssd.slots.SlotFile`), so what is in use gathers at the start of each file.

Invariants (:meth:`SlotSpace.check`, given the held slots): every slot below a file's
high-water mark is exactly one of free, held, doomed, discarding, releasing or quarantined
(or *unlisted*, see ``slots.py``); spare slots are free; no held slot is discarding or
quarantined.
"""

from __future__ import annotations

from kvserver.ssd.selection import Slot
from kvserver.ssd.slots import SlotFile, slack_bytes_for


class SlotSpace:
    """See the module docstring."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        #: slot size → its data file's slots
        self.files: dict[int, SlotFile] = {}
        self._discarding: set[Slot] = set()
        self._quarantined: set[Slot] = set()
        #: slots of entries removed while being read (released by the last unpin).
        self._doomed: set[Slot] = set()
        #: free slots whose disk blocks are being returned (``to_release``)
        self._releasing: set[Slot] = set()
        self.slack_bytes = slack_bytes_for(capacity_bytes)
        #: False once a release failed (the filesystem cannot punch holes): spares are kept
        self.can_release = True

    # ------------------------------------------------------------------ queries

    @property
    def num_discarding(self) -> int:
        return len(self._discarding)

    @property
    def spare_bytes(self) -> int:
        """Bytes of the free slots that hold disk blocks (O(files))."""
        return sum(f.spare_bytes for f in self.files.values())

    @property
    def num_releasing(self) -> int:
        return len(self._releasing)

    def state(self, slot: Slot, held: bool) -> str:
        """The state of ``slot`` (``held``: an entry has it), as ``SsdIndex.slot_state``."""
        f = self.files.get(slot[0])
        if f is None or slot[1] >= f.num_slots:
            return "unused"
        if held:
            return "held"
        for name, group in (
            ("discarding", self._discarding),
            ("releasing", self._releasing),
            ("doomed", self._doomed),
            ("quarantined", self._quarantined),
        ):
            if slot in group:
                return name
        if slot[1] in f.free:
            return "free"
        return "unlisted" if slot[1] >= f.listed else "lost"

    # ------------------------------------------------------------------ from the index

    def take(self, slot_bytes: int) -> int:
        """A free slot of size ``slot_bytes`` for a new entry (lowest first, else a new one)."""
        f = self.files.get(slot_bytes)
        if f is None:
            f = self.files[slot_bytes] = SlotFile(slot_bytes)
        return f.take()

    def discard(self, slot: Slot) -> None:
        """``slot`` left its entry: it is to be invalidated on disk (discarding)."""
        self._discarding.add(slot)

    def doom(self, slot: Slot) -> None:
        """``slot`` left its entry while being read: discarding once the reads end."""
        self._doomed.add(slot)

    def end_doom(self, slot: Slot) -> None:
        """The last read of a doomed slot ended: it is discarding."""
        self._doomed.remove(slot)
        self._discarding.add(slot)

    # ------------------------------------------------------------------ slot recycling

    def discarded(self, slot: Slot) -> None:
        """The slot was invalidated on disk: it may be reused."""
        self._discarding.remove(slot)
        self._free(slot, spare=True)

    def _free(self, slot: Slot, *, spare: bool) -> None:
        self.files[slot[0]].put(slot[1], spare=spare)

    def to_release(self, used_bytes: int) -> list[Slot]:
        """Spare slots whose disk blocks should go back to the filesystem now (``used_bytes +
        spare_bytes`` past the capacity plus ``slack_bytes``): the highest slots of the files
        with the most spare bytes first. They leave the free list until :meth:`released`."""
        over = used_bytes + self.spare_bytes - self.capacity_bytes - self.slack_bytes
        if over <= 0 or not self.can_release:
            return []
        out: list[Slot] = []
        for f in sorted(self.files.values(), key=lambda f: f.spare_bytes, reverse=True):
            if over <= 0:
                break
            chosen = f.take_spare(-(-over // f.slot_bytes))
            over -= len(chosen) * f.slot_bytes
            out += [(f.slot_bytes, s) for s in chosen]
        self._releasing.update(out)
        return out

    def released(self, slot: Slot, *, ok: bool) -> None:
        """A slot of :meth:`to_release` is free again: without disk blocks if ``ok``, else (the
        filesystem refused) spare, and no more slots are released in this run."""
        self._releasing.remove(slot)
        self._free(slot, spare=not ok)
        if not ok:
            self.can_release = False

    def discard_failed(self, slot: Slot) -> None:
        """The slot could not be invalidated: never reuse it in this run."""
        self._discarding.remove(slot)
        self._quarantined.add(slot)

    # ------------------------------------------------------------------ start-up

    def restore(
        self,
        num_slots: dict[int, int],
        live: dict[int, int],
        discard: list[Slot],
        taken: set[Slot],
        blank: list[Slot],
    ) -> tuple[dict[int, int], list[Slot]]:
        """After a scan, into an empty space: the files' lengths in slots, each cut just past
        its last ``live`` slot (slot size → slots kept; the files cut are returned), the
        ``discard`` slots below the new lengths discarding (returned), free the slots below
        a file's bound (``capacity // slot size``) not ``taken``, spare those ``blank``."""
        trimmed: dict[int, int] = {}
        for slot_bytes, n in num_slots.items():
            self.files[slot_bytes] = SlotFile(slot_bytes, n)
        for slot_bytes, f in self.files.items():
            keep = live.get(slot_bytes, 0)
            if keep < f.num_slots:
                trimmed[slot_bytes] = f.num_slots = keep
        discard = [s for s in discard if s[1] < self.files[s[0]].num_slots]
        self._discarding.update(discard)
        for slot_bytes, f in self.files.items():
            f.restore(
                self.capacity_bytes // slot_bytes,
                {s for sb, s in taken if sb == slot_bytes},
                {s for sb, s in blank if sb == slot_bytes},
            )
        return trimmed, discard

    def take_below(self, slot_bytes: int, bound: int) -> int | None:
        """The lowest free slot of size ``slot_bytes`` if it is below ``bound`` (taken off the
        free list), else None."""
        f = self.files[slot_bytes]
        lowest = f.lowest_free()
        if lowest is not None and lowest < bound:
            return f.take()
        return None

    def moved_from(self, old: Slot, *, cleared: bool) -> None:
        """An entry moved out of ``old``: free if its header was ``cleared``, else quarantined."""
        if cleared:
            self._free(old, spare=True)
        else:
            self._quarantined.add(old)

    def move_failed(self, slot_bytes: int, slot: int, *, touched: bool) -> None:
        """A planned copy into ``slot`` failed (the entry stays where it was): the slot is
        free again if nothing was written to it, else (it may hold a torn copy) not reused in
        this run."""
        if touched:
            self._quarantined.add((slot_bytes, slot))
        else:
            self._free((slot_bytes, slot), spare=True)  # may hold blocks: counted as such

    def cut(self, held: list[Slot]) -> dict[int, int]:
        """Shorten each file to just past its last slot in use (``held``, discarding, doomed,
        releasing or quarantined); returns slot size → slots kept for the files that shrank."""
        busy: dict[int, int] = {}
        groups = (self._discarding, self._quarantined, self._doomed, self._releasing)
        for sb, s in held + [x for g in groups for x in g]:
            busy[sb] = max(busy.get(sb, 0), s + 1)
        trimmed: dict[int, int] = {}
        for slot_bytes, f in self.files.items():
            if f.cut(busy.get(slot_bytes, 0)):
                trimmed[slot_bytes] = f.num_slots
        return trimmed

    # ------------------------------------------------------------------ checks

    def check(self, held: set[Slot]) -> None:
        """The invariants of the module docstring, ``held`` the entries' slots (tests;
        O(slots))."""
        assert not held & self._discarding and not held & self._quarantined
        groups = (held, self._discarding, self._quarantined, self._doomed, self._releasing)
        for slot_bytes, f in self.files.items():
            free = set(f.free)
            assert len(free) == len(f.free), "slot freed twice"
            assert f.spare <= free, "a spare slot is not free"
            listed = set(range(min(f.num_slots, f.listed)))  # the others may be unlisted
            others = {s for g in groups for sb, s in g if sb == slot_bytes}
            for s in listed | free | others:
                loc = (slot_bytes, s)
                states = (s in free) + sum(loc in g for g in groups)
                assert states == 1, f"slot {loc} in {states} states"
            assert all(0 <= s < f.num_slots for s in free | others)
