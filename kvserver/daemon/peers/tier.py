"""``PeerTier``: the network tier, the lowest of the daemon's tier stack (``tiers.py``).

Runs in the daemon process, on its event loop. Not thread-safe: loop only.

What it does for the service (the seam's contracts):

- **Lookup**: ``holds`` cannot tell without I/O whenever the directory knows a peer that is
  not suspect (it answers None, so the service finishes the lookup asynchronously), and is
  False otherwise (a lone daemon pays nothing). ``query`` asks the directory which peers hold
  the keys: a key counts for this tier when a peer that is not suspect holds it; the service
  then reports the run across its own tiers and then peers (``{"dram", "ssd", "peer"}``).
- **Promotion**: a load or ``get`` naming keys in no local tier (``needs_promotion``: some key
  not in DRAM while a usable peer is known) awaits ``promote``: the directory names the
  holders of the missing keys (up to the first one no usable peer holds: the load needs every
  key), :class:`~kvserver.daemon.peers.fetch.PeerFetches` fetches them (once however many
  loads want them), checks them and places them in DRAM; what could not be brought is a miss
  for the load. Never raises for a peer's or the directory's failure.
- **A lookup's answer is reused**: the holders ``query`` learnt are kept for
  :data:`HOLDERS_TTL_S` (at most :data:`HOLDERS_MAX` keys, oldest dropped first), and a
  promotion takes the leading run of its missing keys from them, asking the directory only
  for the rest: the usual lookup-then-load asks the directory (Redis, or every static peer)
  once, not twice. A reused answer is as trustworthy as a fresh one (the directory may lag
  either way): a holder that no longer sends a key makes it a miss or another holder's.
- **No lookup before a fetch from configured peers**: where the directory asks the peers
  themselves (``asks_peers``, ``--peers``), asking it costs the same round trip as the fetch,
  whose reply (``get leading=true``: the leading run the peer holds) answers the same
  question. So the rest is asked straight away of a likely peer (the only usable one, or the
  one that last sent chunks of the namespace: ``directory_skipped`` counts these), and only
  what it did not send is looked up among the others, then fetched. Nothing is trusted that
  was not sent: a wrong guess costs a round trip, never a wrong byte.
- **Write-down**: none. A network tier does not accept evictions (``on_evict`` ignores them):
  what this daemon evicts stays wherever else the fleet holds it.
- **Local-only requests**: a peer asking this daemon (``lookup local=``, ``get leading=``) is
  answered from the local tiers only; the service skips tiers that are not :attr:`local`, so
  fetches never chain or loop between daemons.
- **Condition**: ``ok``; ``degraded`` while some known peers are suspect or the directory
  could not be read (its error is the detail); the daemon serves its own tiers in every
  condition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kvserver.daemon.peers.book import PeerBook
from kvserver.daemon.peers.directory import PeerDirectory
from kvserver.daemon.peers.fetch import STREAM_WINDOW_BYTES, PeerFetches
from kvserver.daemon.tiers import DEGRADED, OK, DirectParts, Tier
from kvserver.engine import StorageEngine
from kvserver.engine.types import Entry
from kvserver.events import MEDIUM_DRAM, Medium
from kvserver.namespace import NamespaceSpec

logger = logging.getLogger(__name__)

#: how long a lookup's answer (which peers hold which keys) serves the loads that follow.
HOLDERS_TTL_S = 2.0
#: keys whose holders are remembered at most (the oldest are dropped first).
HOLDERS_MAX = 1 << 16


class PeerTier(Tier):
    """Chunks held by other daemons of the fleet; see the module docstring."""

    name: ClassVar[str] = "peer"
    #: never announces anything itself: fetched chunks are announced by DRAM (CPU).
    medium: ClassVar[Medium] = MEDIUM_DRAM
    local: ClassVar[bool] = False

    def __init__(
        self,
        engine: StorageEngine,
        directory: PeerDirectory,
        book: PeerBook,
        *,
        publish: Any = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        stream_window_bytes: int = STREAM_WINDOW_BYTES,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self.directory = directory
        self.book = book
        self.fetches = PeerFetches(
            engine, book, publish=publish, stream_window_bytes=stream_window_bytes
        )
        #: keys of lookups credited to peers.
        self.hit_chunks = 0
        #: (ns_id, key) -> (expiry, holders) from recent lookups, oldest first.
        self._holders: dict[tuple[str, bytes], tuple[float, frozenset[str]]] = {}

    # ------------------------------------------------------------------ lifetime

    async def open(self) -> None:
        logger.info("network tier: %d peer(s) known", len(self.directory.peers()))

    async def close(self) -> None:
        """Let the fetches under way finish (a window is bounded by the peer timeout; they
        write into arena pages), then close the links."""
        if not await self.fetches.drain(2 * self.book.settings.timeout_s + 1.0):
            logger.warning("network tier: fetches still under way at shutdown")
        await self.book.close()

    # ------------------------------------------------------------------ lookup

    def _usable(self) -> bool:
        book = self.book
        return any(not book.is_suspect(h) for h in self.directory.peers())

    def holds(self, ns_id: str, key: bytes) -> bool | None:
        """None (ask :meth:`query`) while a usable peer is known, else False."""
        return None if self._usable() else False

    async def query(self, ns_id: str, keys: Sequence[bytes]) -> list[bool]:
        out = [False] * len(keys)
        if not keys or not self._usable():
            return out
        self.book.counters.directory_lookups += 1
        holders = await self.directory.holders(ns_id, keys)
        book = self.book
        self._remember(ns_id, keys, holders)
        for i, hosts in enumerate(holders[: len(keys)]):
            out[i] = any(not book.is_suspect(h) for h in hosts)
        return out

    def _remember(
        self, ns_id: str, keys: Sequence[bytes], holders: Sequence[frozenset[str]]
    ) -> None:
        """Keep a lookup's answer for the loads that follow (module docstring)."""
        cache = self._holders
        expiry = self._clock() + HOLDERS_TTL_S
        for key, hosts in zip(keys, holders, strict=False):
            if hosts:
                cache.pop((ns_id, key), None)  # re-inserted last: the newest
                cache[(ns_id, key)] = (expiry, hosts)
        while len(cache) > HOLDERS_MAX:
            del cache[next(iter(cache))]

    def _recent_holders(self, ns_id: str, keys: list[bytes]) -> list[frozenset[str]]:
        """Holders of the leading run of ``keys`` that a recent lookup answered (no I/O)."""
        cache, now = self._holders, self._clock()
        out: list[frozenset[str]] = []
        for key in keys:
            known = cache.get((ns_id, key))
            if known is None or known[0] < now:
                break
            out.append(known[1])
        self.book.counters.directory_reused += len(out)
        return out

    async def _ask_directory(self, ns_id: str, keys: list[bytes]) -> list[frozenset[str]]:
        if not keys:
            return []
        self.book.counters.directory_lookups += 1
        return await self.directory.holders(ns_id, keys)

    def _first_peer(self, ns_id: str) -> str | None:
        """With a directory that asks the peers themselves (``asks_peers``): the peer to ask
        for the bytes straight away, its fetch answering what a lookup would (the only
        usable peer, or the one that last sent chunks of ``ns_id``); else None."""
        if not self.directory.asks_peers:
            return None
        book = self.book
        usable = [h for h in self.directory.peers() if not book.is_suspect(h)]
        if len(usable) == 1:
            return usable[0]
        last = self.fetches.last_sender(ns_id)
        return last if last in usable else None

    def record_lookup(self, ns_id: str, hits: Sequence[bytes], misses: int, *, touch: bool) -> None:
        self.hit_chunks += len(hits)

    # ------------------------------------------------------------------ promotion

    def needs_promotion(self, ns_id: str, keys: Sequence[bytes]) -> bool:
        if not self._usable():
            return False
        return bool(self._engine.missing(ns_id, keys))

    async def promote(
        self, ns_id: str, keys: Sequence[bytes], *, direct: bool = False
    ) -> DirectParts:
        spec = self._engine.namespace(ns_id)  # UnknownNamespace: bad input, nothing changed
        unique = list(dict.fromkeys(keys))
        missing = self._engine.missing(ns_id, unique)
        if not missing or not self._usable():
            return {}
        known = self._recent_holders(ns_id, missing)
        rest = missing[len(known) :]
        first = self._first_peer(ns_id) if rest else None
        if first is None:
            holders = known + await self._ask_directory(ns_id, rest)
            return await self._fetch(spec, unique, missing, holders, direct)
        # ask ``first`` for the rest straight away: its fetch reports the leading run it holds
        self.book.counters.directory_skipped += 1
        got = await self._fetch(spec, unique, missing, known + [frozenset({first})] * len(rest),
                                direct, guessed=frozenset(rest))  # fmt: skip
        left = [k for k in self._engine.missing(ns_id, missing) if k not in got]
        book = self.book
        if left and any(h != first and not book.is_suspect(h) for h in self.directory.peers()):
            # what ``first`` did not send: only the others can hold it (``first`` just
            # answered, for the first of these keys, that it does not)
            holders = [hs - {first} for hs in await self._ask_directory(ns_id, left)]
            got.update(await self._fetch(spec, unique, left, holders, direct))
        return got

    async def _fetch(
        self,
        spec: NamespaceSpec,
        unique: list[bytes],
        missing: list[bytes],
        holders: Sequence[frozenset[str]],
        direct: bool,
        guessed: frozenset[bytes] = frozenset(),
    ) -> DirectParts:
        """Fetch the leading run of ``missing`` that a usable peer holds (``holders``, per
        key; a guess for the ``guessed`` keys), protecting the keys of ``unique`` not in
        ``missing`` (those DRAM holds) from the eviction the placing may cause."""
        book = self.book
        wanted: list[tuple[bytes, frozenset[str]]] = []
        usable: dict[frozenset[str], bool] = {}  # keys mostly share their holders (one set)
        for key, hosts in zip(missing, holders, strict=False):
            ok = usable.get(hosts)
            if ok is None:
                ok = usable[hosts] = any(not book.is_suspect(h) for h in hosts)
            if not ok:
                break  # the load needs every key: the ones after this one are of no use
            wanted.append((key, hosts))
        if not wanted:
            return {}
        protect: list[bytes] = []
        if len(missing) < len(unique):  # ``missing`` is a part of ``unique``: all, or not
            absent = set(missing)
            protect = [k for k in unique if k not in absent]
        peers = self.directory.peers()
        book.forget(peers)  # the links of members that left the fleet are closed
        return await self.fetches.fetch(spec, wanted, peers, protect=protect, direct=direct,
                                        guessed=guessed)  # fmt: skip

    # ------------------------------------------------------------------ write-down

    def on_evict(self, spec: NamespaceSpec, victims: list[Entry]) -> None:
        """A network tier takes no evictions (module docstring)."""

    # ------------------------------------------------------------------ condition, stats

    @property
    def condition(self) -> str:
        return OK if not self.condition_detail else DEGRADED

    @property
    def condition_detail(self) -> str:
        problems = []
        suspects = self.book.suspects(self.directory.peers())
        if suspects:
            problems.append(f"suspect peers: {', '.join(sorted(suspects))}")
        error = self.directory.error
        if error:
            problems.append(f"directory: {error}")
        return "; ".join(problems)

    def stats(self) -> dict[str, Any]:
        peers = self.directory.peers()
        return {
            "condition": self.condition,
            "condition_detail": self.condition_detail,
            "peers_known": len(peers),
            "peers_suspect": len(self.book.suspects(peers)),
            "peers_linked": self.book.num_links,
            "hit_chunks": self.hit_chunks,
            "fetching_chunks": self.fetches.num_in_flight,
            **self.book.counters.to_dict(),
        }
