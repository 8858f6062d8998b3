"""Rebuild at start-up: from a header scan of the SSD directory to a restored SSD index and the
saved namespaces registered in the DRAM engine.

Runs on the daemon's event loop, once, when the SSD tier opens (``SsdTier.open``); it does no
I/O (the scan was done on an I/O thread) and touches only the engine and the index it is given.
The tier then applies the outcome: discards, events, counters, log lines.

Namespaces: every readable saved spec is registered in the engine. One the engine refuses (its
chunk no longer fits the DRAM tier) keeps its chunks on SSD (restored, unserved, evicted in
time), so a restart with a larger DRAM tier serves them again; chunks of namespaces that were
never saved, or whose geometry differs, are orphans and discarded.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvserver.engine import StorageEngine
from kvserver.errors import KVServerError, StorageError
from kvserver.namespace import NamespaceSpec
from kvserver.ssd.fileio import aligned_buffer
from kvserver.ssd.format import ChunkHeader
from kvserver.ssd.index import RestoreResult, SsdIndex
from kvserver.ssd.scan import ScanResult
from kvserver.ssd.store import SlotStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rebuilt:
    #: ns_id → spec dict of every readable saved namespace (to be saved again as is).
    saved: dict[str, dict[str, Any]]
    result: RestoreResult


def rebuild(
    engine: StorageEngine, index: SsdIndex, saved: list[dict[str, Any]], scan: ScanResult
) -> Rebuilt:
    """Register the saved namespaces and restore ``index`` (empty) from ``scan``."""
    specs: list[NamespaceSpec] = []
    for data in saved:
        try:
            specs.append(NamespaceSpec.from_dict(data))
        except KVServerError as exc:
            logger.warning("SSD tier: unreadable saved namespace dropped: %s", exc)
    for spec in specs:
        try:
            engine.register_namespace(spec)
        except KVServerError as exc:  # e.g. its chunk no longer fits this DRAM tier
            logger.warning(
                "SSD tier: saved namespace %s not served (%s); its chunks are kept", spec.ns_id, exc
            )
    geometry = {s.ns_id: (s.part_bytes, s.tp_world_size) for s in specs}
    geometry |= {s.ns_id: (s.part_bytes, s.tp_world_size) for s in engine.namespaces.values()}
    chunks = [(c.slot_bytes, c.slot, c.header) for c in scan.chunks]
    result = index.restore(chunks, scan.num_slots, scan.invalid, geometry, scan.blank)
    if result.discard:
        logger.warning(
            "SSD tier: discarding %d slots (%d invalid headers, %d older duplicates, "
            "%d of unknown namespaces, %d over capacity)",
            len(result.discard),
            result.invalid,
            result.duplicates,
            result.orphans,
            result.over_capacity,
        )
    return Rebuilt({s.ns_id: s.to_dict() for s in specs}, result)


async def compact(
    index: SsdIndex,
    store: SlotStore,
    run: Callable[..., Awaitable[list[tuple[bool, bool, bool]]]],
    settle: Callable[[], Awaitable[None]],
) -> dict[int, int]:
    """Move the chunks past their file's bound below it (:func:`move_chunks` through
    ``run``, the tier's thread pool) and report each move to ``index``; the files' new
    lengths ({} when nothing lies past a bound). On the loop, before the tier serves; first
    awaits ``settle`` (the restore's discards: the slots they free are the targets)."""
    if not index.past_bound():
        return {}
    await settle()
    plan = index.plan_moves()
    if not plan:
        return {}
    jobs = [(e.slot_bytes, e.slot, (e.ns_id, e.key, e.seq), slot, seq) for e, slot, seq in plan]
    done = await run(move_chunks, store, jobs)
    for (entry, slot, seq), (moved, touched, cleared) in zip(plan, done, strict=True):
        if moved:
            index.moved(entry, slot, seq, cleared=cleared)
        else:
            index.move_failed(entry.slot_bytes, slot, touched=touched)
    logger.info("SSD tier: moved %d chunks below the capacity bound", sum(d[0] for d in done))
    return index.cut()


def move_chunks(store: SlotStore, plan: list[tuple[int, int, tuple[str, bytes, int], int, int]]
                ) -> list[tuple[bool, bool, bool]]:  # fmt: skip
    """Copy each chunk of ``plan`` — (slot size, old slot, the (ns_id, key, seq) expected
    there, new slot, new seq) — verified, into its new slot, then zero its old header. On an
    I/O thread, before the tier serves. One result per move: (moved, whether the new slot was
    written to, whether the old header was zeroed)."""
    out: list[tuple[bool, bool, bool]] = []
    for slot_bytes, old, expect, new, seq in plan:
        buf = aligned_buffer(slot_bytes)
        try:
            h = store.read_chunk(slot_bytes, old, expect, buf)
        except StorageError as exc:  # left in place: its first read drops it
            logger.warning("SSD tier: chunk not moved below the capacity bound: %s", exc)
            out.append((False, False, False))
            continue
        meta = ChunkHeader(h.ns_id, h.key, seq, slot_bytes, h.part_bytes, h.num_parts, 0)
        try:
            store.write_chunk(slot_bytes, new, meta, buf)
        except StorageError as exc:
            logger.warning("SSD tier: chunk not moved below the capacity bound: %s", exc)
            out.append((False, exc.context.get("slot_touched") is not False, False))
            continue
        (err,) = store.discard_slots([(slot_bytes, old)])
        out.append((True, True, err is None))
    return out
