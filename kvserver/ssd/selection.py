"""Which chunks of a header scan a restarted SSD tier keeps: pure, no I/O.

Runs once at start-up on the daemon's event loop, inside ``SsdIndex.restore`` (which applies
the outcome to the index).

Rules: a chunk of a namespace this daemon does not serve (or of another geometry) is an
orphan; of two valid copies of one key the higher sequence number wins; past the capacity the
newest chunks are kept. Every slot not kept (orphans, older copies, over capacity, invalid
headers) is to be discarded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserver.ssd.format import ChunkHeader

#: (slot_bytes, slot number)
Slot = tuple[int, int]
#: a scanned chunk: (slot_bytes, slot number, its header)
Chunk = tuple[int, int, ChunkHeader]


@dataclass(slots=True)
class Selection:
    #: the chunks kept, oldest first (the eviction policy's order by age)
    kept: list[Chunk] = field(default_factory=list)
    #: every slot holding a header, valid or not (the others are blank or holes)
    taken: set[Slot] = field(default_factory=set)
    discard: list[Slot] = field(default_factory=list)
    duplicates: int = 0
    orphans: int = 0
    over_capacity: int = 0
    invalid: int = 0
    max_seq: int = 0


def select(
    chunks: Iterable[Chunk],
    invalid: Iterable[Slot],
    geometry: dict[str, tuple[int, int]],
    capacity_bytes: int,
) -> Selection:
    """Apply the rules of the module docstring; ``geometry``: ns_id → (part_bytes, num_parts)
    of the namespaces served."""
    out = Selection()
    for bad in invalid:
        out.discard.append(bad)
        out.invalid += 1
        out.taken.add(bad)
    newest: dict[tuple[str, bytes], Chunk] = {}
    for slot_bytes, slot, h in chunks:
        out.taken.add((slot_bytes, slot))
        out.max_seq = max(out.max_seq, h.seq)
        if geometry.get(h.ns_id) != (h.part_bytes, h.num_parts):
            out.orphans += 1
            out.discard.append((slot_bytes, slot))
            continue
        k = (h.ns_id, h.key)
        old = newest.get(k)
        if old is not None:
            out.duplicates += 1
            loser = old if old[2].seq < h.seq else (slot_bytes, slot, h)
            out.discard.append((loser[0], loser[1]))
            if loser is not old:
                continue
        newest[k] = (slot_bytes, slot, h)
    budget = capacity_bytes
    for c in sorted(newest.values(), key=lambda c: c[2].seq, reverse=True):
        if c[0] <= budget:
            budget -= c[0]
            out.kept.append(c)
        else:
            out.over_capacity += 1
            out.discard.append((c[0], c[1]))
    out.kept.reverse()
    return out
