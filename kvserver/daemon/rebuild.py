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
from dataclasses import dataclass
from typing import Any

from kvserver.engine import StorageEngine
from kvserver.errors import KVServerError
from kvserver.namespace import NamespaceSpec
from kvserver.ssd.index import RestoreResult, SsdIndex
from kvserver.ssd.scan import ScanResult

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
    result = index.restore(chunks, scan.num_slots, scan.invalid, geometry)
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
