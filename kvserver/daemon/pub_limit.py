"""Bounds on the KV-event PUB: a per-subscriber queue in messages and a number of connections.

Runs in the daemon process, on its event loop (the monitor socket is read by a reader callback
on its file descriptor, as ``zap.py`` reads its own). Not thread-safe: loop only.

Call order: ``configure(pub, hwm)`` before the PUB binds → ``SubscriberLimit(ctx, counts,
max_subscribers)`` → ``watch(pub, port)`` after it binds → serving → ``stop()`` before the PUB
closes.

Why: without CURVE anyone who can reach the PUB port may subscribe, and ZMQ has no cap on a
bound socket's connections. A subscriber that never reads keeps, in the daemon, every message
published since it stalled up to the PUB's ``SNDHWM`` (ZMQ then drops its messages, for it
alone): at vLLM's ``SNDHWM`` of 100,000 messages that was ~21 MB per stalled subscriber (one
event of a few keys is one ~210-byte message), and 50 of them took the daemon from 230 to
674 MB. So:

- **Queue**: ``pub_hwm`` messages per subscriber (default 1,000; one message is one event, a
  vLLM ``KVEventBatch`` of one, ``zmq_events.py``). A subscriber that falls further behind loses
  messages and sees the gap in ``seq``; it gets them back from the replay protocol on the data
  port (``docs/wire.md`` §5), which serves any of the event log's ``event_capacity`` (100,000)
  newest events — the recovery vLLM's subscribers already do.
- **Connections**: at most ``pub_max_subscribers`` (default 64), at most
  :data:`MAX_SUBSCRIBERS_PER_ADDRESS` of them from one address. The PUB's monitor reports each
  accepted connection with its descriptor; one accepted while that many are open is shut down
  at once (``shutdown(2)`` of the descriptor: libzmq sees the end of the stream, drops the
  connection and its queue), counted as ``refused``. ZMQ offers no per-socket cap, ZAP is not
  told when a connection ends, and the monitor is: it reports ``DISCONNECTED`` with the same
  descriptor, so the count of open connections is exact while no monitor event is lost (its
  queue here is unbounded) — and is checked against the descriptors themselves before a
  connection is refused, at most once per :data:`PRUNE_INTERVAL_S`, so a lost event cannot
  lock subscribers out for longer. Not at every refusal: a refused SUB reconnects by itself
  (every 100 ms by default, every 1 ms if it sets ``RECONNECT_IVL`` so), and checking all
  ``pub_max_subscribers`` descriptors (four system calls each) at each of its attempts took
  66% of a core for eight such SUBs (1,900 refusals a second) and a client's ``hello`` from
  0.46 to 2.6 ms (p50); a refusal now costs the accept, two monitor events and a shutdown.

- **Topics**: a subscription is a message to the PUB (its topic prefix), and ZMQ keeps every
  one in a trie in the daemon, a node per byte of a new prefix: a SUB that subscribed to
  100,000 random 100-byte topics (10 MB) grew the daemon by 488 MB, and the next 200 stores
  took 5.1 s (ZMQ applies subscriptions while the PUB sends). The socket is an XPUB that
  passes every subscription up (``XPUB_VERBOSE``): they are read here every
  :data:`TOPICS_EVERY_S` (and ZMQ applies them then), counted per connection (its descriptor,
  ``SRCFD``), and a connection past :data:`MAX_TOPICS` is shut down as above, its subscriptions
  freed with it (counted as ``too_many_topics``); a topic is at most :data:`MAX_TOPIC_BYTES`
  bytes (``MAXMSGSIZE``: ZMQ drops a connection sending a longer one). Subscribers see the
  same events: topics are what vLLM-style subscribers filter on, one or a few each. Not
  exact: ZMQ also applies queued subscriptions whenever an event is published, up to the
  queue (``RCVHWM`` = MAX_TOPICS) each time, so a flood during a burst of events gets more
  applied before its connection is cut (100,000 topics: +4 to +32 MB seen, +488 MB before).

So a daemon's stalled subscribers hold at most ``pub_max_subscribers x pub_hwm`` messages
(64 x 1,000 x ~210 B ≈ 13 MB for events of a few keys; messages of events with many keys are
larger, ~35 B a key). Events are published in the order the engine numbers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvserver.daemon.refusals import SubscriberCounts
from kvserver.foreign_sockets import connection, shut_down

logger = logging.getLogger(__name__)

#: the PUB's monitor events read here (a refused handshake also ends with DISCONNECTED)
WATCHED_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
#: least time between two checks of the open connections' descriptors (``_prune``).
PRUNE_INTERVAL_S = 1.0


#: default of the most connections one address may hold (of ``pub_max_subscribers``; the
#: setting ``pub_max_subscribers_per_address``): one address opening connections (no token
#: needed) held every slot, and other subscribers were refused.
MAX_SUBSCRIBERS_PER_ADDRESS = 16
#: most subscriptions one connection may send (its topics; repeats counted) before it is cut.
MAX_TOPICS = 256
#: longest topic prefix a subscription may name (a subscription message is one byte more).
MAX_TOPIC_BYTES = 1024
#: how often the subscriptions the PUB received are read (and so applied by ZMQ).
TOPICS_EVERY_S = 0.05
#: subscriptions read per turn of the loop, at most.
TOPICS_PER_CALL = 4096


def configure(pub: zmq.Socket[Any], hwm: int) -> None:
    """Bound each subscriber's queue at ``hwm`` messages, and pass every subscription up, each
    at most MAX_TOPIC_BYTES (``pub`` an XPUB, before it binds)."""
    pub.setsockopt(zmq.SNDHWM, hwm)
    # subscriptions ZMQ queues per connection before they are read (and applied): few past
    # MAX_TOPICS are applied before a connection sending more is cut
    pub.setsockopt(zmq.RCVHWM, MAX_TOPICS)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.setsockopt(zmq.MAXMSGSIZE, MAX_TOPIC_BYTES + 1)


class SubscriberLimit:
    """Keeps at most ``max_subscribers`` connections on one PUB; see the module docstring.

    Invariant (while no monitor event is lost): ``_open`` holds the descriptor of every
    connection the PUB has accepted and not yet reported disconnected, except those refused,
    with its peer's address.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        counts: SubscriberCounts,
        max_subscribers: int,
        per_address: int = MAX_SUBSCRIBERS_PER_ADDRESS,
    ) -> None:
        self._ctx = ctx
        self._counts = counts
        self._max = max_subscribers
        self._per_address = per_address
        self._open: dict[int, str] = {}  # descriptor -> peer address
        self._port = 0
        self._watched: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pruned_at = -PRUNE_INTERVAL_S  # time.monotonic() of the last _prune
        #: the PUB without the asyncio layer, to read subscriptions; its next read
        self._raw: zmq.Socket[bytes] | None = None
        self._topics_timer: asyncio.TimerHandle | asyncio.Handle | None = None
        #: descriptor of an open connection -> subscriptions it sent
        self._topics: dict[int, int] = {}

    def watch(self, pub: zmq.Socket[Any], port: int) -> None:
        """Start counting ``pub``'s connections (bound on TCP ``port``), on the running loop."""
        addr = f"inproc://kvserver-pub-subscribers-{id(self):x}"
        pub.monitor(addr, WATCHED_EVENTS)
        pair: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.setsockopt(zmq.RCVHWM, 0)  # no monitor event is dropped (the loop drains them)
        pair.connect(addr)
        self._watched, self._monitor, self._port = pub, pair, port
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, pair.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # the descriptor signals changes only
        self._raw = zmq.Socket.shadow(pub.underlying)
        self._topics_timer = self._loop.call_later(TOPICS_EVERY_S, self._read_topics)

    def stop(self) -> None:
        """Stop watching and close the monitor socket (before the PUB closes). Idempotent."""
        if self._fd is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._fd = None
        if self._topics_timer is not None:
            self._topics_timer.cancel()
            self._topics_timer = None
        self._raw = None  # a shadow: the PUB itself is closed by its owner
        if self._watched is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._watched.disable_monitor()
            self._watched = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def _drain(self) -> None:
        """Read every queued monitor event, then refuse what is over the limit. Acting only
        after the queue is empty means a descriptor reported closed meanwhile is not cut."""
        pair = self._monitor
        if pair is None:
            return
        over: list[int] = []
        try:
            while cast(int, pair.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                # libzmq's own monitor (inproc, two frames): no peer writes it
                event = parse_monitor_message(pair.recv_multipart(zmq.NOBLOCK))
                fd = int(event["value"])
                self._topics.pop(fd, None)  # a new connection, or one gone: none counted
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._open.pop(fd, None)
                    with contextlib.suppress(ValueError):
                        over.remove(fd)
                elif event["event"] == zmq.EVENT_ACCEPTED:
                    if len(self._open) >= self._max:
                        self._prune()
                    found = connection(fd)
                    address = "" if found is None else found.host
                    mine = sum(a == address for a in self._open.values())
                    if len(self._open) >= self._max or mine >= self._per_address:
                        over.append(fd)
                    else:
                        self._open[fd] = address
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ETERM):
                logger.warning("KV-event PUB monitor failed: %s", exc)
        for fd in over:
            if self._shut_down(fd):
                self._counts.refused += 1
        self._counts.connected = len(self._open)

    def _read_topics(self) -> None:
        """Timer: read the subscriptions received (ZMQ applies them as they are read), count
        them per connection, and cut a connection past MAX_TOPICS."""
        raw, loop = self._raw, self._loop
        if raw is None or loop is None:
            return
        more = False
        try:
            for _ in range(TOPICS_PER_CALL):
                frame = raw.recv(zmq.NOBLOCK, copy=False)
                if frame.bytes[:1] != b"\x01":  # an unsubscription (or nothing)
                    continue
                fd = frame.get(zmq.SRCFD)
                count = self._topics[fd] = self._topics.get(fd, 0) + 1
                if count > MAX_TOPICS and self._shut_down(fd):
                    if count == MAX_TOPICS + 1:
                        self._counts.too_many_topics += 1  # (once; cut again if it goes on)
                    # each read lets ZMQ apply more of what that connection queued: read on
                    # once ZMQ's I/O thread has seen the connection end
                    break
            else:
                more = True
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                return
            logger.warning("KV-event PUB subscriptions could not be read: %s", exc)
        if more:
            self._topics_timer = loop.call_soon(self._read_topics)
        else:
            self._topics_timer = loop.call_later(TOPICS_EVERY_S, self._read_topics)

    def _prune(self) -> None:
        """Forget descriptors that are no longer connections to the PUB (a lost event); does
        nothing within PRUNE_INTERVAL_S of the last time it looked."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_INTERVAL_S:
            return
        self._pruned_at = now
        for fd in list(self._open):
            if not self._is_subscriber(fd):
                del self._open[fd]

    def _is_subscriber(self, fd: int) -> bool:
        found = connection(fd)
        return found is not None and found.local_port == self._port

    def _shut_down(self, fd: int) -> bool:
        """End the connection on ``fd`` if it still is one to the PUB; True if it was."""
        return shut_down(fd, local_port=self._port)
