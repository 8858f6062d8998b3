"""The SSD tier inside the daemon: write-back of DRAM evictions, promotion on load, rebuild.

A :class:`~kvserver.daemon.tiers.Tier` (the seam and its contracts: ``tiers.py``), named
``ssd``, medium ``STORAGE``.

Runs on the daemon's one event loop. Every disk operation runs on the tier's own thread pool
(``io_threads``) through :class:`~kvserver.ssd.store.SlotStore`; the loop only keeps the books
(:class:`~kvserver.ssd.index.SsdIndex`), copies evicted bytes into the staging area and copies
verified promoted bytes into the arena. Not thread-safe: loop only.

Call order: ``SsdTier(engine, config, publish=...)`` → ``await open()`` (lock the directory,
scan headers, restore the index and re-register the saved namespaces (``rebuild.py``), cut
data files after their last live slot; on failure the tier is ``unavailable`` and retried
every ``retry_s``) → ``engine.on_evict = tier.on_evict`` (done by ``KVService.add_tier``) →
serving → ``await close()`` (drain writes, stop the threads, close the files).

Write-back (``on_evict``, synchronous, called by the engine before the victim's pages are
freed; ``writeback.py``): a victim used at least ``admission`` times, of a namespace already
saved in the directory, not yet on SSD, gets a staging buffer and an SSD slot (evicting SSD
victims by the tier's own policy); its parts are copied into the buffer and the writes (slots,
then headers) run on a thread, several chunks per job (``tier_jobs.py``). Whatever does not fit
(staging full, SSD full of chunks being read, tier degraded) is simply dropped and counted. On
completion the entry becomes READY (BlockStored, medium STORAGE); on failure its slot is
discarded and the tier turns ``degraded``.

Promotion (``promote``, awaited by the ZMQ front end before a load, in a task of its own;
``promotion.py``): reserve DRAM for the keys that are READY on SSD but not in DRAM, read and
verify their slots on threads (``tier_reads.SlotReads``; the reads of one loop turn go
together, ``tier_jobs.ReadQueue``), copy them into the arena and complete the store. Several
run at once (at most ``max_promotions`` reading); a key is promoted by one of them at a time,
the others wait for it. A chunk that fails verification is dropped from the index (counted, slot
discarded, BlockRemoved STORAGE) and is a miss. When DRAM cannot take the chunks and the caller
asked for ``direct``, the verified bytes are returned for it to send (remote ``get``).

Conditions (``tier_health.TierHealth``): ``ok``; ``degraded`` (a write failed: ENOSPC, EIO,
EACCES ...; write-backs are skipped, DRAM and SSD reads keep serving, and one write is let
through every ``retry_s`` — the first success returns to ``ok``); ``unavailable`` (the
directory could not be opened; retried every ``retry_s``). Transitions are logged once each
and shown in ``stats()``.

Who owns what: the tier owns the slot store, the SSD index, the staging and read pools, the
threads, the counters and the health; it hands :class:`~kvserver.daemon.writeback.WriteBack`,
:class:`~kvserver.daemon.tier_reads.SlotReads` (a slot read and verified, and a failed read's
drop) and :class:`~kvserver.daemon.promotion.Promotions` the ones each uses. The namespace
specs in the directory, and which are durable, are
:class:`~kvserver.daemon.tier_namespaces.SavedNamespaces`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, TypeVar

from kvserver.daemon.promotion import DEFAULT_PROMOTIONS, Promotions
from kvserver.daemon.rebuild import compact, rebuild
from kvserver.daemon.tier_health import TierHealth
from kvserver.daemon.tier_namespaces import SavedNamespaces
from kvserver.daemon.tier_reads import SlotReads
from kvserver.daemon.tiers import OK, UNAVAILABLE, DirectParts, Tier
from kvserver.daemon.writeback import WriteBack
from kvserver.engine import StorageEngine
from kvserver.engine.types import Entry
from kvserver.errors import StorageError
from kvserver.events import MEDIUM_SSD
from kvserver.namespace import NamespaceSpec
from kvserver.ssd.buffers import BufferPool
from kvserver.ssd.config import TierConfig, TierCounters
from kvserver.ssd.fileio import FileIO
from kvserver.ssd.index import SsdEntry, SsdIndex
from kvserver.ssd.scan import ScanResult
from kvserver.ssd.slots import slack_bytes_for
from kvserver.ssd.store import SlotStore

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SsdTier(Tier):
    """The SSD tier of one daemon; see the module docstring."""

    name = "ssd"
    medium = MEDIUM_SSD

    def __init__(
        self,
        engine: StorageEngine,
        config: TierConfig,
        *,
        publish: Callable[[], None] = lambda: None,
        fileio: FileIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_promotions: int = DEFAULT_PROMOTIONS,
    ) -> None:
        if max_promotions < 1:
            raise ValueError("at least one promotion must be allowed")
        self.engine = engine
        self.config = config
        self.store = SlotStore(
            config.directory,
            fileio=fileio,
            direct=config.direct,
            allocate_step=slack_bytes_for(config.capacity_bytes),
        )
        self.index = SsdIndex(config.capacity_bytes, config.policy)
        self.staging = BufferPool(config.staging_bytes)
        self.reads = BufferPool(config.staging_bytes)
        self.counters = TierCounters()
        self.health = TierHealth("SSD tier", config.retry_s, self.counters, clock)
        self.rebuild_s = 0.0
        self._publish = publish
        self.threads = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvserver-ssd")
        self.opened = False
        #: disk jobs still unfinished when ``close`` gave up waiting (``drain_timeout_s``)
        self.abandoned_jobs = 0
        self._inflight: set[asyncio.Future[Any]] = set()
        self._events: list[tuple[str, bool, bytes]] = []
        self._retry_task: asyncio.Task[None] | None = None
        #: the namespace specs in the directory, and which are durable
        self.saved = SavedNamespaces(
            engine=engine,
            store=self.store,
            threads=self.threads,
            health=self.health,
            track=self.track,
            is_open=lambda: self.opened,
        )
        self.writeback = WriteBack(
            index=self.index,
            staging=self.staging,
            store=self.store,
            threads=self.threads,
            counters=self.counters,
            health=self.health,
            views=engine.arena.views,
            admission=config.admission,
            event=self.event,
            track=self.track,
        )
        self.slot_reads = SlotReads(
            store=self.store,
            threads=self.threads,
            num_threads=config.io_threads,
            index=self.index,
            reads=self.reads,
            counters=self.counters,
            event=self.event,
            discard=self.writeback.discard,
            track=self._inflight_add,
        )
        self.promotions = Promotions(
            engine=engine,
            index=self.index,
            reads=self.reads,
            counters=self.counters,
            read=self.slot_reads.read,
            unpin=self.unpin,
            flush_events=self.flush_events,
            track=self.track,
            window_bytes=config.staging_bytes,
            serve_limit=config.staging_bytes,
            limit=max_promotions,
        )

    # ================================================================== lifetime

    async def open(self) -> None:
        """Open and rebuild (or go ``unavailable`` and keep retrying); never raises for a
        disk problem."""
        await self._try_open()
        self._retry_task = asyncio.get_running_loop().create_task(self._retry_forever())

    async def close(self) -> None:
        """Drain in-flight I/O (at most ``drain_timeout_s``), stop the threads, close files.
        REQUIRES: the engine no longer offers evictions (``KVService.close_tiers``).

        Disk jobs not finished by then are abandoned: those not started are cancelled, those
        running (a hung disk) are not waited for; ``abandoned_jobs`` says how many, and the
        files stay open for them (closing them under a running job could let its next write
        land in whatever file reuses the descriptor). What they leave unwritten is simply not
        on SSD: a slot is valid only once its header, written after its payload, checks out
        (docs/ssd_format.md), so the next start's rebuild never accepts a half-written one.
        The daemon then exits without joining the threads (``process.main``)."""
        if self._retry_task is not None:
            self._retry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry_task
        if self._inflight:
            _, pending = await asyncio.wait(self._inflight, timeout=self.config.drain_timeout_s)
            if pending:
                self.abandoned_jobs = len(pending)
                logger.warning(
                    "SSD tier: %d disk operations not finished after the drain timeout "
                    "(%.1f s): abandoned (what they had not written is not on SSD)",
                    len(pending), self.config.drain_timeout_s,
                )  # fmt: skip
        self.flush_events()
        if self.abandoned_jobs:
            self.threads.shutdown(wait=False, cancel_futures=True)
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.threads.shutdown, True)
            self.store.close()
        if self.opened:
            logger.info(
                "SSD tier closed: %d chunks (%d MiB) in %s",
                len(self.index),
                self.index.used_bytes >> 20,
                self.store.directory,
            )
        self.staging.clear()
        self.reads.clear()
        self.opened = False  # evictions offered from now on are skipped

    async def wait_idle(self) -> None:
        """Return once no disk operation is in flight (writes, discards, reads, namespace
        saves)."""
        while self._inflight:
            await asyncio.wait(list(self._inflight))
        self.flush_events()

    async def _try_open(self) -> bool:
        start = time.perf_counter()
        try:
            saved, scan = await self._run(self._open_and_scan)
        except StorageError as exc:
            self.health.set(UNAVAILABLE, str(exc))
            return False
        trimmed = self._restore(saved, scan)
        trimmed |= await compact(self.index, self.store, self._run, self.wait_idle)
        if trimmed:
            try:
                await self._run(self._trim, trimmed)
            except StorageError as exc:  # only space is lost: the files stay longer
                logger.warning("SSD tier: %s", exc)
        self.writeback.release()  # blank slots kept by an earlier run, past the slack
        self.rebuild_s = time.perf_counter() - start
        self.opened = True
        self.health.set(OK, "")
        logger.info(
            "SSD tier %s (%s I/O, %s): recovered %d chunks (%d MiB) in %.3f s from %d headers",
            self.store.directory,
            self.store.io_mode,
            self.config.policy,
            self.counters.recovered_chunks,
            self.index.used_bytes >> 20,
            self.rebuild_s,
            scan.headers_read,
        )
        return True

    def _open_and_scan(self) -> tuple[list[dict[str, Any]], ScanResult]:
        self.store.open()
        try:
            scan = self.store.scan(blank_within=self.config.capacity_bytes)
            return self.store.load_namespaces(), scan
        except BaseException:
            self.store.close()
            raise

    def _trim(self, trimmed: dict[int, int]) -> None:
        for slot_bytes, num_slots in trimmed.items():
            self.store.truncate(slot_bytes, num_slots)

    def _restore(self, saved: list[dict[str, Any]], scan: ScanResult) -> dict[int, int]:
        rebuilt = rebuild(self.engine, self.index, saved, scan)
        self.saved.restore(rebuilt.saved)
        result = rebuilt.result
        self.counters.recovered_chunks += len(result.recovered)
        self.writeback.discard(*result.discard)
        for entry in result.recovered:
            self._events.append((entry.ns_id, True, entry.key))
        self.flush_events()
        self.namespaces_changed()
        return result.trimmed

    async def _retry_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.retry_s)
            try:
                if not self.opened:
                    await self._try_open()
                    continue
                await self._check_directory()
                if not self.health.lost and self.saved.unsaved():
                    self.namespaces_changed()
            except Exception:  # housekeeping must never end
                logger.exception("SSD tier retry failed")

    async def _check_directory(self) -> None:
        """Whether the directory's path still leads to the directory opened (an operator may
        remove or rename it while the daemon runs): if not, the tier is ``unavailable`` with
        the reason (``TierHealth.directory_lost``) until it is back."""
        try:
            lost = await self._run(self.store.directory_lost)
        except StorageError as exc:  # the check failed (EIO, EACCES ...): nothing proven
            logger.debug("SSD tier: %s", exc)
            return
        self.health.directory_lost(lost)

    # ================================================================== conditions

    @property
    def condition(self) -> str:
        return self.health.condition

    @property
    def reason(self) -> str:
        """Why the tier is not ``ok`` ("" when it is)."""
        return self.health.reason

    # ================================================================== write-back

    def on_evict(self, spec: NamespaceSpec, victims: list[Entry]) -> None:
        """The engine's eviction hook (:meth:`WriteBack.on_evict` once the namespace is saved
        in the directory; skipped and counted before). Never calls the engine."""
        if not self.opened or spec.ns_id not in self.saved.durable:
            self.counters.skipped_chunks += len(victims)
            if self.writeback.writable():
                self.namespaces_changed()
            return
        self.writeback.on_evict(spec, victims)

    def track(self, fut: asyncio.Future[Any], done: Callable[[asyncio.Future[Any]], None]) -> None:
        """Count ``fut`` as disk work in flight (``wait_idle``, ``close``); then ``done(fut)``."""
        self._inflight_add(fut)
        fut.add_done_callback(done)

    def _inflight_add(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)

    # ================================================================== lookups

    def holds(self, ns_id: str, key: bytes) -> bool:
        """True if ``key`` is READY on SSD (never needs I/O: the index is in memory)."""
        return self.opened and self.index.ready(ns_id, key) is not None

    def held_keys(self) -> dict[str, list[bytes]]:
        return self.index.held_keys()

    def record_lookup(self, ns_id: str, hits: Sequence[bytes], misses: int, *, touch: bool) -> None:
        """Count the lookup (``hit_chunks``: its keys found only here, ``miss_chunks``: those
        in no tier); ``touch`` refreshes ``hits`` in the SSD eviction order."""
        c = self.counters
        c.lookups += 1
        c.hit_chunks += len(hits)
        c.miss_chunks += misses
        if touch and hits:
            self.index.touch(ns_id, hits)

    def needs_promotion(self, ns_id: str, keys: Sequence[bytes]) -> bool:
        """True if some key is READY on SSD but not in DRAM."""
        if not self.opened or not len(self.index):
            return False
        needs = self.promotions.needs
        if not self.promotions.num_in_flight:  # then only keys not in DRAM can need it
            keys = self.engine.missing(ns_id, keys)
        return any(needs(ns_id, k) for k in keys)

    # ================================================================== promotion

    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False
    ) -> DirectParts:
        """Bring the keys that are READY on SSD but not in DRAM into DRAM (or wait for the
        promotion already bringing them); see :class:`kvserver.daemon.promotion.Promotions`."""
        if not self.opened:
            return {}
        return await self.promotions.promote(ns_id, keys, direct=direct)

    def unpin(self, entry: SsdEntry) -> None:
        """End a read of ``entry`` (see ``SsdIndex.pin``); discards its slot if it was dropped
        meanwhile."""
        slot = self.index.unpin(entry)
        if slot is not None:
            self.writeback.discard(slot)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    # ================================================================== events, namespaces

    def event(self, ns_id: str, stored: bool, key: bytes) -> None:
        """Queue a STORAGE event; flushed (batched per namespace and kind) on the next loop turn."""
        if not self._events:
            asyncio.get_running_loop().call_soon(self.flush_events)
        self._events.append((ns_id, stored, key))

    def flush_events(self) -> None:
        """Announce the queued STORAGE events now (also runs by itself on the next loop turn)."""
        events, self._events = self._events, []
        run: list[bytes] = []
        for i, (ns_id, stored, key) in enumerate(events):
            run.append(key)
            nxt = events[i + 1] if i + 1 < len(events) else None
            if nxt is None or nxt[:2] != (ns_id, stored):
                self.engine.announce(ns_id, run, MEDIUM_SSD, stored=stored)
                run = []
        if events:
            self._publish()

    def namespaces_changed(self) -> None:
        """Save the namespace specs with the data (off the loop) if some are not saved yet
        (:meth:`SavedNamespaces.save <kvserver.daemon.tier_namespaces.SavedNamespaces.save>`).
        Chunks of a namespace are written down only once its spec is durable."""
        self.saved.save()

    # ================================================================== stats

    def stats(self) -> dict[str, Any]:
        index = self.index
        return {
            "condition": self.health.condition,
            "condition_detail": self.health.reason,
            "directory": self.store.directory,
            "io_mode": self.store.io_mode if self.opened else "",
            "policy": self.config.policy,
            "admission": self.config.admission,
            "capacity_bytes": index.capacity_bytes,
            "used_bytes": index.used_bytes,
            "reserved_bytes": index.reserved_bytes,
            "pinned_bytes": index.pinned_bytes,
            "entries": len(index),
            "writes_in_flight": index.num_writing,
            "promoting_chunks": self.promotions.num_in_flight,
            "joined_promotion_chunks": self.promotions.joined_chunks,
            "serving_bytes": self.promotions.serving_bytes,
            "unsaved_namespaces": self.saved.num_unsaved,
            "staging_bytes": self.staging.in_use_bytes,
            "spare_bytes": index.spare_bytes,
            "freeing_slots": index.num_discarding + index.num_releasing,
            "rebuild_s": self.rebuild_s,
            **asdict(self.counters),
            "namespaces": index.usage_by_namespace(),
        }
