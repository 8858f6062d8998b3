"""The peers this daemon knows: their links, which are suspect, and the tier's counters.

Runs in the daemon process, on its event loop. Not thread-safe: loop only.

Invariants: there is at most one :class:`~kvserver.daemon.peers.link.PeerLink` per host id,
and it is to the incarnation and address the directory named last (a new incarnation or
address replaces the link, closing the old one in the background; a host the directory no
longer names has its link closed at the next fetch: :meth:`PeerBook.forget`); a host is
suspect from a failed call until ``suspect_s`` later, and a suspect host is neither reported
by lookups nor asked for chunks. Suspicion outlives the link (a restarted peer that was
suspect stays so until its time is up).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.link import (
    DEFAULT_CONNECTIONS,
    DEFAULT_MAX_FRAME_BYTES,
    PeerFailed,
    PeerLink,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_SUSPECT_S = 10.0


@dataclass(slots=True)
class PeerCounters:
    """Counters of the network tier (reported in ``stats``; never reset)."""

    #: fetch calls to peers (windows asked), and the chunks and payload bytes they brought.
    fetches: int = 0
    #: of ``fetches``, those over a peer's stream port (the rest went over ZMQ).
    stream_fetches: int = 0
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    #: fetched chunks placed in DRAM (the rest were sent straight on, or DRAM refused them).
    placed_chunks: int = 0
    #: peer calls that failed: timed out / unreachable, or answered what they should not.
    timeouts: int = 0
    failures: int = 0
    #: keys a load wanted that a fetch already under way was bringing (not asked again).
    joined_chunks: int = 0
    #: keys the directory named a holder for that no peer then sent (not those asked of a
    #: peer on a guess, ``directory_skipped``).
    missed_chunks: int = 0
    #: ZMQ fetch windows a peer refused for now (``capacity``: its cap on unsent replies
    #: to one connection, ``zmq_windows.py``); asked again once.
    refused_windows: int = 0
    #: lookups that asked the directory.
    directory_lookups: int = 0
    #: keys a load found holders for in a lookup's recent answer (the directory not asked).
    directory_reused: int = 0
    #: loads whose missing keys were asked of a likely peer straight away, without asking
    #: the directory first (``--peers``: each is a lookup round trip to every peer saved).
    directory_skipped: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """How peers are called: per-call timeout, suspicion time, connections per peer, the
    data plane's auth token and extra client options (CURVE keys); ``stream``: fetch over a
    peer's plain (``tcp://``) stream port when it advertises one (off when CURVE is
    configured: chunks would cross in clear); ``stream_tls``: fetch over a peer's TLS
    (``tls://``) stream port with this context (None: never), checking
    ``tls_server_name`` ("" = the host of its address) against its certificate;
    ``max_frame_bytes``: the largest reply frame taken from a peer over ZMQ."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    suspect_s: float = DEFAULT_SUSPECT_S
    connections: int = DEFAULT_CONNECTIONS
    auth_token: str = ""
    client_id: str | None = None
    client_options: tuple[tuple[str, Any], ...] = ()
    stream: bool = True
    stream_tls: ssl.SSLContext | None = None
    tls_server_name: str = ""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.suspect_s < 0 or self.connections < 1:
            raise ValueError("need timeout_s > 0, suspect_s >= 0 and connections >= 1")
        if self.max_frame_bytes < 1:
            raise ValueError("need max_frame_bytes >= 1")


class PeerBook:
    """Links and suspicion per peer; see the module docstring."""

    def __init__(
        self, settings: PeerSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.counters = PeerCounters()
        self._clock = clock
        self._links: dict[str, PeerLink] = {}
        self._suspect_until: dict[str, float] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def link(self, peer: Peer) -> PeerLink:
        """The link to ``peer`` (opened, or replaced if it names another incarnation or
        address than the current link)."""
        link = self._links.get(peer.host_id)
        if link is not None and link.peer == peer:
            return link
        if link is not None:
            logger.info(
                "peer %s is now incarnation %s at %s",
                peer.host_id,
                peer.incarnation,
                peer.data_address,
            )
            self._close_later(link)
        s = self.settings
        link = PeerLink(
            peer,
            timeout_s=s.timeout_s,
            auth_token=s.auth_token,
            connections=s.connections,
            client_id=s.client_id,
            client_options=dict(s.client_options),
            stream=s.stream,
            stream_tls=s.stream_tls,
            tls_server_name=s.tls_server_name,
            max_frame_bytes=s.max_frame_bytes,
        )
        self._links[peer.host_id] = link
        return link

    @property
    def num_links(self) -> int:
        """Peers with a link open (known now, or not yet forgotten)."""
        return len(self._links)

    def is_suspect(self, host_id: str) -> bool:
        until = self._suspect_until.get(host_id)
        if until is None:
            return False
        if self._clock() >= until:
            del self._suspect_until[host_id]
            logger.info("peer %s is no longer suspect", host_id)
            return False
        return True

    def suspect(self, host_id: str, why: str) -> None:
        """Leave ``host_id`` out of lookups and fetches for ``suspect_s``."""
        if not self.is_suspect(host_id):
            suspect_s = self.settings.suspect_s
            logger.warning("peer %s is suspect for %.1fs: %s", host_id, suspect_s, why)
        self._suspect_until[host_id] = self._clock() + self.settings.suspect_s

    def failed(self, peer: Peer, exc: PeerFailed) -> None:
        """A call to ``peer`` failed: count it (a timeout or another failure) and suspect the
        peer; nothing for a call that never reached it, every connection being busy with
        this daemon's other calls (``exc.busy``: the peer is serving those)."""
        if exc.busy:
            return
        if exc.timed_out:
            self.counters.timeouts += 1
        else:
            self.counters.failures += 1
        self.suspect(peer.host_id, str(exc))

    def suspects(self, known: Iterable[str]) -> list[str]:
        return [h for h in known if self.is_suspect(h)]

    def forget(self, live: Collection[str]) -> None:
        """Close the links of hosts no longer among ``live`` (they left the fleet): the
        network tier calls this before each fetch with the directory's peers."""
        for host_id in [h for h in self._links if h not in live]:
            self._close_later(self._links.pop(host_id))

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _close_later(self, link: PeerLink) -> None:
        task = asyncio.get_running_loop().create_task(link.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
