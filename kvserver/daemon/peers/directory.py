"""Who the peers are and which of them hold which chunk: the seam to the fleet index.

Runs in the daemon process, on its event loop. :class:`PeerDirectory` is a protocol: the fleet
index on Redis implements it (:class:`~kvserver.daemon.peers.fleet.FleetDirectory`), and so
does :class:`~kvserver.daemon.peers.static.StaticDirectory` (a configured list of peers, asked
directly). The answers may lag the truth (a peer evicted a chunk a moment ago, or died): the
network tier never trusts them for bytes, only for whom to ask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserver.errors import Unavailable


@dataclass(frozen=True, slots=True)
class Peer:
    """One other daemon of the fleet, as the directory knows it.

    ``incarnation`` changes at every start of that daemon; a link opened to one incarnation
    is not used for another (its chunks are not the same). ``data_address`` is its ZMQ data
    plane (``tcp://host:port``, the address it advertises). ``stream_address`` is its peer
    stream port (``tcp://host:port``, or ``tls://host:port`` when it is TLS,
    ``kvserver/wire_stream.py``): "" when it advertises none (a daemon older than the stream,
    or one with CURVE and no TLS certificate), None when the directory cannot
    tell (a configured peer list: the link asks the peer's ``hello``)."""

    host_id: str
    incarnation: str
    data_address: str
    stream_address: str | None = None


class PeerFailed(Unavailable):
    """A peer did not answer in time, or answered with something it should not have sent.
    ``timed_out`` tells which. ``busy``: the call never reached the peer, every connection to
    it being in use by this daemon's other calls for the whole timeout (this daemon's
    congestion, not the peer failing: the peer is not made suspect for it)."""

    def __init__(
        self, message: str, *, timed_out: bool, busy: bool = False, **context: Any
    ) -> None:
        super().__init__(message, **context)
        self.timed_out = timed_out
        self.busy = busy


class PeerDirectory(Protocol):
    """Membership and chunk locations; see the module docstring."""

    @property
    def error(self) -> str:
        """Why the directory cannot be read now ("" when it can)."""
        ...

    @property
    def asks_peers(self) -> bool:
        """True when :meth:`holders` asks the peers themselves (a configured list): then a
        fetch from a peer (``get leading=true``, which sends the leading run it holds)
        answers the same question in the same round trip and brings the bytes, so the
        network tier may ask a likely peer for the bytes straight away. False when it reads
        an index elsewhere (Redis)."""
        ...

    def peers(self) -> Mapping[str, Peer]:
        """The live peers (never this daemon), by host id; cheap (no I/O)."""
        ...

    async def holders(self, ns_id: str, keys: Sequence[bytes]) -> list[frozenset[str]]:
        """For each of ``keys``, in order, the host ids that hold it in any tier (empty when
        none). May stop early: a shorter list means the keys after it are held by no peer.
        Raises nothing for an unreachable index: it answers no holders then."""
        ...
