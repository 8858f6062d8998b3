"""The ordered stack of tiers below DRAM, composed for the service: one owner of the list.

Runs on the daemon's event loop, owned by :class:`~kvserver.daemon.service.KVService` (its only
caller). Not thread-safe: loop only. What each tier promises is in ``tiers.py``; this module
applies those promises to the stack as a whole:

- ``add`` puts a tier below the others (a unique name) and offers every DRAM eviction to each
  tier in order (``engine.on_evict``); ``open`` opens them fastest first, ``close`` stops the
  offers and closes them slowest first;
- ``lookup`` continues the engine's leading DRAM run key by key (a key counts for DRAM if the
  engine holds it READY, else for the first tier whose ``holds`` is True); a tier answering
  None makes the result a :class:`~kvserver.daemon.results.Pending` that asks every tier's
  ``query`` for the rest at once; each tier then gets ``record_lookup``;
- ``needs_promotion`` / ``promote`` ask the tiers in order for the keys not yet served;
- ``select(local=True)`` leaves out the tiers of other hosts (``Tier.local`` False): a peer's
  request never reaches them.

Invariant: tier names are unique and never ``dram``; ``engine.on_evict`` offers to exactly the
tiers of the stack, in order, between ``add`` and ``close``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvserver.daemon.results import LookupHits, Pending
from kvserver.daemon.tiers import DirectParts, Tier
from kvserver.engine import StorageEngine
from kvserver.engine.types import Entry
from kvserver.namespace import NamespaceSpec


class TierStack:
    """The tiers below one engine, fastest first; see the module docstring."""

    def __init__(self, engine: StorageEngine) -> None:
        self._engine = engine
        #: the tiers, fastest first.
        self.tiers: list[Tier] = []

    # ------------------------------------------------------------------ composition

    def add(self, tier: Tier) -> None:
        """Put ``tier`` below the tiers already added. REQUIRES: a unique name."""
        if tier.name == "dram" or any(t.name == tier.name for t in self.tiers):
            raise ValueError(f"a tier named {tier.name!r} is already in the stack")
        self.tiers.append(tier)
        offers = [t.on_evict for t in self.tiers]
        if len(offers) == 1:
            self._engine.on_evict = offers[0]
        else:

            def on_evict(spec: NamespaceSpec, victims: list[Entry]) -> None:
                for offer in offers:
                    offer(spec, victims)

            self._engine.on_evict = on_evict

    async def open(self) -> None:
        """Open the tiers, fastest first (a tier never raises for an I/O problem)."""
        for tier in self.tiers:
            await tier.open()

    async def close(self) -> None:
        """Stop offering evictions, then close the tiers, slowest first."""
        self._engine.on_evict = None
        for tier in reversed(self.tiers):
            await tier.close()

    def select(self, local: bool) -> list[Tier]:
        """The tiers to consult: all, or (``local``) this host's own only."""
        return [t for t in self.tiers if t.local] if local else self.tiers

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        hits: int,
        chunk_tokens: int,
        *,
        touch: bool,
        local: bool,
    ) -> LookupHits | Pending[LookupHits]:
        """Continue a lookup whose first ``hits`` keys are READY in DRAM (``touch``/ ``local``
        as ``KVService.lookup``)."""
        tiers = self.select(local)
        if not tiers:
            return LookupHits(ns_id, hits, hits * chunk_tokens, len(keys), {"dram": hits})
        found = self._walk(ns_id, keys, hits, tiers, None)
        if found is None:
            return Pending(lambda: self._lookup_io(ns_id, keys, hits, tiers, touch, chunk_tokens))
        return self._result(ns_id, keys, hits, tiers, found, touch, chunk_tokens)

    async def _lookup_io(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        hits: int,
        tiers: list[Tier],
        touch: bool,
        chunk_tokens: int,
    ) -> LookupHits:
        rest = keys[hits:]
        masks = await asyncio.gather(*(tier.query(ns_id, rest) for tier in tiers))
        found = self._walk(ns_id, keys, hits, tiers, masks)
        assert found is not None  # masks answer every key
        return self._result(ns_id, keys, hits, tiers, found, touch, chunk_tokens)

    def _walk(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        hits: int,
        tiers: list[Tier],
        masks: Sequence[Sequence[bool]] | None,
    ) -> list[int] | None:
        """Continue the run after the ``hits`` leading DRAM keys: for each key of the run, the
        index of the tier holding it (-1: DRAM); None if a tier needs I/O (``masks`` absent).
        ``masks[t][i]``: whether tier ``t`` holds ``keys[hits + i]``."""
        absent = set(self._engine.missing(ns_id, keys[hits:]))
        found: list[int] = []
        for i in range(len(keys) - hits):
            key = keys[hits + i]
            if key not in absent:
                found.append(-1)
                continue
            for t, tier in enumerate(tiers):
                held = masks[t][i] if masks is not None else tier.holds(ns_id, key)
                if held is None:
                    return None
                if held:
                    found.append(t)
                    break
            else:
                break
        return found

    def _result(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        hits: int,
        tiers: list[Tier],
        found: list[int],
        touch: bool,
        chunk_tokens: int,
    ) -> LookupHits:
        total = hits + len(found)
        misses = len(keys) - total
        counts = {"dram": hits + found.count(-1)}
        for t, tier in enumerate(tiers):
            mine = [keys[hits + i] for i, owner in enumerate(found) if owner == t]
            counts[tier.name] = len(mine)
            tier.record_lookup(ns_id, mine, misses, touch=touch)
        if touch and counts["dram"] > hits:
            self._engine.touch(ns_id, keys[:total])
        return LookupHits(ns_id, total, total * chunk_tokens, len(keys), counts)

    # ------------------------------------------------------------------ promotion

    def needs_promotion(self, ns_id: str, keys: Sequence[bytes], *, local: bool) -> bool:
        return any(tier.needs_promotion(ns_id, keys) for tier in self.select(local))

    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool, local: bool
    ) -> DirectParts:
        """Ask each tier in order to promote the keys not yet served; the direct parts."""
        out: DirectParts = {}
        for tier in self.select(local):
            rest = [k for k in keys if k not in out] if out else keys
            if tier.needs_promotion(ns_id, rest):
                out.update(await tier.promote(ns_id, rest, direct=direct))
        return out

    # ------------------------------------------------------------------ namespaces, stats

    def namespaces_changed(self) -> None:
        for tier in self.tiers:
            tier.namespaces_changed()

    def held_keys(self) -> dict[tuple[str, str], list[bytes]]:
        """READY keys per (namespace id, tier name) of every tier."""
        out: dict[tuple[str, str], list[bytes]] = {}
        for tier in self.tiers:
            out.update({(ns, tier.name): keys for ns, keys in tier.held_keys().items()})
        return out

    def stats(self) -> list[tuple[Tier, dict[str, Any]]]:
        """Each tier with its ``stats()``, fastest first."""
        return [(tier, tier.stats()) for tier in self.tiers]
