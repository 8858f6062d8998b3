"""Promotion: bring chunks that are only on SSD back into the DRAM tier before a load.

Runs on the daemon's event loop, as part of :class:`~kvserver.daemon.tiering.SsdTier` (its
``promote`` delegates here); the slot reads run on the tier's I/O threads. One call:

1. plan: the request's keys that are in DRAM (protected from the eviction below) and those
   READY on SSD but not in DRAM (pinned in the SSD index so they are not evicted while read);
2. reserve DRAM for the latter with one ``prepare_store(gated=False)`` (atomic: all or none;
   it may evict DRAM victims, which the tier writes back);
3. read and verify the slots in windows of ``staging_bytes`` on threads; a chunk that fails
   is dropped by the tier (a miss);
4. copy the verified parts into the reserved arena pages (``write_part``) and complete the
   store for the keys that made it, rolling back the rest; unpin.

If DRAM cannot take the chunks (every page pinned or reserved) and the caller asked for
``direct``, the verified bytes are returned instead, for the remote ``get`` to send straight
from the read buffers. The reservation holds a lease of ``max_lease_s``: should the disk be so
slow that it expires, ``write_part`` fails and the chunk is simply not promoted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserver.errors import KVServerError
from kvserver.namespace import NamespaceSpec
from kvserver.ssd.format import HEADER_BYTES
from kvserver.ssd.index import SsdEntry

if TYPE_CHECKING:
    from kvserver.daemon.tiering import SsdTier

logger = logging.getLogger(__name__)

#: lease owner of promotion reservations in the DRAM tier.
PROMOTE_CLIENT = "kvserver-ssd-promote"


async def promote(
    tier: SsdTier, ns_id: str, keys: Sequence[bytes], *, direct: bool = False
) -> dict[bytes, list[memoryview]]:
    """Promote the keys of ``keys`` that are READY on SSD but not in DRAM (module docstring).

    Returns, when ``direct``, the parts (one view per rank) of keys DRAM could not take;
    otherwise {}. Keys in neither tier and keys that fail verification are left for the
    caller's load to report missing. Raises what ``prepare_store`` raises for bad input
    (nothing changed then).
    """
    engine = tier.engine
    spec = engine.namespace(ns_id)
    todo: list[SsdEntry] = []
    protect: list[bytes] = []
    for key in dict.fromkeys(keys):
        if engine.contains(ns_id, key):
            protect.append(key)
        elif (entry := tier.index.ready(ns_id, key)) is not None:
            todo.append(entry)
    if not todo:
        return {}
    for entry in todo:
        tier.index.pin(entry)
    out: dict[bytes, list[memoryview]] = {}
    lease = 0
    done: list[bytes] = []
    try:
        grant = engine.prepare_store(
            ns_id,
            protect + [e.key for e in todo],
            client=PROMOTE_CLIENT,
            lease_s=engine.config.max_lease_s,
            gated=False,
        )
        tier.flush_events()
        reserved = set(grant.keys) if grant is not None else set()
        lease = grant.lease_id if grant is not None else 0
        wanted = [e for e in todo if e.key in reserved or direct]
        for window in _windows(wanted, tier.config.staging_bytes):
            reads = await asyncio.gather(*(tier.read(e, e.key in reserved) for e in window))
            for entry, got in zip(window, reads, strict=True):
                if got is None:
                    continue
                buf, pooled = got
                parts = _parts(buf, spec)
                if entry.key not in reserved:
                    out[entry.key] = parts  # the caller sends them; the buffer is its own
                    tier.counters.served_direct_chunks += 1
                    continue
                try:
                    for rank, part in enumerate(parts):
                        engine.write_part(lease, entry.key, rank, part)
                    done.append(entry.key)
                except KVServerError as exc:  # the lease expired under a very slow disk
                    logger.warning("SSD tier: promotion of a chunk failed: %s", exc)
                finally:
                    if pooled:
                        tier.reads.release(buf)
    finally:
        for entry in todo:
            tier.unpin(entry)
        if lease:
            _finish(tier, lease, done)
        tier.flush_events()
    return out


def _finish(tier: SsdTier, lease: int, done: list[bytes]) -> None:
    """Complete the promoted keys; roll back whatever else the lease still reserves."""
    engine = tier.engine
    with contextlib.suppress(KVServerError):  # lease already ended (all done) or expired
        if done:
            tier.counters.promoted_chunks += len(engine.complete_store(lease, keys=done))
        engine.complete_store(lease, success=False)


def _windows(entries: list[SsdEntry], budget: int) -> list[list[SsdEntry]]:
    """Consecutive groups whose slot bytes fit ``budget`` (at least one entry each)."""
    out: list[list[SsdEntry]] = []
    cur: list[SsdEntry] = []
    size = 0
    for e in entries:
        if cur and size + e.slot_bytes > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.slot_bytes
    if cur:
        out.append(cur)
    return out


def _parts(buf: memoryview, spec: NamespaceSpec) -> list[memoryview]:
    part, base = spec.part_bytes, HEADER_BYTES
    return [buf[base + r * part : base + (r + 1) * part] for r in range(spec.tp_world_size)]
