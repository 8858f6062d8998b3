"""The storage engine: the DRAM tier's index, arena, eviction, leases, reuse gating and events.

Runs inside the daemon, on its one event loop, and as a plain library (tests, benchmarks); no
sockets, no threads, no locks. :class:`StorageEngine` is the one entry (its contract: ``core``);
the other modules are its mechanics, one concept each, which code outside the package never
calls (it imports the value types of ``types``):

- ``core``: :class:`StorageEngine`, the facade (validation, the public calls, the invariants)
- ``stores``: ``StorePath``, the store path (``prepare_store`` / ``complete_store`` /
  ``settle_store``: reuse gating, eviction, admission), exposed as the engine's calls
- ``index``: ``DramIndex``, the entries, their pages, the eviction policy, the page accounting
- ``pins``: ``PinnedPages`` (the index's), what keeps an entry from eviction (load pins, TTL
  pins, an expired load's hold) and the pages that counts
- ``leases``: ``LeaseBook``, who holds what: leases, load pins, TTL pins, quarantines
- ``namespaces``: ``NamespaceTable``, registered specs, their ids, key validation
- ``events``: ``EngineEvents``, the one gap-free event sequence and the eviction hook
- ``stats``: ``EngineCounters`` and the ``stats()`` snapshot
- ``parts``: ``PartCopies``, the payload path of clients that cannot map the arena
- ``types``: the value types (``EngineConfig``, ``Entry``, ``CutKeys``, ``HashedKeys`` ...)

Imports go one way: this package imports ``core``, ``core`` imports the others, and none of
them imports the package or ``core``. ``core`` is imported when ``StorageEngine`` is first
asked for, not with the package: the value types are imported by processes that never run an
engine (the gRPC client's ``CutKeys``: ``kvserver/grpc_format.py``), and importing
``kvserver.engine.types`` runs this file first; it loads no policy, arena or lease code there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserver.engine.core import IndexKey, StorageEngine

__all__ = ["IndexKey", "StorageEngine"]


def __getattr__(name: str) -> Any:
    """``from kvserver.engine import StorageEngine``: ``core``'s names, imported on first use."""
    if name in __all__:
        from kvserver.engine import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
