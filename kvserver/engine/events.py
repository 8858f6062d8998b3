"""The storage engine's event sequence: BlockStored / BlockRemoved of every tier, numbered in one
gap-free sequence (stored and evicted chunks counted as they are announced), and the eviction
hook of the lower tiers.

Runs inside the daemon, on its event loop, owned by :class:`~kvserver.engine.StorageEngine`
(used only from there; no locks). Contract:

- sequence numbers start at 1 and grow by one per event, whatever the tier (``announce``
  numbers another tier's events in the same sequence);
- :meth:`EngineEvents.evicted` hands the victims to ``on_evict`` (one call per namespace)
  *before* it announces them: the victims' pages still hold their bytes then, and the
  engine frees or reuses them only after this call returns. A hook that raises is logged
  and ignored; the eviction completes regardless;
- :meth:`EngineEvents.take` drains the events in sequence order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvserver.engine.namespaces import NamespaceTable
from kvserver.engine.stats import EngineCounters
from kvserver.engine.types import Entry
from kvserver.events import MEDIUM_DRAM, BlockRemoved, BlockStored, Event, Medium
from kvserver.namespace import NamespaceSpec

__all__ = ["EngineEvents", "EvictHook"]

logger = logging.getLogger(__name__)

#: ``on_evict(spec, entries)``: see :attr:`kvserver.engine.StorageEngine.on_evict`.
EvictHook = Callable[[NamespaceSpec, list[Entry]], None]


class EngineEvents:
    """The engine's events and their counters; see the module docstring."""

    def __init__(self, namespaces: NamespaceTable, counters: EngineCounters) -> None:
        self._namespaces = namespaces
        self._counters = counters
        self._ns_ids = namespaces.ns_ids  # appended to as namespaces register
        self._events: list[Event] = []
        self._next_seq = 1
        self.on_evict: EvictHook | None = None

    def take(self) -> list[Event]:
        """Drain the events emitted since the last call, in sequence order."""
        events, self._events = self._events, []
        return events

    def announce(self, ns_id: str, keys: Sequence[bytes], medium: Medium, *, stored: bool) -> None:
        """One BlockStored (``stored``) or BlockRemoved of another tier's ``keys`` (not empty;
        ``ns_id`` already checked by the caller)."""
        cls = BlockStored if stored else BlockRemoved
        self._events.append(cls(self._seq(), ns_id, tuple(keys), medium))

    def stored(self, ns: int, keys: list[bytes]) -> None:
        """Announce keys of namespace index ``ns`` that became READY in DRAM (one
        BlockStored) and count them."""
        self._events.append(BlockStored(self._seq(), self._ns_ids[ns], tuple(keys), MEDIUM_DRAM))
        self._counters.stored(ns, len(keys))

    def evicted(self, evicted: list[Entry]) -> None:
        """Hand evicted entries (already out of the index, pages not yet reused) to
        ``on_evict``, announce them (one BlockRemoved per namespace), count them."""
        if len({entry.ns for entry in evicted}) == 1:  # usually: no list per namespace
            by_ns = {evicted[0].ns: evicted}
        else:
            by_ns = {}
            for entry in evicted:
                by_ns.setdefault(entry.ns, []).append(entry)
        specs = self._namespaces.specs
        if self.on_evict is not None:
            for ns, entries in by_ns.items():
                try:
                    self.on_evict(specs[ns], entries)
                except Exception:  # a lower tier's failure must not break this tier
                    logger.exception("on_evict hook failed")
        for ns, entries in by_ns.items():
            keys = tuple([entry.key for entry in entries])
            self._events.append(BlockRemoved(self._seq(), self._ns_ids[ns], keys, MEDIUM_DRAM))
            self._counters.evicted(ns, len(keys))

    def _seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq
