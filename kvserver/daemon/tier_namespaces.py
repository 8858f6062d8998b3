"""The namespace specs the SSD tier keeps in its directory, and which of them are saved.

Runs on the daemon's event loop, owned by :class:`~kvserver.daemon.tiering.SsdTier`; the save
itself (``SlotStore.save_namespaces``: ``namespaces.json``, replaced atomically) runs on the
tier's threads. Not thread-safe: loop only.

Why: a chunk of a namespace is written down only once the namespace's spec is durable, so a
restarted daemon can re-register it and serve the same keys (``rebuild.py``).

Call order: :meth:`SavedNamespaces.restore` when the tier opens (the specs found in the
directory) → :meth:`SavedNamespaces.save` whenever the engine's namespaces may have changed
(``SsdTier.namespaces_changed``, its retry task, a write-back offered for a namespace not yet
durable). One save at a time; a change during a save is saved right after it; a failed save is
told to the tier's health and retried by the tier (the retry task, or the next write-back).

Invariant: ``durable`` ⊆ the specs written (every spec ever written stays in the file: a
namespace's spec, once saved, is never removed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from typing import Any

from kvserver.daemon.tier_health import TierHealth
from kvserver.daemon.writeback import Tracker
from kvserver.engine import StorageEngine
from kvserver.ssd.store import SlotStore


class SavedNamespaces:
    """The SSD tier's namespace specs on disk; see the module docstring."""

    def __init__(
        self,
        *,
        engine: StorageEngine,
        store: SlotStore,
        threads: Executor,
        health: TierHealth,
        track: Tracker,
        is_open: Callable[[], bool],
    ) -> None:
        self._engine = engine
        self._store = store
        self._threads = threads
        self._health = health
        self._track = track
        self._is_open = is_open
        self._specs: dict[str, dict[str, Any]] = {}  # namespace specs in the directory
        self.durable: set[str] = set()  # ns_ids whose spec is on disk
        self._saving = False

    def restore(self, specs: dict[str, dict[str, Any]]) -> None:
        """Take the specs found in the directory (``rebuild``'s ``saved``) as durable."""
        self._specs.update(specs)
        self.durable = set(self._specs)

    def unsaved(self) -> bool:
        """True if some namespace registered with the engine is not durable yet."""
        return not set(self._engine.namespaces) <= self.durable

    @property
    def num_unsaved(self) -> int:
        """Namespaces registered with the engine and not durable yet."""
        return len(set(self._engine.namespaces) - self.durable)

    def save(self) -> None:
        """Save the namespace specs with the data (off the loop) if some are not saved yet.
        Chunks of a namespace are written down only once its spec is durable. One save at a
        time; a change during a save is saved right after it. Nothing while the tier is not
        open."""
        if not self._is_open() or self._saving or not self.unsaved():
            return
        for ns_id, spec in self._engine.namespaces.items():
            self._specs.setdefault(ns_id, spec.to_dict())
        specs = dict(self._specs)
        self._saving = True
        fut = asyncio.get_running_loop().run_in_executor(
            self._threads, self._store.save_namespaces, list(specs.values())
        )
        self._track(fut, partial(self._saved, set(specs)))

    def _saved(self, ns_ids: set[str], fut: asyncio.Future[Any]) -> None:
        self._saving = False
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self._health.failed_write(exc)  # retried by the retry task, or by the next write-back
            return
        self.durable |= ns_ids
        self.save()
