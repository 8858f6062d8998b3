"""Zero-copy replies of the ZMQ front end: arena views sent as frames, under pins of our own.

Runs in the daemon process, on its event loop; used by :mod:`kvserver.daemon.zmq_server` (the
send) and :mod:`kvserver.daemon.zmq_ops` (the pin). Not thread-safe: loop only.

Call order: ``pin(ns_id, keys)`` → read the parts (``KVService.read_part``) into a
:class:`Parts` → ``send(router, ident, req_id, sid, parts)`` (non-blocking: a ROUTER send never
waits) → the pin is released once
ZMQ has finished with every frame → ``await close()`` at shutdown (cancels the watchers and
releases every pin left; the sockets close with linger 0 right after, so ZMQ drops the frames).

``get``/``read_parts`` replies reference the arena pages themselves. Large parts
(>= ``zmq.COPY_THRESHOLD``) go out as zero-copy frames under a pin (a load lease of client
``ZMQ_SEND_CLIENT``, lease ``max_lease_s``), so an eviction can never overwrite bytes still
being sent; smaller ones are copied, which is cheaper.

A client that stops reading its socket leaves its replies in ZMQ's queue, and their pins would
hold the pages for ``max_lease_s`` (DRAM no store of anyone can take), after which the lease
expired under frames still queued (their pages free to be overwritten before ZMQ wrote them).
So a zero-copy reply ZMQ has not finished with ``timeout_s`` after its send
(``zmq_send_timeout_s``, at most half of the daemon's ``max_lease_s``) cuts the connection it
goes to: its TCP socket (the request's ``zmq.SRCFD``, checked to still be the same
connection: its peer and ports, ``kvserver/foreign_sockets.py``) is shut down, libzmq drops
that connection's queued frames, and their pins end as any others do
(``num_cuts`` counts it; the client's next request reconnects). Parts read from a lower tier's
buffers (no pin: the buffers are the reply's own) are held by ZMQ the same way, so their
replies get the same timeout, under a guard of their own (negative: nothing to unpin).

The timeout bounds how long, not how much: a connection that pipelines ``get``s without
reading would pin a reply's worth of pages per request until its cut. So each ROUTER
connection (routing id) may have at most ``max_unsent`` bytes of zero-copy replies ZMQ has not
finished with (``zmq_send_max_unsent``, default a quarter of DRAM): :meth:`admit`, called
before a ``get``/``read_parts`` is carried out, refuses it with ``capacity`` ("retry later",
nothing read or pinned, counted in ``refused``) while the connection is at or past the cap with
two replies or more unsent. So one reply larger than the cap still goes out, and a client that
waits for each reply is never refused: its last reply, read already, may still count here for
a moment (its release reaches the loop from pyzmq's gc thread), but it is the only one; a
connection pins at most the cap plus two replies. Refusing, not waiting: one ROUTER socket
reads every connection, so the daemon cannot stop reading one of them (TCP's own backpressure);
waiting would mean parking that connection's requests in daemon memory, a second unbounded
queue. A client that reads its replies sees ``capacity`` only when it keeps more than the cap
outstanding; the project answers its other bounded resources (prompts waiting to be hashed, an
SSD tier's direct-serve buffers) the same way.

How the pin learns that ZMQ is done: every zero-copy frame of one reply wraps its view in a
:class:`_Held` array that references the reply's one :class:`_SendDone`. libzmq hands a frame
back (pyzmq's gc thread drops its reference) once it has written it or dropped it (a closed
socket); when the last frame of the reply is gone, ``_SendDone`` is freed and its ``__del__``
schedules the release on the loop (``call_soon_threadsafe``). One object and one wake-up per
reply instead of a ``MessageTracker`` (an Event, a Condition and a lock) per frame and a task
polling them: at 256 frames a reply that was 13 ms of CPU, now 5.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from kvserver import wire
from kvserver.daemon.owners import ZMQ_SEND_CLIENT as ZMQ_SEND_CLIENT
from kvserver.daemon.service import KVService
from kvserver.errors import CapacityError, KVServerError
from kvserver.foreign_sockets import Connection, connection, shut_down

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Parts:
    """A reply with payload: key-major parts (each a list of arena views) under a send pin
    (``guard``, 0 when nothing is pinned)."""

    result: dict[str, Any]
    parts: list[list[memoryview]]
    guard: int


class _Held(np.ndarray):
    """A zero-copy frame's bytes: an arena view that keeps its reply's :class:`_SendDone`
    alive (attribute ``done``) for as long as ZMQ holds the frame."""

    done: _SendDone | None


class _SendDone:
    """Freed when the last frame of one reply is: releases that reply's pin on the loop.

    ``__del__`` runs on whichever thread drops the last frame (pyzmq's gc thread, or the loop
    when a send fails), so it only schedules the release; a loop already closed means the
    sender's ``close()`` has released every pin."""

    __slots__ = ("_guard", "_loop", "_release")

    def __init__(self, loop: asyncio.AbstractEventLoop, release: Any, guard: int) -> None:
        self._loop = loop
        self._release = release
        self._guard = guard

    def __del__(self) -> None:
        # a closed loop raises RuntimeError: close() released the pin already
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._release, self._guard)


class ZeroCopySender:
    """Send pins and the sends they guard; see the module docstring."""

    def __init__(
        self, service: KVService, timeout_s: float = 60.0, max_unsent: int = 1 << 62
    ) -> None:
        self._service = service
        self._timeout_s = timeout_s
        self._max_unsent = max_unsent
        #: guard -> (connection, zero-copy bytes) of a reply ZMQ has not finished with
        self._unsent_of: dict[int, tuple[bytes, int]] = {}
        #: guard -> the connection (fd, as read at the send) its timer would cut
        self._targets: dict[int, tuple[int, Connection]] = {}
        #: connection (routing id) -> [its zero-copy bytes ZMQ has not finished with (> 0),
        #: the replies they are in]
        self._unsent: dict[bytes, list[int]] = {}
        #: get / read_parts refused because their connection had max_unsent bytes unsent
        self.num_refused = 0
        #: guard -> the timer that cuts its connection (None: nothing to cut, or copied); a
        #: guard < 0 is a zero-copy reply of a lower tier's buffers (nothing pinned)
        self._guards: dict[int, asyncio.TimerHandle | None] = {}
        self._last_unpinned = 0
        #: connections cut because a zero-copy reply to them was not sent within timeout_s.
        self.num_cuts = 0

    @property
    def num_pins(self) -> int:
        """Send pins held now (replies ZMQ has not finished with)."""
        return sum(guard > 0 for guard in self._guards)

    @property
    def unsent_bytes(self) -> int:
        """Bytes of zero-copy replies ZMQ has not finished with, all connections."""
        return sum(held[0] for held in self._unsent.values())

    def unsent_bytes_of(self, ident: bytes) -> int:
        """Bytes of zero-copy replies to connection ``ident`` ZMQ has not finished with."""
        held = self._unsent.get(ident)
        return held[0] if held is not None else 0

    def stats(self) -> dict[str, int]:
        """``pins``, ``unsent_bytes`` (now), ``cut_connections`` and ``refused`` (since
        start): ``stats()["zmq_sends"]``."""
        return {
            "pins": self.num_pins,
            "unsent_bytes": self.unsent_bytes,
            "cut_connections": self.num_cuts,
            "refused": self.num_refused,
        }

    def admit(self, ident: bytes) -> None:
        """Raise CapacityError (counted; nothing else changes) when connection ``ident``
        has ``max_unsent`` bytes or more of zero-copy replies unsent, in two replies or more
        (module docstring)."""
        unsent, replies = self._unsent.get(ident, (0, 0))
        if unsent >= self._max_unsent and replies > 1:
            self.num_refused += 1
            raise CapacityError(  # a fetching daemon tells it by the setting's name
                "too many reply bytes to this connection not sent yet (the client does not "
                "read its replies as fast as it asks); retry later",
                unsent_bytes=unsent,
                zmq_send_max_unsent=self._max_unsent,  # peers/zmq_windows.CAP_REFUSAL
            )

    def pin(self, ns_id: str, keys: list[bytes]) -> int:
        """Pin ``keys`` for a send; returns the guard (raises what ``prepare_load`` raises)."""
        return self.adopt(self._service.hold(ns_id, keys, client=ZMQ_SEND_CLIENT))

    def adopt(self, lease_id: int) -> int:
        """Take a load lease of ``ZMQ_SEND_CLIENT`` (``KVService.hold``/``get``) as a send
        pin; returns it as the guard (0 stays 0: nothing pinned)."""
        if lease_id:
            self._guards[lease_id] = None
        return lease_id

    def release(self, guard: int) -> None:
        """End a send pin (no-op for 0 or an unknown guard: idempotent)."""
        if guard in self._guards:
            self._forget_unsent(guard)
            self._targets.pop(guard, None)
            timer = self._guards.pop(guard)
            if timer is not None:
                timer.cancel()
            if guard < 0:  # a lower tier's buffers: nothing pinned
                return
            try:
                self._service.complete_load(guard)
            except KVServerError as exc:  # expired (a send stuck for max_lease_s) or closed
                logger.warning("send pin %d: %s", guard, exc)

    def _forget_unsent(self, guard: int) -> None:
        held = self._unsent_of.pop(guard, None)
        if held is not None:
            ident, nbytes = held
            totals = self._unsent[ident]
            if totals[1] > 1:
                totals[0] -= nbytes
                totals[1] -= 1
            else:
                del self._unsent[ident]

    def send(
        self,
        router: zmq.Socket[bytes],
        ident: bytes,
        req_id: int,
        sid: str,
        reply: Parts,
        fd: int = -1,
    ) -> None:
        """Send ``reply``: large views zero-copy, the pin released once ZMQ has finished
        with every one of them; ``fd`` (the request's ``zmq.SRCFD``, -1: unknown) is the
        connection cut if that takes longer than ``timeout_s`` (module docstring).
        REQUIRES: a running event loop."""
        out: list[Any] = []
        guard = reply.guard
        loop = asyncio.get_running_loop()
        threshold = zmq.COPY_THRESHOLD
        zero_copy = any(view.nbytes >= threshold for views in reply.parts for view in views)
        if zero_copy and not guard:  # a lower tier's buffers: held by ZMQ all the same
            self._last_unpinned -= 1
            guard = self._last_unpinned
            self._guards[guard] = None
        done = _SendDone(loop, self.release, guard) if guard else None
        unsent = 0
        for views in reply.parts:
            for view in views:
                if view.nbytes >= threshold:
                    unsent += view.nbytes
                    held = np.frombuffer(view, np.uint8).view(_Held)
                    held.done = done
                    out.append(zmq.Frame(held, copy=False))
                else:
                    out.append(bytes(view))
        header = _header(req_id, sid, reply)
        if unsent and guard in self._guards:  # (counted before the frames can be dropped)
            self._unsent_of[guard] = (ident, unsent)
            totals = self._unsent.setdefault(ident, [0, 0])
            totals[0] += unsent
            totals[1] += 1
        del done  # from here on only the frames keep it alive
        if zero_copy and guard in self._guards and fd >= 0:
            target = connection(fd)
            if target is not None:
                self._targets[guard] = (fd, target)
                self._guards[guard] = loop.call_later(
                    self._timeout_s, self._overdue, guard, fd, target
                )
        router.send_multipart([ident, header, *out], copy=False)

    def _overdue(self, guard: int, fd: int, address: Connection) -> None:
        """The reply of ``guard`` is still held ``timeout_s`` after its send: cut its
        connection, so that ZMQ drops its frames and the pin ends."""
        if guard not in self._guards:
            return
        self._guards[guard] = None
        # libzmq owns the descriptor (and closes it once its engine sees the end): cut only
        # if ``fd`` is still that connection, not a number reused since
        if shut_down(fd, same_as=address):
            self.num_cuts += 1
            target = self._targets.pop(guard, None)
            for other, its in list(self._targets.items()):  # one cut per connection
                if its == target:
                    del self._targets[other]
                    timer = self._guards[other]
                    if timer is not None:
                        timer.cancel()
                    self._guards[other] = None
            logger.warning(
                "cut the ZMQ connection of %s:%d: a reply to it was not sent within %.0f s "
                "(the client does not read its socket)",
                address.host,
                address.peer_port,
                self._timeout_s,
            )

    def copy_out(self, req_id: int, sid: str, reply: Parts) -> list[bytes]:
        """``reply`` as frames that own their bytes (header, then a copy of every view), for
        a transport that may write them later; the pin ends now."""
        try:
            return [_header(req_id, sid, reply)] + [
                bytes(view) for views in reply.parts for view in views
            ]
        finally:
            self.release(reply.guard)

    async def close(self) -> None:
        """Release every pin still held (the sockets close with linger 0 right after, so ZMQ
        drops the frames; their late ``_SendDone`` finds nothing to release). Idempotent."""
        for guard in list(self._guards):
            self.release(guard)


def _header(req_id: int, sid: str, reply: Parts) -> bytes:
    """The reply header of ``reply`` (``part_frames`` when a part spans several views)."""
    result = reply.result
    if any(len(views) != 1 for views in reply.parts):
        result["part_frames"] = [len(views) for views in reply.parts]
    return wire.encode_reply(req_id, sid, result)
