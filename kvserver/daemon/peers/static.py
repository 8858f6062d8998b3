"""A directory without a fleet index: a configured list of peers, asked directly.

Runs in the daemon process, on its event loop. Not thread-safe: loop only.

``kvserver start --peers tcp://hostA:9471,tcp://hostB:9471`` names the peers' data planes; each
is known by its address (its host id here) and any incarnation. :meth:`StaticDirectory.holders`
asks every peer that is not suspect, concurrently, for the leading run of the keys it holds
(the data plane's ``lookup``, bounded by the peer timeout): a lookup costs one round trip to
the slowest peer, so this suits a handful of hosts; a fleet uses the index on Redis instead.
A peer that does not answer in time is suspect (and holds nothing) for ``suspect_s``.

A load needs no lookup first (``asks_peers``): the network tier asks a likely peer (the only
one, or the one that last sent chunks of the namespace) for the bytes straight away, and its
fetch reports what it holds; only what it did not send is looked up among the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from kvserver.daemon.peers.book import PeerBook
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.link import PeerFailed


class StaticDirectory:
    """A :class:`~kvserver.daemon.peers.directory.PeerDirectory` over fixed addresses."""

    #: never fails as a whole: each peer's failure makes that peer suspect.
    error = ""
    #: holders() asks the peers: a load may ask a likely peer for the bytes instead
    #: (``PeerTier.promote``).
    asks_peers = True

    def __init__(self, addresses: Sequence[str], book: PeerBook) -> None:
        self._peers = {a: Peer(a, "", a) for a in dict.fromkeys(addresses)}
        self._book = book

    def peers(self) -> Mapping[str, Peer]:
        return self._peers

    async def holders(self, ns_id: str, keys: Sequence[bytes]) -> list[frozenset[str]]:
        book = self._book
        asked = [p for h, p in self._peers.items() if not book.is_suspect(h)]
        if not asked or not keys:
            return []
        runs = await asyncio.gather(*(self._ask(p, ns_id, keys) for p in asked))
        out: list[frozenset[str]] = []
        for i in range(max(runs)):
            out.append(frozenset(p.host_id for p, n in zip(asked, runs, strict=True) if n > i))
        return out

    async def _ask(self, peer: Peer, ns_id: str, keys: Sequence[bytes]) -> int:
        book = self._book
        try:
            return await book.link(peer).lookup(ns_id, keys)
        except PeerFailed as exc:
            book.failed(peer, exc)
            return 0
