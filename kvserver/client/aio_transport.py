"""Where the asyncio client's requests go, and where its replies are matched to them.

Runs in client processes, on the event loop that owns the
:class:`~kvserver.client.AsyncKVClient`; not thread-safe. The asyncio twin of
:mod:`kvserver.client.transport`, with the same rules: the links are the ZMQ DEALER and, when
co-located, the daemon's local channel (a Unix socket, framed by :mod:`kvserver.wire_local`);
the local channel is connected only while nothing is outstanding, so every outstanding request
is on the one active link; replies are matched to requests by id (id 0: the oldest), so any
number of requests may be in flight (pipelining: concurrent tasks, or ``submit_*``).

Call order: ``await send(call, timeout)`` → its :class:`AioSlot` → ``await wait(slot,
timeout)``; ``drop(why)`` closes both links and fails everything outstanding. One reader task
per link routes every reply to its slot's future. A timeout replaces both links (every request
outstanding fails with Unavailable); a failed local channel (EOF: the daemon exited) fails what
is outstanding on it at once, and a request that could not be written to it goes to the DEALER
instead. The DEALER's monitor (:class:`~kvserver.client.links.ConnectionWatch`) is watched by
the event loop (a reader on its file descriptor, no task): when the connection breaks, the
requests outstanding on the DEALER fail at once with Unavailable (the replies received before
the break are routed first) and the socket is replaced; so is a DEALER whose connection broke
while nothing was outstanding, before the next request is sent. A failed security handshake
fails them at once too, with its reason (``kvserver/client/handshake.py``; Unauthenticated when
the daemon refused the token). A request the DEALER refuses (ZMQ's EAGAIN: its queue holds
SNDHWM requests no daemon has taken, or its handshake failed before the write and ZMQ let the
connection go) fails at the send, with the handshake's reason when there is one, and both links
are replaced (the requests outstanding fail with Unavailable). None is sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.asyncio

from kvserver import wire, wire_local
from kvserver.client import replies
from kvserver.client.calls import Answer, Call
from kvserver.client.common import DEFAULT_MAX_MESSAGE_BYTES, Session
from kvserver.client.links import ConnectionWatch, open_dealer
from kvserver.errors import InvalidArgument, KVServerError, Unavailable

logger = logging.getLogger(__name__)

#: why the requests outstanding on a DEALER whose connection broke fail.
LOST = "the connection to the daemon was lost"


@dataclass(slots=True, eq=False)
class AioSlot:
    """One request outstanding; its future gets the Answer or the typed error."""

    call: Call
    future: asyncio.Future[Answer]
    sent_at: float = field(default_factory=time.monotonic)
    #: nobody waits for it any more: the reply is dropped when it comes.
    cancelled: bool = False


class AioLocalLink:
    """One connection to the daemon's local channel (asyncio streams)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        max_frame: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._reader, self._writer = reader, writer
        #: the largest frame of a reply taken (the daemon's ``max_message_bytes``, or the
        #: client's ``max_frame_bytes`` when smaller)
        self._max_frame = max_frame

    @classmethod
    async def connect(
        cls, path: str, timeout: float, max_frame: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> AioLocalLink:
        """Connect to ``path``; its replies' frames at most ``max_frame`` bytes. Raises OSError
        (no daemon there, no permission, timeout)."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
        return cls(reader, writer, max_frame)

    async def send(self, frames: Sequence[Any], timeout: float) -> None:
        self._writer.writelines(wire_local.encode(frames))
        await asyncio.wait_for(self._writer.drain(), max(timeout, 1e-3))

    async def recv(self) -> list[memoryview]:
        """One whole message. Raises OSError (EOF included); InvalidArgument when its framing
        announces more than its frame count times ``max_frame`` bytes, or a frame over
        ``max_frame`` bytes, before those bytes are taken (``LocalLink.recv``'s bound). After
        either the link is unusable: close it."""
        size_len, count_len = wire_local.SIZE.size, wire_local.COUNT.size
        try:
            head = await self._reader.readexactly(size_len + count_len)
            (size,) = wire_local.SIZE.unpack_from(head)
            (count,) = wire_local.COUNT.unpack_from(head, size_len)
            if not 1 <= count <= wire_local.MAX_FRAMES or size < wire_local.overhead(count):
                raise ConnectionResetError(f"unreadable local message: bad frame count ({count})")
            if size > wire_local.overhead(count) + count * self._max_frame:
                raise _too_large(size, count, self._max_frame)
            lengths = struct.unpack(f">{count}Q", await self._reader.readexactly(8 * count))
            if max(lengths) > self._max_frame:
                raise _too_large(size, count, self._max_frame)
            frames = await self._reader.readexactly(size - wire_local.overhead(count))
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("the daemon closed the local channel") from None
        try:
            return wire_local.split_frames(lengths, memoryview(frames))
        except InvalidArgument as exc:
            raise ConnectionResetError(f"unreadable local message: {exc}") from None

    def close(self) -> None:
        self._writer.close()


class AioTransport:
    """The links and outstanding requests of one asyncio client; see the module docstring."""

    def __init__(self, session: Session, *, local: bool, max_frame_bytes: int = 0) -> None:
        self._s = session
        self._max_frame = max_frame_bytes
        self._ctx = zmq.asyncio.Context.instance()
        self._zmq: zmq.asyncio.Socket | None = None
        self._watch: ConnectionWatch | None = None
        self._local: AioLocalLink | None = None
        self._use_local = local
        self._local_refused: str | None = None
        #: close() was called: no request is sent, no link opened again
        self._closed = False
        self._slots: dict[int, AioSlot] = {}
        self._readers: dict[object, asyncio.Task[None]] = {}
        #: the DEALER's connection broke with requests outstanding (see _fail_if_broken).
        self._broken = False
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._watch_fd = -1
        #: the DEALER reader's receive, once done until the reader has routed its reply.
        self._zmq_recv: asyncio.Future[Any] | None = None
        #: the DEALER and a plain socket on its handle (``_zmq_sync``).
        self._zmq_plain: tuple[zmq.asyncio.Socket, zmq.Socket[Any]] | None = None
        self._send_lock = asyncio.Lock()
        #: requests sent on the wire, by op (session renewals and retries included).
        self.sent_by_op: Counter[str] = Counter()

    @property
    def is_local(self) -> bool:
        return self._local is not None

    @property
    def outstanding(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._slots)

    def drop(self, why: str = "the connection was reset") -> None:
        """Close both links; every request outstanding fails with Unavailable."""
        for task in self._readers.values():
            task.cancel()
        self._readers.clear()
        if self._local is not None:
            self._local.close()
        self._close_dealer()
        self._local = None
        self._fail_outstanding(why)

    def _close_dealer(self) -> None:
        """Close the DEALER and its watch (the caller fails what is outstanding on it)."""
        if self._watch is not None:
            if self._watch_loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self._watch_loop.remove_reader(self._watch_fd)
            self._watch.close()
        if self._zmq is not None:
            task = self._readers.pop(self._zmq, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()
            self._zmq.close(linger=0)
        self._zmq = self._watch = self._zmq_recv = self._zmq_plain = None
        self._broken = False

    async def close(self, why: str) -> None:
        self._closed = True
        tasks = list(self._readers.values())
        self.drop(why)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _fail_outstanding(self, why: str) -> None:
        slots, self._slots = self._slots, {}
        for slot in slots.values():
            if not slot.future.done() and not slot.cancelled:
                error = Unavailable(f"{why} before a reply from {self._s.address}", op=slot.call.op)
                slot.future.set_exception(error)

    def _lose_local(self, why: str) -> None:
        if self._local is not None:
            self._readers.pop(self._local, None)
            self._local.close()
            self._local = None
        self._fail_outstanding(f"the local channel failed ({why})")

    async def _connect_local(self, timeout: float) -> None:
        path = self._s.local_path(self._local_refused)
        if path is None:
            return
        try:
            max_frame = self._s.max_message_bytes
            if self._max_frame > 0:
                max_frame = min(max_frame, self._max_frame)
            self._local = await AioLocalLink.connect(path, timeout, max_frame)
        except (TimeoutError, OSError) as exc:
            logger.info("cannot use the local channel %s (%s); using ZMQ", path, exc)
            self._local_refused = path

    def _dealer(self, sending: int | None = None) -> zmq.asyncio.Socket:
        """The DEALER of request ``sending`` (None: of the one about to be encoded): a new one
        when the connection was lost (the daemon went away), failing the other requests
        outstanding on the old one (the sync twin: ``Transport._link``)."""
        if self._watch is not None and self._watch.broke():
            slot = self._slots.pop(sending) if sending is not None else None
            self.drop(LOST)
            if sending is not None and slot is not None:
                self._slots[sending] = slot
        if self._zmq is None:
            s = self._s
            self._zmq, self._watch = open_dealer(
                self._ctx, s.address, s.curve, s.handshake_token(), self._max_frame
            )
            self._watch_fd = cast(int, self._watch.fd.get(zmq.FD))
            self._watch_loop = asyncio.get_running_loop()
            self._watch_loop.add_reader(self._watch_fd, self._on_watch_event)
            # ZMQ's descriptor signals changes only: read what came before the reader was added
            self._watch_loop.call_soon(self._on_watch_event)
        return self._zmq

    def _on_watch_event(self) -> None:
        """The DEALER's monitor socket signalled (the event loop's reader callback): when the
        connection broke, or its security handshake failed (nothing sent on it can be
        delivered: it would only retry and fail again), and requests are outstanding on the
        DEALER, fail them now (a failed handshake with its reason, as a timeout would)."""
        watch = self._watch
        if watch is None:
            return
        # read every event now, whatever follows: the descriptor signals again only after that
        broke = watch.broke()
        if self._local is not None or not self._slots:
            return  # (a broken DEALER with nothing on it is replaced at the next send)
        if broke:
            self._broken = True
            self._fail_if_broken()
            return
        why = watch.failure()
        if why is None:
            return
        self._close_dealer()
        slots, self._slots = self._slots, {}
        for slot in slots.values():
            if not slot.future.done() and not slot.cancelled:
                slot.future.set_exception(self._s.timed_out(slot.call, 0.0, why))

    def _fail_if_broken(self) -> None:
        """The DEALER's connection broke: once the replies received before the break are
        routed (its reader task routes them, then calls this again), fail the rest."""
        sock, received = self._zmq, self._zmq_recv
        if sock is None or (received is not None and received.done()):
            return
        if cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            return  # (get: zmq.asyncio then wakes the reader for what is waiting)
        logger.info("the connection to %s was lost", self._s.address)
        self._close_dealer()
        self._fail_outstanding(LOST)

    async def send(self, call: Call, timeout: float) -> AioSlot:
        """Send ``call`` without waiting for its reply; the reply will land in the slot.
        Unavailable once the transport is closed (a socket opened then would never be)."""
        if self._closed:
            raise Unavailable(f"the client of {self._s.address} was closed", op=call.op)
        async with self._send_lock:  # requests leave in the order they were sent
            if self._local is None and self._use_local and not self._slots:
                await self._connect_local(timeout)
            # the DEALER first: a new one reads the token file, whose token the header carries
            dealer = self._dealer() if self._local is None else None
            req_id, frames = self._s.encode(call)
            slot = self._slots[req_id] = AioSlot(call, asyncio.get_running_loop().create_future())
            local = self._local
            if local is not None:
                try:
                    await local.send(frames, timeout)
                except (TimeoutError, OSError) as exc:
                    # the daemon closed the channel: as a DEALER would, queue it for the next
                    self._slots.pop(req_id, None)
                    self._local_refused = self._s.server.get("local_path")
                    self._lose_local(str(exc))
                    self._slots[req_id] = slot
                    local = None
            if local is None:
                sock = dealer if dealer is not None else self._dealer(req_id)
                try:
                    # zmq.asyncio reports a write ZMQ refuses (EAGAIN) in the future it
                    # returns, done at once (nothing here waits to send), never by raising
                    await sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    # the DEALER's queue is full (no daemon has taken it for SNDHWM requests),
                    # or its handshake failed before this write and ZMQ let the connection go:
                    # that failure is the error (read before the close), as in the sync client
                    why = self._watch.why_silent() if self._watch is not None else None
                    self._slots.pop(req_id, None)
                    self.drop()
                    raise self._s.timed_out(call, timeout, why) from None
            self.sent_by_op[call.op] += 1
            link: object = local if local is not None else self._zmq
            if link not in self._readers:
                self._readers[link] = asyncio.ensure_future(self._read_loop(link))
            return slot

    async def wait(self, slot: AioSlot, timeout: float) -> Answer:
        """The slot's Answer (or its error), within ``timeout`` seconds; a timeout replaces
        both links and fails everything outstanding."""
        try:
            return await asyncio.wait_for(asyncio.shield(slot.future), timeout)
        except TimeoutError:
            if slot.future.done():
                return slot.future.result()
            why = self._watch.why_silent() if self._watch is not None else None
            error = self._s.timed_out(slot.call, timeout, why)
            slot.cancelled = True  # its future is never awaited again
            self.drop(f"an earlier call timed out ({slot.call.op})")
            raise error from None
        except asyncio.CancelledError:
            slot.cancelled = True
            raise

    async def _read_loop(self, link: object) -> None:
        """Route every reply of ``link`` until it fails or is dropped. Any failure (OSError of
        the local channel, ZMQError of the DEALER, anything unexpected) ends the link: every
        request outstanding on it fails at once with Unavailable naming the cause, instead
        of waiting for its timeout; the next request opens a new link."""
        while True:
            try:
                if isinstance(link, AioLocalLink):
                    frames: Sequence[Any] = await link.recv()
                    reply = self._s.decode(frames)
                else:
                    assert isinstance(link, zmq.asyncio.Socket)
                    received = self._zmq_recv = cast("asyncio.Future[Any]", link.recv(copy=False))
                    header = await received
                    reply = self._s.decode([header])  # once: for its budget and its routing
                    # the rest of the message is queued with it: taken without waiting
                    whole = replies.receive(self._zmq_sync(link), header, self._budget(reply))
                    self._zmq_recv = None
                    if isinstance(whole, replies.Oversized):
                        self._refuse(reply, whole)
                        return
                    frames = whole
                self._route(reply, frames)
                if self._broken:
                    self._fail_if_broken()
                    if link is not self._zmq:
                        return  # it was closed: what was outstanding on it failed
            except asyncio.CancelledError:
                raise
            except InvalidArgument as exc:
                if link is not self._local:
                    self._link_failed(link, exc)
                else:  # the local channel: a reply past the daemon's bound
                    self._refuse_local(exc)
                return
            except Exception as exc:
                self._link_failed(link, exc)
                return

    def _link_failed(self, link: object, exc: Exception) -> None:
        """``link``'s reader failed with ``exc``: close the link and fail what is outstanding
        on it (every outstanding request is on the active link)."""
        why = f"{type(exc).__name__}: {exc}"
        if link is self._local:
            self._lose_local(why)
        elif link is self._zmq and self._zmq is not None:
            logger.warning("the connection to %s failed (%s)", self._s.address, why)
            self._close_dealer()
            self._fail_outstanding(f"the connection failed ({why})")

    def _refuse_local(self, error: InvalidArgument) -> None:
        """The local channel announced a reply past its bound (``AioLocalLink.recv``): the
        oldest request outstanding (replies come in request order) fails with ``error``, the
        link is closed (the next request connects a new one), the others fail with
        Unavailable."""
        logger.warning("refusing a reply from %s: %s", self._s.address, error)
        if self._slots:
            slot = self._slots.pop(next(iter(self._slots)))
            if not slot.future.done() and not slot.cancelled:
                slot.future.set_exception(error)
        self._lose_local(f"the daemon sent a reply past its bound ({error})")

    def _zmq_sync(self, sock: zmq.asyncio.Socket) -> zmq.Socket[Any]:
        """A plain (blocking-API) socket on ``sock``'s handle, for non-blocking receives."""
        if self._zmq_plain is None or self._zmq_plain[0] is not sock:
            self._zmq_plain = (sock, zmq.Socket.shadow(sock.underlying))
        return self._zmq_plain[1]

    def _budget(self, reply: wire.Reply | None) -> int:
        """The payload frames ``reply`` may carry: what its request may bring back (none for
        an error, an unreadable header, or a reply to no request outstanding)."""
        slot = self._slots.get(reply.req_id) if reply is not None and reply.ok else None
        return slot.call.reply_frames if slot is not None else 0

    def _refuse(self, reply: wire.Reply | None, over: replies.Oversized) -> None:
        """``reply`` came with more frames than its request may bring back: its request fails
        with ``over.error()``; the DEALER is faulty: closed, the other requests outstanding on
        it fail with Unavailable (the next request opens a new one)."""
        slot = self._slots.pop(reply.req_id, None) if reply is not None else None
        error = over.error()
        logger.warning("refusing a reply from %s: %s", self._s.address, error)
        if slot is not None and not slot.future.done() and not slot.cancelled:
            slot.future.set_exception(error)
        self._close_dealer()
        self._fail_outstanding(f"the daemon sent a reply past its request's frames ({error})")

    def _route(self, reply: wire.Reply | None, frames: Sequence[Any]) -> None:
        """Hand one reply (its header decoded: ``reply``, None when unreadable) to its
        request; stale and unreadable ones are dropped."""
        if reply is None:
            return
        req_id = reply.req_id
        if req_id == 0 and not reply.ok and self._slots:
            req_id = next(iter(self._slots))  # replies come in request order: the oldest
        slot = self._slots.pop(req_id, None)
        if slot is None or slot.cancelled or slot.future.done():
            logger.debug("discarding stale reply %d", reply.req_id)
            return
        outcome = self._s.outcome(reply, frames)
        if isinstance(outcome, KVServerError):
            slot.future.set_exception(outcome)
        else:
            slot.future.set_result(outcome)


def _too_large(size: int, count: int, max_frame: int) -> InvalidArgument:
    return InvalidArgument(
        "local reply announces frames larger than the daemon's max_message_bytes",
        size=size, frames=count, max_frame_bytes=max_frame,
    )  # fmt: skip
