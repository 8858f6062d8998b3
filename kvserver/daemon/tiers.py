"""The tier seam: what every tier below DRAM implements, and how the service stacks them.

Runs in the daemon process, on its one event loop (not thread-safe: loop only). The DRAM tier is
the storage engine (:class:`~kvserver.engine.StorageEngine`); below it
:class:`~kvserver.daemon.service.KVService` holds an ORDERED list of :class:`Tier` objects,
fastest first (``[SsdTier, PeerTier]`` with both configured), in a
:class:`~kvserver.daemon.tier_stack.TierStack`. The service (through the stack) is the only
caller of these methods; the front ends never see a tier.

Call order (the service drives it)::

    tier = MyTier(service.engine, ..., publish=service.publish)   # build; no I/O yet
    service.add_tier(tier)         # below the tiers added before; evictions offered to it
    await service.open_tiers()     # → tier.open()   (never raises for an I/O problem)
    ... serving: holds / query / record_lookup, needs_promotion / promote, on_evict,
        namespaces_changed, stats ...
    await service.close_tiers()    # → tier.close()  (reverse order)

How the service uses a tier (the contracts a new tier must keep):

- **Lookup** (:meth:`KVService.lookup`): the engine reports its leading DRAM run; the service
  continues the run key by key: a key counts for DRAM if the engine holds it READY, else for
  the first tier (in stack order) whose :meth:`Tier.holds` is True; the run ends at the first
  key no tier holds. ``holds`` is synchronous and must be cheap (a dict lookup: the Lookup p99
  target). A tier that cannot answer without I/O (a Redis query, a peer daemon) returns
  ``None``: the service then finishes the lookup asynchronously — it awaits
  :meth:`Tier.query` of every tier for the rest of the keys (concurrently, one call each) and
  walks those answers instead. The ZMQ front end runs that as a ``zmq_ops.Deferred`` (its
  connection keeps its order, others are served meanwhile); gRPC handlers simply await it.
  After every lookup each tier gets :meth:`Tier.record_lookup` with the keys it contributed
  (for its counters, and its own recency when ``touch``).
- **Promotion** (read into DRAM before a load): :meth:`Tier.needs_promotion` (synchronous,
  cheap; True when unsure) decides whether a ``prepare_load``/``get`` must first await
  :meth:`KVService.promote`, which calls :meth:`Tier.promote` of each tier in order with the
  keys not yet served. ``promote`` reserves DRAM with ``engine.prepare_store(..., gated=False)``,
  copies the bytes in with ``write_part`` and completes the store (so the load then finds them
  in DRAM); with ``direct=True`` (a remote ``get``) keys that DRAM cannot take are returned as
  ``{key: [part per rank]}`` for the front end to send as they are. It never raises for an I/O
  problem: what it could not bring is simply a miss for the load.
- **Write-down** (:meth:`Tier.on_evict`): the engine's eviction hook, synchronous, called with
  the victims of one eviction while their pages still hold their bytes; each tier of the stack
  is offered every victim, in order, and copies what it wants (a network tier may decline all).
  It must never call back into the engine.
- **Namespaces**: :meth:`Tier.namespaces_changed` after every registration (the SSD tier saves
  the specs with its data; a network tier may advertise them).
- **Condition and stats**: :attr:`Tier.condition` (``ok`` / ``degraded`` / ``unavailable``) and
  :meth:`Tier.stats`, a dict that the service puts under the tier's :attr:`Tier.name` in
  ``stats()`` (the ZMQ ``stats`` reply) and the gRPC front end turns into a ``TierStats``: it
  takes the keys named like ``TierStats`` fields (``policy``, ``capacity_bytes``, ``used_bytes``,
  ``entries``, ``hit_chunks``, ``condition``, ``condition_detail`` ...) and the per-namespace
  usage ``namespaces: {ns_id: (entries, bytes)}``.
- **Events**: a tier announces its own stored/removed keys with
  ``engine.announce(ns_id, keys, tier.medium, stored=...)`` (one gap-free sequence for all
  tiers) and then calls the ``publish`` callback it was given (``KVService.publish``).
- **Names**: :attr:`Tier.name` is the key in lookup replies (``{"dram": n, "ssd": m,
  "peer": k}``), in ``stats()`` and the gRPC tier lists; unique in a stack.

To plug in a new tier: subclass :class:`Tier`, give it a ``name`` and ``medium``, implement
the abstract methods (``holds``, ``needs_promotion``, ``promote``, ``on_evict``, ``stats``,
``open``, ``close``), override ``query`` if ``holds`` can return ``None``, and build it in
``kvserver/daemon/process.py`` next to the SSD tier. Nothing in the service or the front ends
changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from kvserver.engine.types import Entry
from kvserver.events import Medium
from kvserver.namespace import NamespaceSpec

#: conditions of a tier
OK, DEGRADED, UNAVAILABLE = "ok", "degraded", "unavailable"

#: parts of chunks a tier read but DRAM could not take: key → one view per rank.
DirectParts = dict[bytes, list[memoryview]]


class Tier(ABC):
    """One tier below DRAM; see the module docstring for the contracts. Loop only."""

    #: unique in a stack: the key in lookup replies, stats and gRPC tier lists.
    name: ClassVar[str]
    #: the medium of this tier's events.
    medium: ClassVar[Medium]
    #: False for a tier that reaches other hosts: a peer's request (``lookup`` with
    #: ``local``, ``get`` with ``leading``) consults this host's own tiers only.
    local: ClassVar[bool] = True

    @property
    @abstractmethod
    def condition(self) -> str:
        """``ok``, ``degraded`` or ``unavailable`` (also in :meth:`stats`)."""

    # ------------------------------------------------------------------ lifetime

    @abstractmethod
    async def open(self) -> None:
        """Start serving (or go ``unavailable`` and keep retrying); never raises for I/O."""

    @abstractmethod
    async def close(self) -> None:
        """Finish or drop the work in flight (bounded time), release every resource."""

    async def wait_idle(self) -> None:
        """Return once no I/O of this tier is in flight (tests, benchmarks)."""
        return

    # ------------------------------------------------------------------ lookup

    @abstractmethod
    def holds(self, ns_id: str, key: bytes) -> bool | None:
        """True if ``key`` is READY here (a load could promote it), False if not, None if
        that cannot be told without I/O (the lookup then goes through :meth:`query`).
        Synchronous and cheap; no side effects."""

    async def query(self, ns_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is READY here (one answer per key, in order); the I/O
        path of :meth:`holds`. The default asks :meth:`holds`."""
        holds = self.holds
        return [holds(ns_id, key) is True for key in keys]

    def record_lookup(self, ns_id: str, hits: Sequence[bytes], misses: int, *, touch: bool) -> None:
        """After every lookup: ``hits`` are the keys of the run credited to this tier,
        ``misses`` the keys after the run (found in no tier). ``touch``: refresh ``hits`` in
        this tier's own eviction order. The default does nothing."""
        return

    # ------------------------------------------------------------------ promotion

    @abstractmethod
    def needs_promotion(self, ns_id: str, keys: Sequence[bytes]) -> bool:
        """True if some of ``keys`` are here (or being promoted) and not in DRAM, i.e. a load
        must first await :meth:`promote`. Synchronous and cheap; True when unsure."""

    @abstractmethod
    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False
    ) -> DirectParts:
        """Bring the keys of ``keys`` that are here but not in DRAM into DRAM (the others of
        ``keys`` are in DRAM or nowhere; keep the DRAM ones from being evicted for this).
        Returns, when ``direct``, the parts of keys DRAM could not take; else {}. Never raises
        for an I/O problem (a key it could not bring is a miss); raises ``KVServerError`` for
        bad input with nothing changed."""

    # ------------------------------------------------------------------ write-down

    @abstractmethod
    def on_evict(self, spec: NamespaceSpec, victims: list[Entry]) -> None:
        """The victims of one DRAM eviction, while their pages still hold their bytes:
        copy what this tier keeps (or nothing). Synchronous; never calls the engine."""

    def held_keys(self) -> dict[str, list[bytes]]:
        """The keys READY here per namespace (the fleet index's resync). The default: none
        (a tier that only reaches other hosts holds nothing of its own)."""
        return {}

    # ------------------------------------------------------------------ namespaces, stats

    def namespaces_changed(self) -> None:
        """A namespace was registered (see ``engine.namespaces``). The default does nothing."""
        return

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """This tier's condition, usage and counters (module docstring: which keys)."""
