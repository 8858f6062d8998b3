"""Where the blocking client's requests go, and where its replies are matched to them.

Runs in client processes, on the thread that owns the :class:`~kvserver.client.KVClient`; not
thread-safe. :class:`Transport` owns the client's links (``links.py``: the ZMQ DEALER, and the
daemon's local channel when co-located) and the requests outstanding on them (one
:class:`Slot` each, by request id, oldest first; a submitted request's
:class:`~kvserver.client.pending.Pending` holds its slot).

Call order: ``send(call)`` → its slot → ``wait(slot, timeout)`` (or ``read_arrived()`` to route
what is already in) → the slot's outcome; ``forget(req_id)`` drops a reply to come; ``drop(why)``
closes both links and fails everything outstanding.

Which link: the local channel once it is connected, else the DEALER. A co-located session
(arena mapped, ``hello`` announced a ``local_path`` of our framing version) connects it before
a request is sent with nothing outstanding, so every outstanding request is always on the one
active link and replies cannot overtake each other across links. When the local channel fails
its outstanding requests fail with Unavailable; a request that could not be written to it (the
daemon closed it: gone, or restarting) goes to the DEALER instead, which queues it for
whichever daemon comes next, as it would have without the local channel.

A link that breaks while requests are outstanding fails them at once with Unavailable, not
at their timeout (their replies cannot come): the local channel when the daemon closes it
(EOF: the daemon exited), the DEALER when its monitor reports the connection lost
(:class:`~kvserver.client.links.ConnectionWatch`; ``wait`` polls the monitor with the DEALER,
and routes the replies that arrived before the break first). A DEALER whose connection broke
is also replaced before the next request is sent, so that request reaches a restarted daemon
at once instead of waiting for the old socket's next reconnect attempt. None is sent twice.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvserver import wire
from kvserver.client.calls import Answer, Call
from kvserver.client.common import Session
from kvserver.client.links import LocalLink, ZmqLink
from kvserver.client.replies import Oversized
from kvserver.errors import InvalidArgument, KVServerError, Unavailable

logger = logging.getLogger(__name__)

#: why the requests outstanding on a DEALER whose connection broke fail.
LOST = "the connection to the daemon was lost"


@dataclass(slots=True, eq=False)
class Slot:
    """One request outstanding on the client's current socket; ``outcome`` is set once, when
    its reply is read (an Answer or the daemon's typed error) or the socket is replaced
    (Unavailable)."""

    call: Call
    outcome: Answer | KVServerError | None = None
    sent_at: float = field(default_factory=time.monotonic)
    #: its Pending was cancelled: the reply is dropped when it comes.
    cancelled: bool = False


class Transport:
    """The links and outstanding requests of one blocking client; see the module docstring."""

    def __init__(self, session: Session, *, local: bool) -> None:
        self._s = session
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._zmq: ZmqLink | None = None
        self._local: LocalLink | None = None
        #: use the daemon's local channel when co-located (and it announces one).
        self._use_local = local
        self._local_refused: str | None = None  # a path that could not be used
        #: requests outstanding on the current link, by request id (oldest first).
        self._slots: dict[int, Slot] = {}
        #: requests sent on the wire, by op (session renewals and retries included).
        self.sent_by_op: Counter[str] = Counter()

    @property
    def is_local(self) -> bool:
        return self._local is not None

    def drop(self, why: str = "the connection was reset") -> None:
        """Close both links; every request outstanding fails with Unavailable."""
        for link in (self._zmq, self._local):
            if link is not None:
                link.close()
        self._zmq = self._local = None
        self._fail_outstanding(why)

    def _fail_outstanding(self, why: str) -> None:
        slots, self._slots = self._slots, {}
        for slot in slots.values():
            slot.outcome = Unavailable(f"{why} before a reply from {self._s.address}",
                                       op=slot.call.op)  # fmt: skip

    def _lose_local(self, why: str) -> None:
        """The local channel failed: every request outstanding on it fails with Unavailable
        (what the daemon did with it is unknown). The next request connects again, or goes
        to ZMQ if that fails (the daemon is gone: a DEALER queues it for the next one, whose
        new session id renews the session)."""
        if self._local is not None:
            self._local.close()
            self._local = None
        self._fail_outstanding(f"the local channel failed ({why})")

    def _link(self, timeout: float) -> ZmqLink | LocalLink:
        """The link of the next request: the local channel once connected, else the DEALER.
        Every outstanding request is on this link (switching waits until none is)."""
        if self._local is None and self._use_local and not self._slots:
            self._connect_local(timeout)
        if self._local is not None:
            return self._local
        if self._zmq is not None and self._zmq.broke():
            # the daemon went away (exited, restarting): a new socket connects at once,
            # where this one would retry on its own, ever more slowly (links.ConnectionWatch)
            self.drop(LOST)
        if self._zmq is None:
            s = self._s
            self._zmq = ZmqLink(self._ctx, s.address, s.curve, s.handshake_token())
        return self._zmq

    def _connect_local(self, timeout: float) -> None:
        path = self._s.local_path(self._local_refused)
        if path is None:
            return
        try:
            self._local = LocalLink.connect(path, timeout, self._s.max_message_bytes)
        except OSError as exc:
            logger.info("cannot use the local channel %s (%s); using ZMQ", path, exc)
            self._local_refused = path

    def send(self, call: Call, timeout: float) -> tuple[int, Slot]:
        """Send ``call`` without waiting (``timeout``: for writing it and connecting); its
        reply will land in the returned slot."""
        link = self._link(timeout)  # first: a new DEALER reads the token the header carries
        req_id, frames = self._s.encode(call)
        try:
            link.send(frames, timeout)
        except OSError as exc:
            if isinstance(link, ZmqLink):
                # the DEALER's queue is full, or its handshake failed before this write and
                # ZMQ let the connection go: that failure is the error (read before the close)
                why = link.why_silent()
                self.drop()
                raise self._s.timed_out(call, timeout, why) from None
            # nothing of it was read: the daemon closed the channel (it is gone or
            # restarting). As a DEALER would, queue it for whichever daemon comes next.
            self._local_refused = self._s.server.get("local_path")
            self._lose_local(str(exc))
            return self.send(call, timeout)
        self.sent_by_op[call.op] += 1
        slot = self._slots[req_id] = Slot(call)
        return req_id, slot

    def wait(self, slot: Slot, timeout: float) -> Answer:
        """Read replies until ``slot`` has its outcome, for at most ``timeout`` seconds;
        returns its Answer or raises its error. A timeout replaces both links; so does a
        DEALER whose connection broke meanwhile, at once (``slot`` fails with Unavailable:
        its reply cannot come), and a local channel the daemon closed (EOF)."""
        deadline = time.monotonic() + timeout
        while slot.outcome is None:
            link = self._local or self._zmq
            if link is None:  # cannot happen: dropping the links sets every outcome
                raise Unavailable("the socket is gone", op=slot.call.op)
            remaining = deadline - time.monotonic()
            if not link.ready() and (remaining <= 0 or not link.wait(remaining)):
                if isinstance(link, ZmqLink) and link.broke():
                    # no reply can come any more: fail now, not at the timeout (what arrived
                    # before the break is routed first)
                    if not link.ready():
                        self.drop(LOST)
                    continue
                why = link.why_silent() if isinstance(link, ZmqLink) else None
                error = self._s.timed_out(slot.call, timeout, why)
                self.drop(f"an earlier call timed out ({slot.call.op})")
                raise error
            self._read_one(link, max(remaining, 1e-3))
        if isinstance(slot.outcome, KVServerError):
            raise slot.outcome
        return slot.outcome

    def _read_one(self, link: ZmqLink | LocalLink, timeout: float) -> None:
        """One reply of ``link``, its header decoded once: for its budget and its routing."""
        try:
            if isinstance(link, ZmqLink):
                header = link.recv_header()
                reply = self._s.decode([header])
                received = link.recv_rest(header, self._budget(reply))
                if isinstance(received, Oversized):
                    self._refuse(reply, received)
                    return
                frames: Sequence[Any] = received
            else:
                frames = link.recv(timeout)
                reply = self._s.decode(frames)
        except OSError as exc:  # the local channel (closed, timed out)
            self._lose_local(str(exc))
            return
        except InvalidArgument as exc:  # the local channel: a reply past the daemon's bound
            self._refuse_local(exc)
            return
        except zmq.ZMQError as exc:  # the DEALER: what is outstanding on it fails at once
            self.drop(f"the connection failed ({type(exc).__name__}: {exc})")
            return
        self._route(reply, frames)

    def _budget(self, reply: wire.Reply | None) -> int:
        """The payload frames ``reply`` may carry: what its request may bring back (none for
        an error, an unreadable header, or a reply to no request outstanding)."""
        slot = self._slots.get(reply.req_id) if reply is not None and reply.ok else None
        return slot.call.reply_frames if slot is not None else 0

    def _refuse(self, reply: wire.Reply | None, over: Oversized) -> None:
        """``reply`` came with more frames than its request may bring back: its request fails
        with ``over.error()``, and the DEALER is faulty: both links are replaced, the other
        requests outstanding fail with Unavailable."""
        slot = self._slots.pop(reply.req_id, None) if reply is not None else None
        error = over.error()
        logger.warning("refusing a reply from %s: %s", self._s.address, error)
        if slot is not None:
            slot.outcome = error
        self.drop(f"the daemon sent a reply past its request's frames ({error})")

    def _refuse_local(self, error: InvalidArgument) -> None:
        """The local channel announced a reply past its bound (``LocalLink.recv``): the
        oldest request outstanding (replies come in request order) fails with ``error``,
        the link is closed (the next request connects a new one), the others fail with
        Unavailable."""
        logger.warning("refusing a reply from %s: %s", self._s.address, error)
        if self._slots:
            self._slots.pop(next(iter(self._slots))).outcome = error
        self._lose_local(f"the daemon sent a reply past its bound ({error})")

    def _route(self, reply: wire.Reply | None, frames: Sequence[Any]) -> None:
        """Hand one reply (its header decoded: ``reply``, None when unreadable) to the slot of
        its request; stale and unreadable ones are dropped."""
        if reply is None:
            return
        req_id = reply.req_id
        if req_id == 0 and not reply.ok and self._slots:
            # the daemon could not read a header: replies come in request order, so it is the
            # oldest request still outstanding
            req_id = next(iter(self._slots))
        slot = self._slots.pop(req_id, None)
        if slot is None or slot.cancelled:
            logger.debug("discarding stale reply %d", reply.req_id)
            return
        slot.outcome = self._s.outcome(reply, frames)

    def read_arrived(self, timeout: float) -> None:
        """Route every reply already received (``timeout``: for the rest of one that is
        partly in)."""
        link = self._local or self._zmq
        while link is not None and self._slots and link.ready():
            self._read_one(link, timeout)
            link = self._local or self._zmq

    def forget(self, req_id: int) -> None:
        """Its reply will be dropped (kept in order until then: see the id 0 rule)."""
        if (slot := self._slots.get(req_id)) is not None:
            slot.cancelled = True
