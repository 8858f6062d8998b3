"""Throttling the error replies to ZMQ connections whose requests fail authentication, and
counting the connections refused at the handshake already (:class:`HandshakeCounts`).

Runs in the daemon process, on its event loop: the ZMQ front end (``zmq_server.py``) hands
each ``unauthenticated`` error reply of a ROUTER connection to :meth:`RefusalThrottle.answer`,
which sends, holds or drops it; ``KVService.stats()`` carries :meth:`RefusalThrottle.stats`
as ``refusals``. Not thread-safe.

Why: ZMQ delivers whole messages, so the daemon has read every byte of a request (up to 16 MiB
of header) before it can see that its token is wrong; what it can decide is how fast it lets a
refused client come back. A client sending request after request, each waiting for its reply
(a misconfigured client retrying in a loop, or an attacker pushing big unauthenticated
requests), is slowed to one reply per :data:`REFUSAL_INTERVAL_S` per connection, and all of
them together to :data:`REFUSED_BYTES_PER_S` of refused requests: the daemon's
ZMQ I/O thread, which also carries every authenticated client's messages, then no longer
spends its time copying that client's bytes (docs/benchmarks.md, the abuse section).

Rules (a connection is a ROUTER routing id):

- the error replies of its first :data:`REFUSAL_BURST` refused requests leave at once (and so
  do those of a connection quiet for a while: the allowance comes back at one per
  :data:`REFUSAL_INTERVAL_S`): an honest, misconfigured client gets its clear
  ``unauthenticated`` error without delay, and so do the few requests a pipelining client had
  in flight with a stale token (the daemon restarted with a new one);
- past that, each reply leaves one :data:`REFUSAL_INTERVAL_S` after the previous one (held
  back: :meth:`RefusalThrottle.refuse` returns the delay), in request order;
- at most :data:`MAX_HELD_PER_CONNECTION` replies of a connection, and :data:`MAX_HELD` in
  all, wait at a time; a refused request beyond that gets no reply (dropped, counted): only a
  client that does not wait for its replies gets there;
- daemon-wide, the bytes of refused requests (all connections together) get their replies at
  once up to :data:`REFUSED_BYTES_BURST`, then at :data:`REFUSED_BYTES_PER_S`: a reply leaves
  no earlier than both allowances permit. A client that opens a new connection for a fresh
  allowance gains nothing once it sends big requests; the small requests of an honest client
  are held only while such a flood goes on;
- a request with a valid token is served at once as always, and lifts the connection's
  penalty (a client that re-read a rotated token goes on at full speed). Its reply may then
  leave before error replies still held back for that connection; request ids tell them apart.

What it does not do: stop a client that sends without waiting for replies from being read —
only authentication at the ZMQ handshake can, and does whenever the daemon requires a token
(``zap.py``: the ROUTER is a PLAIN server whose password is the token, or a CURVE server with
a clients directory); what remains for this throttle is a peer admitted at the handshake whose
requests carry no or another token, and a CURVE daemon that admits any client key. The held
replies hold no request bytes: the request's frames are released at once; a held reply is its
short error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: past the burst, error replies of one connection leave at most once per this many seconds.
REFUSAL_INTERVAL_S = 1.0
#: error replies of one connection that may leave at once.
REFUSAL_BURST = 8
#: refused bytes, all connections together, whose error replies may leave at once; and then
#: per second.
REFUSED_BYTES_BURST = 64 << 20
REFUSED_BYTES_PER_S = 16 << 20
#: error replies waiting to be sent, per connection and in all.
MAX_HELD_PER_CONNECTION = 8
MAX_HELD = 4096
#: connections remembered (the oldest is forgotten past it).
MAX_CONNECTIONS = 1 << 16


@dataclass(slots=True)
class _Penalty:
    due: float  # the connection's replies so far, spaced one interval apart, end here
    held: int = 0  # its error replies waiting


class RefusalThrottle:
    """When to send each error reply of a refused ROUTER request; see the module docstring.

    :meth:`answer` sends, holds or drops one reply (on the running loop); :meth:`refuse`
    is its decision alone. ``clock`` is the time in seconds (monotonic)."""

    def __init__(
        self,
        interval_s: float = REFUSAL_INTERVAL_S,
        *,
        burst: int = REFUSAL_BURST,
        bytes_burst: int = REFUSED_BYTES_BURST,
        bytes_per_s: int = REFUSED_BYTES_PER_S,
        max_held_per_connection: int = MAX_HELD_PER_CONNECTION,
        max_held: int = MAX_HELD,
        max_connections: int = MAX_CONNECTIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval = interval_s
        self._burst = burst
        self._bytes_burst = bytes_burst
        self._bytes_per_s = bytes_per_s
        self._bytes_due = clock()  # the refused bytes so far, at bytes_per_s, end here
        self._max_held_per_connection = max_held_per_connection
        self._max_held = max_held
        self._max_connections = max_connections
        self._clock = clock
        self._penalties: dict[bytes, _Penalty] = {}
        self._held = 0
        self.refused = 0  # requests refused as unauthenticated (every one counts)
        self.held_back = 0  # error replies sent later than at once
        self.dropped = 0  # refused requests that got no reply (over the bounds)

    def answer(self, peer: bytes, size: int, send: Callable[[], None]) -> None:
        """A request of ``peer`` (``size`` bytes) was refused: ``send()`` its error reply now,
        later (a timer on the running loop; ``send`` must then still be callable, e.g. do
        nothing once the socket is closed) or never."""
        delay = self.refuse(peer, size)
        if delay == 0.0:
            send()
        elif delay is not None:
            asyncio.get_running_loop().call_later(delay, self._release, peer, send)

    def _release(self, peer: bytes, send: Callable[[], None]) -> None:
        self.sent(peer)
        try:
            send()
        except Exception:  # a reply that cannot be sent must not end the loop
            logger.exception("failed to send a held error reply")

    def refuse(self, peer: bytes, size: int = 0) -> float | None:
        """A request of ``peer`` (``size`` bytes) was refused: its error reply leaves after
        this many seconds (0.0: at once), or None: send none."""
        self.refused += 1
        now = self._clock()
        penalty = self._penalties.get(peer)
        if penalty is None:
            penalty = _Penalty(now)
            self._note(peer, penalty)
        # GCRA, twice: the replies so far end at ``due`` (one interval each) and the refused
        # bytes at ``bytes_due`` (at bytes_per_s); a burst may leave that much earlier
        due = max(penalty.due, now) + self._interval
        cost = min(size, self._bytes_burst) / self._bytes_per_s
        bytes_due = max(self._bytes_due, now) + cost
        delay = max(
            due - self._burst * self._interval - now,
            bytes_due - self._bytes_burst / self._bytes_per_s - now,
        )
        if delay <= 1e-9:  # within both bursts (up to rounding)
            penalty.due, self._bytes_due = due, bytes_due
            return 0.0
        if penalty.held >= self._max_held_per_connection or self._held >= self._max_held:
            self.dropped += 1
            return None
        penalty.due, self._bytes_due = due, bytes_due
        penalty.held += 1
        self._held += 1
        self.held_back += 1
        return delay

    def sent(self, peer: bytes) -> None:
        """A held reply of ``peer`` was sent (or given up)."""
        penalty = self._penalties.get(peer)
        if penalty is not None and penalty.held > 0:  # else forgotten: no longer counted
            penalty.held -= 1
            self._held -= 1

    def forgive(self, peer: bytes) -> None:
        """``peer`` sent a request with a valid token: no penalty for it any more (the
        replies already held for it still leave when due)."""
        penalty = self._penalties.get(peer)
        if penalty is not None and penalty.held == 0:
            del self._penalties[peer]

    def _note(self, peer: bytes, penalty: _Penalty) -> None:
        penalties = self._penalties
        while len(penalties) >= self._max_connections:
            oldest = next(iter(penalties))
            self._held -= penalties.pop(oldest).held  # its held replies stop counting
        penalties[peer] = penalty

    def stats(self) -> dict[str, int]:
        """``refused``, ``held_back``, ``dropped`` (counters since start), ``held`` and
        ``connections`` (now)."""
        return {
            "refused": self.refused,
            "held_back": self.held_back,
            "dropped": self.dropped,
            "held": self._held,
            "connections": len(self._penalties),
        }


@dataclass(slots=True)
class HandshakeCounts:
    """ZMQ handshakes with the ROUTER that the ZAP handler admitted and refused (a wrong or
    missing token: PLAIN; an unlisted key: CURVE), and those that failed before it was asked
    (the peer spoke another mechanism, broke the protocol or hung up midway), from the
    ROUTER's monitor. In ``stats()`` as ``handshakes`` (``zap.py``)."""

    accepted: int = 0
    refused_token: int = 0
    refused_key: int = 0
    failed: int = 0

    def stats(self) -> dict[str, int]:
        return {
            "accepted": self.accepted,
            "refused": self.refused_token + self.refused_key,
            "refused_token": self.refused_token,
            "refused_key": self.refused_key,
            "failed": self.failed,
        }


@dataclass(slots=True)
class SubscriberCounts:
    """Connections to the KV-event PUB (``pub_limit.py``): those open now, those cut at once
    because ``pub_max_subscribers`` were open already, and those cut for subscribing to more
    than ``MAX_TOPICS`` topics. In ``stats()`` as ``pub_subscribers``."""

    connected: int = 0
    refused: int = 0
    too_many_topics: int = 0

    def stats(self) -> dict[str, int]:
        return {
            "connected": self.connected,
            "refused": self.refused,
            "too_many_topics": self.too_many_topics,
        }
