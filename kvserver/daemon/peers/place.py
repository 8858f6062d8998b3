"""Placing what peers send in DRAM, as an SSD promotion does.

Runs in the daemon process, on its event loop; part of :class:`~kvserver.daemon.peers.fetch.
PeerFetches` (used only from there). Not thread-safe: loop only.

A fetched run is placed with one ``prepare_store(gated=False)`` (:meth:`Placer.reserve`:
protecting from the eviction it may cause the request's keys already in DRAM and the windows
of the same fetch placed before it), then either ``write_part`` of every part it brought
(:meth:`Placer.place`, the ZMQ path: the parts arrived in ZMQ's buffers) or a receive straight
into the reserved pages (:meth:`Placer.slot` before the reply, :meth:`Placer.settle` after it,
the peer stream's path), then one ``settle_store`` of the keys written: they become READY, the
rest of the reservation is rolled back (:meth:`Placer.complete`), and the BlockStored events
go out on the normal path (``publish``), which also announces the chunks in the fleet index.
Over the stream a window whose every key is reserved has its leading keys made ready as soon
as they have arrived, while the rest is still on the wire (:meth:`Placer.complete_early`:
``complete_store`` of those keys), so that only the rest is settled after the last byte.
A chunk DRAM cannot take (every page pinned or reserved) is returned to the caller when it
asked for ``direct`` parts (a remote ``get`` sends them on), else dropped.

Invariant: a key becomes READY only once every part of it has arrived whole; a reservation is
always settled (the keys written made ready, the rest given back), on every path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from kvserver.daemon.owners import FETCH_CLIENT as FETCH_CLIENT
from kvserver.daemon.peers.book import PeerBook
from kvserver.engine import StorageEngine
from kvserver.errors import KVServerError
from kvserver.grants import StoreGrant
from kvserver.namespace import NamespaceSpec

logger = logging.getLogger(__name__)


Parts = dict[bytes, list[memoryview]]


@dataclass(slots=True)
class Slot:
    """A stream window reserved ahead of its reply: its keys, their grant (None: DRAM took
    none), where each reserved key's pages are, per key the views to receive into (pages, or
    the buffers of ``own``), the parts of the keys DRAM did not take, how many leading keys
    were made ready before the rest arrived (:meth:`Placer.complete_early`), and whether it
    is settled."""

    keys: list[bytes]
    grant: StoreGrant | None
    where: dict[bytes, Any]
    rows: list[list[memoryview]]
    own: Parts
    early: int = 0
    settled: bool = False

    @property
    def can_complete_early(self) -> bool:
        """Every key reserved (DRAM took the whole window): its leading keys can be made
        ready while the rest is received."""
        return self.grant is not None and not self.own and len(self.grant.keys) == len(self.keys)


class Placer:
    """Places fetched chunks in one daemon's DRAM; see the module docstring."""

    def __init__(self, engine: StorageEngine, book: PeerBook, publish: Callable[[], None]) -> None:
        self._engine = engine
        self._book = book
        self._publish = publish

    def slot(self, spec: NamespaceSpec, keys: list[bytes], protect: AbstractSet[bytes]) -> Slot:
        """Reserve DRAM for a window's ``keys`` before its reply comes; per key, the views
        its parts are to be received into: its reserved pages, or buffers of its own when
        DRAM cannot take it."""
        grant = self.reserve(spec, keys, protect)
        where = dict(zip(grant.keys, grant.locations, strict=True)) if grant is not None else {}
        arena, tp, size = self._engine.arena, spec.tp_world_size, spec.part_bytes
        if tp == 1 and grant is not None and grant.keys == keys:  # usually: every key reserved
            return Slot(keys, grant, where, arena.views_of([e[0] for e in grant.locations]), {})
        rows: list[list[memoryview]] = []
        own: Parts = {}
        for key in keys:
            extents = where.get(key)
            if extents is not None:
                rows.append([v for part in arena.views_of(extents) for v in part])
            else:
                own[key] = [memoryview(bytearray(size)) for _ in range(tp)]
                rows.append(own[key])
        return Slot(keys, grant, where, rows, own)

    def complete_early(self, slot: Slot, count: int) -> None:
        """The first ``count`` chunks of a window whose every key is reserved arrived whole,
        the rest is still being received: make them ready now (``complete_store`` of those
        keys, the lease kept for the rest), publish. Nothing once the slot is settled (the
        receive was given up meanwhile) or when its lease is gone."""
        grant = slot.grant
        if slot.settled or slot.early or grant is None or not 0 < count < len(slot.keys):
            return
        done = slot.keys[:count]
        try:
            placed = self._engine.complete_store(grant.lease_id, keys=done)
        except KVServerError:  # the lease expired meanwhile: settle finds it gone too
            return
        slot.early = count
        self._book.counters.placed_chunks += len(placed)
        self._publish()

    def settle(
        self, spec: NamespaceSpec, slot: Slot, count: int, direct: bool
    ) -> tuple[list[bytes], Parts]:
        """A window's first ``count`` chunks arrived whole: make those reserved ready, give
        the rest back; returns (keys it sent, direct parts). The keys made ready early count
        as sent (``count`` is at least ``slot.early``: a reply cut short after them lost only
        the rest)."""
        count = max(count, slot.early)
        sent = slot.keys[:count]
        slot.rows.clear()  # the arena's views go before the pages can
        slot.settled = True
        grant = slot.grant
        whole = grant is not None and not slot.own  # every key reserved: each sent one written
        if slot.early:  # the lease holds the rest only
            self.complete(grant, sent[slot.early :])
            return sent, {}  # every key was reserved: nothing direct
        self.complete(grant, sent if whole else [k for k in sent if k in slot.where])
        if not direct:
            return sent, {}
        ns_id, engine = spec.ns_id, self._engine
        own = slot.own
        return sent, {k: own[k] for k in sent if k in own and not engine.contains(ns_id, k)}

    def reserve(
        self, spec: NamespaceSpec, keys: list[bytes], protect: AbstractSet[bytes]
    ) -> StoreGrant | None:
        """Reserve DRAM for fetched ``keys`` as a promotion does, protecting from the eviction
        the keys of ``protect`` (the request's keys, the fetch's windows placed before: one set
        the fetch grows, handed to the engine as is, so a window's placement costs its own
        keys, not the fetch's so far); None when DRAM cannot take them."""
        if not keys:
            return None
        engine = self._engine
        try:
            return engine.prepare_store(spec.ns_id, keys, client=FETCH_CLIENT, gated=False,
                                        lease_s=engine.config.max_lease_s,
                                        protect=protect)  # fmt: skip
        except KVServerError as exc:  # e.g. more than the whole tier
            logger.warning("network tier: cannot place fetched chunks: %s", exc)
            return None

    def complete(self, grant: StoreGrant | None, written: list[bytes]) -> None:
        """Make the ``written`` keys of ``grant`` ready, roll back the rest (one
        ``settle_store``), publish."""
        if grant is not None and grant.keys:
            with contextlib.suppress(KVServerError):  # the lease expired meanwhile
                placed = self._engine.settle_store(grant.lease_id, written)
                self._book.counters.placed_chunks += len(placed)
        self._publish()

    def place(
        self,
        spec: NamespaceSpec,
        keys: list[bytes],
        rows: list[list[memoryview]],
        protect: AbstractSet[bytes],
        direct: bool,
    ) -> Parts:
        """Write fetched ``rows`` into DRAM (synchronously: nothing else runs meanwhile);
        returns the rows DRAM did not take when ``direct``."""
        if not keys:
            return {}
        engine, ns_id = self._engine, spec.ns_id
        grant = self.reserve(spec, keys, protect)
        reserved = set(grant.keys) if grant is not None else set()
        out: Parts = {}
        written: list[bytes] = []
        try:
            for key, row in zip(keys, rows, strict=True):
                if grant is not None and key in reserved:
                    for rank, part in enumerate(row):
                        engine.write_part(grant.lease_id, key, rank, part)
                    written.append(key)
                elif direct and not engine.contains(ns_id, key):
                    out[key] = row
        finally:
            self.complete(grant, written)
        return out
