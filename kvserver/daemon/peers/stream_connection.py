"""One connection of the peer stream's fetching end: a socket to a peer's stream port and the
replies received on it.

Runs in the daemon process. A :class:`StreamConnection` is made and kept by
:class:`~kvserver.daemon.peers.stream.PeerStream` (the connections to one peer: dialling, the
hello, TLS, the idle ones) and used inside ``async with stream.connection()`` by
:class:`~kvserver.daemon.peers.fetch.PeerFetches`; its methods are called on the event loop
(loop only, not thread-safe), its transfers run in worker threads (:data:`THREADS`). It owns
its socket, the next request id and whether a call on it failed (``spoiled``). The format is
:mod:`kvserver.wire_stream`; the serving end is ``kvserver/daemon/stream_server.py``.

Call order on one connection: ``await conn.send_requests(ns_id, windows, deadline)``
(pipelined: every window asked at once) → per window, in order, ``job =
conn.start_reply(request_id, rows, ...)`` (a worker thread starts at once receiving the reply,
head and payload, into the rows given: the caller reserves the next window's pages meanwhile;
with ``early``, the loop is told once the leading rows are in, while the rest is received) then
``await job.result()`` (or ``await job.stop()`` to give it up). A call that failed spoils the
connection (:meth:`StreamConnection.spoil`): its stream closes it when it is given back, so a
half-read reply is never taken for the next.

Over TLS (``ssl`` sockets have no ``recvmsg_into``) a window is received with one
``recv_into`` per TLS record into the arena page views, in the same worker thread. Nothing is
copied here; OpenSSL decrypts each record in its own record buffer and copies the plaintext
into the view (its record layer's one copy, which kernel TLS would remove).

Every call is bounded by the caller's deadline (``poll``'s timeout before each receive,
``SO_SNDTIMEO`` per blocking send, or the TLS socket's timeout); a receive given up
(cancelled, :meth:`ReplyJob.stop`) shuts the socket down and waits for the thread, so it
writes nothing more. A peer
that closes the connection mid-reply, or whose certificate is refused, raises
:class:`~kvserver.daemon.peers.directory.PeerFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserver import wire_stream
from kvserver.daemon.peers.directory import Peer, PeerFailed
from kvserver.errors import KVServerError
from kvserver.wire_stream import TAIL_WAKE_BYTES as TAIL_WAKE_BYTES
from kvserver.wire_stream import wake_at as wake_at

#: buffers per ``recvmsg_into`` (Linux's UIO_MAXIOV).
IOV_MAX = 1024
#: a receiving thread is woken when this many bytes of its transfer are in (``SO_RCVLOWAT``),
#: not at every segment; fewer towards a reply's end (``wire_stream.wake_at``, shared with the
#: daemon's and the clients' receiving ends of client ops).
WAKE_BYTES = wire_stream.WAKE_BYTES
#: the threads that move the streams' bytes and resolve the peers' names: the streams' own, so
#: that the loop's default executor being busy (the daemon's other off-loop work, each job up
#: to its own timeout) cannot hold a receive past its deadline and make a healthy peer look
#: dead. A thread is started only when none is idle: about one per connection in use (peers x
#: ``peer_connections``), at most this many.
THREADS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="kvserver-peer-stream")


class ReplyJob:
    """One reply being received by a worker thread (:meth:`StreamConnection.start_reply`).

    :meth:`result` awaits it: (head, None) when the parts arrived, (head, error) for an error
    reply; :class:`PeerFailed` when the reply was cut short, malformed, of the wrong shape, or
    late. :meth:`stop` gives it up (the socket shut down, the thread awaited: nothing is
    written into the rows after it returns). Loop only."""

    def __init__(self, conn: StreamConnection, fut: asyncio.Future[Any]) -> None:
        self._conn = conn
        self._fut = fut

    async def result(self) -> tuple[wire_stream.ReplyHead, KVServerError | None]:
        out: tuple[wire_stream.ReplyHead, KVServerError | None] = await self._conn._wait(self._fut)
        return out

    async def stop(self) -> None:
        if not self._fut.done():
            self._conn.spoil()
            with contextlib.suppress(OSError):  # the thread's call returns at once
                socket.socket.shutdown(self._conn.sock, socket.SHUT_RDWR)
        with contextlib.suppress(BaseException):
            await self._conn._wait(self._fut)


class StreamConnection:
    """One connected socket to a peer's stream port; see the module docstring.

    The socket is blocking and every transfer runs in a worker thread (``run_in_executor``),
    bounded by a deadline (``time.monotonic()``) through ``poll``'s timeout (``SO_RCVTIMEO``
    where ``SO_RCVLOWAT`` cannot be set) / ``SO_SNDTIMEO``:
    a thread receives a whole reply, its head then its window with scattering
    ``recvmsg_into`` calls over the views of its pages (the GIL released, the kernel copying
    straight into the arena pages), where the event loop would wake up and call ``recv``
    once per socket-buffer's worth; it sleeps in ``poll`` until :data:`WAKE_BYTES` are
    unread (``SO_RCVLOWAT``; fewer towards the reply's end and when the peer owes it fewer:
    :func:`wake_at`), so that the peer's CPU, which on loopback runs this side's TCP input,
    its wake-ups and the window updates its reads send back, wakes it about once per
    :data:`WAKE_BYTES`, not at every segment. If the awaiting task is cancelled, the
    socket is shut down and the thread awaited before the cancellation goes on, so no byte
    lands in a buffer after its owner gave it up. A TLS socket (``ssl.SSLSocket``) is in
    timeout mode instead, every transfer in the thread (its calls take no flags).
    """

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.peer_id = peer.host_id
        self._next_id = 1
        self._loop = asyncio.get_running_loop()
        self.spoiled = False
        #: bytes a receive waits for before it is woken (``SO_RCVLOWAT``: :data:`WAKE_BYTES`,
        #: or less where the kernel caps it, 1: one wake-up per segment, as without it), and
        #: the socket's value now (set by the worker thread: one transfer at a time).
        self._wake = self._lowat = 1
        if not self.tls:
            self._wake = _wake_bytes(sock)

    def spoil(self) -> None:
        """A call on it failed: close it when it is given back."""
        self.spoiled = True

    def alive(self) -> bool:
        """False when the peer closed it (or sent something unasked) while it was idle."""
        try:
            if self.tls:
                if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                    return False  # decrypted bytes nobody asked for
                self.sock.settimeout(0.0)  # the raw peek below must not wait
            # the raw bytes (an SSLSocket's own recv takes no flags)
            socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    async def send_requests(
        self, ns_id: str, windows: Sequence[Sequence[bytes]], deadline: float
    ) -> list[int]:
        """Ask for every window (one write); returns their request ids, in order."""
        ids = list(range(self._next_id, self._next_id + len(windows)))
        self._next_id += len(windows)
        data = b"".join(
            wire_stream.encode_request(wire_stream.FetchRequest(i, ns_id, list(w)))
            for i, w in zip(ids, windows, strict=True)
        )
        view = memoryview(data)
        sent = self._now(view)  # usually all of it: no thread needed
        if sent < view.nbytes:
            await self._in_thread(self._send, view[sent:], deadline)
        return ids

    def start_reply(
        self,
        request_id: int,
        rows: Sequence[Sequence[memoryview]],
        tp: int,
        part_bytes: int,
        deadline: float,
        on_head: Callable[[wire_stream.ReplyHead], None],
        *,
        early: int = 0,
        on_early: Callable[[int], None] | None = None,
    ) -> ReplyJob:
        """Start receiving the reply to ``request_id`` in a worker thread (it is running when
        this returns): its head, checked (it answers ``request_id``; ok: at most
        ``len(rows)`` chunks of ``tp`` parts of ``part_bytes``), then ``on_head(head)`` called
        on the loop, then the parts of its ``count`` chunks straight into ``rows[:count]``
        (a chunk's views, rank order, ``tp * part_bytes`` bytes), or an error reply's body.
        One thread hand-over per reply, whatever its size.

        ``early`` (with ``on_early``): when the reply brings more than ``early`` chunks, the
        first ``early`` are received first and ``on_early(early)`` is called on the loop as
        soon as every byte of them has arrived, while the rest is still being received (the
        loop completes them meanwhile); it is called before the job's result is set, and never
        for a reply that brings ``early`` chunks or fewer."""
        fut = self._loop.run_in_executor(
            THREADS, self._reply, request_id, rows, tp, part_bytes, deadline, on_head, early,
            on_early,
        )  # fmt: skip
        return ReplyJob(self, fut)

    def _reply(
        self,
        request_id: int,
        rows: Sequence[Sequence[memoryview]],
        tp: int,
        part_bytes: int,
        deadline: float,
        on_head: Callable[[wire_stream.ReplyHead], None],
        early: int = 0,
        on_early: Callable[[int], None] | None = None,
    ) -> tuple[wire_stream.ReplyHead, KVServerError | None]:
        """Worker thread: :meth:`start_reply`'s receive. Raises OSError / PeerFailed."""
        raw = bytearray(wire_stream.REPLY_HEAD.size)
        self._recv([memoryview(raw)], deadline)
        try:
            head = wire_stream.decode_reply_head(raw)
        except KVServerError as exc:
            raise self._failed(f"peer stream reply malformed: {exc}", timed_out=False) from None
        if head.request_id != request_id & 0xFFFFFFFF:
            if not head.ok and head.request_id == 0:  # the connection refused (its hello)
                raise self._failed(
                    f"peer refused the stream: {self._error_body(head, deadline)}",
                    timed_out=False,
                )
            raise self._failed("peer stream reply answers another request", timed_out=False)
        if not head.ok:
            return head, self._error_body(head, deadline)
        if head.count > len(rows) or head.tp != tp or head.part_bytes != part_bytes:
            raise PeerFailed(
                "peer sent chunks of the wrong number or shape", timed_out=False,
                peer=self.peer_id, chunks=head.count, keys=len(rows), tp=head.tp,
                part_bytes=head.part_bytes,
            )  # fmt: skip
        self._loop.call_soon_threadsafe(on_head, head)
        start = 0
        if on_early is not None and 0 < early < head.count:  # the leading chunks first
            self._recv([view for row in rows[:early] for view in row], deadline)
            self._loop.call_soon_threadsafe(on_early, early)  # runs before the result is set
            start = early
        self._recv([view for row in rows[start : head.count] for view in row], deadline)
        return head, None

    def _error_body(self, head: wire_stream.ReplyHead, deadline: float) -> KVServerError:
        body = bytearray(head.count)
        self._recv([memoryview(body)], deadline)
        return wire_stream.decode_error(body)

    async def open(self, hello: bytes, deadline: float) -> None:
        """TLS only: the handshake (the peer's certificate checked), then the hello."""
        await self._in_thread(self._handshake, hello, deadline)

    def _handshake(self, hello: bytes, deadline: float) -> None:
        """Worker thread: the TLS handshake, then ``hello``. Raises OSError (ssl.SSLError)."""
        assert isinstance(self.sock, ssl.SSLSocket)
        _set_tls_timeout(self.sock, deadline)
        self.sock.do_handshake()
        self._send(memoryview(hello), deadline)

    def _now(self, view: memoryview) -> int:
        """Send from ``view`` on the loop what can be sent without waiting (plain sockets; a
        TLS one always goes to the thread)."""
        if self.tls:
            return 0
        try:
            return int(self.sock.send(view, socket.MSG_DONTWAIT))
        except BlockingIOError:
            return 0
        except OSError as exc:
            self.spoil()
            raise self._failed(f"peer stream failed: {exc}", timed_out=True) from None

    async def _in_thread(self, fn: Callable[..., None], *args: object) -> None:
        await self._wait(self._loop.run_in_executor(THREADS, fn, *args))

    async def _wait(self, fut: asyncio.Future[Any]) -> Any:
        """Await a worker thread's call on this connection (see the class docstring)."""
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.spoil()
            with contextlib.suppress(OSError):  # the thread's call returns at once
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the raw socket
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([fut])
            if not fut.cancelled():
                fut.exception()  # retrieved: given up, not "never retrieved" at its collection
            raise
        except OSError as exc:
            self.spoil()
            timed_out = isinstance(exc, (BlockingIOError, TimeoutError))
            if isinstance(exc, ssl.SSLCertVerificationError):
                what = f"refused: the peer's TLS certificate: {exc.verify_message}"
            else:
                what = "did not answer in time" if timed_out else f"failed: {exc}"
            # a TLS error other than an EOF: the peer answered, wrongly (not a peer gone)
            wrong = isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError)
            raise self._failed(f"peer stream {what}", timed_out=not wrong) from None
        except PeerFailed:
            self.spoil()
            raise

    def _recv(self, views: Sequence[memoryview], deadline: float) -> None:
        """Worker thread: fill ``views``, in order, with scattering ``recvmsg_into`` calls
        over :data:`IOV_MAX` of them at a time, each once :func:`wake_at` bytes (at most
        :data:`WAKE_BYTES`, never more than is left) are unread (``SO_RCVLOWAT`` and
        ``poll``: the thread sleeps until then, not woken at every TCP segment, and never
        waits for more than the peer still owes it);
        with TLS, ``recv_into`` per record into each view. Raises OSError / PeerFailed."""
        if self.tls:
            return self._recv_tls(views, deadline)
        sock, wake = self.sock, self._wake
        left = sum(view.nbytes for view in views)
        todo, i = list(views), 0
        while i < len(todo):
            if wake > 1:
                # woken once this many bytes are unread, not at every segment (the peer's CPU
                # pays for each wake-up): never more than is left to come (the kernel wakes
                # a reader for ``SO_RCVLOWAT`` unread bytes, a closed or stopped connection)
                lowat = wake_at(left, wake)
                if lowat != self._lowat:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                    self._lowat = lowat
                _wait_readable(sock, deadline)
                got = sock.recvmsg_into(todo[i : i + IOV_MAX], 0, socket.MSG_DONTWAIT)[0]
            else:
                _set_timeout(sock, socket.SO_RCVTIMEO, deadline)
                got = sock.recvmsg_into(todo[i : i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
            if got == 0:
                raise self._failed("peer closed the stream mid-reply", timed_out=True)
            left -= got
            i = wire_stream.advance(todo, i, got)

    def _recv_tls(self, views: Sequence[memoryview], deadline: float) -> None:
        sock = self.sock
        for view in views:
            pos, size = 0, view.nbytes
            while pos < size:
                # per record: a peer trickling records must not renew the time left
                _set_tls_timeout(sock, deadline)
                got = sock.recv_into(view[pos:])  # OpenSSL's plaintext lands in the view
                if got == 0:
                    raise self._failed("peer closed the stream mid-reply", timed_out=True)
                pos += got

    def _send(self, data: memoryview, deadline: float) -> None:
        """Worker thread: send ``data`` whole (raises OSError)."""
        if self.tls:
            _set_tls_timeout(self.sock, deadline)
            self.sock.sendall(data)
            return
        sock, pos = self.sock, 0
        while pos < data.nbytes:
            _set_timeout(sock, socket.SO_SNDTIMEO, deadline)
            pos += sock.send(data[pos:])

    def _failed(self, message: str, *, timed_out: bool) -> PeerFailed:
        return PeerFailed(message, timed_out=timed_out, peer=self.peer_id)


def _wake_bytes(sock: socket.socket) -> int:
    """The most unread bytes a receive on ``sock`` waits for before it is woken:
    :data:`WAKE_BYTES`, or the kernel's cap on ``SO_RCVLOWAT`` (half the largest receive
    buffer); 1 where it cannot be set (then every receive is one ``MSG_WAITALL`` call)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, WAKE_BYTES)
        got = int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    except OSError:
        return 1
    return max(1, min(got, WAKE_BYTES))


def _wait_readable(sock: socket.socket, deadline: float) -> None:
    """Block until ``sock`` has its ``SO_RCVLOWAT`` bytes unread (or is closed, or shut
    down); TimeoutError past ``deadline``."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        if poller.poll(max(1, math.ceil(left * 1000))):
            return


def _set_timeout(sock: socket.socket, option: int, deadline: float) -> None:
    """Bound the socket's next blocking call by ``deadline`` (TimeoutError when past)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sec = int(left)
    usec = max(1, int((left - sec) * 1e6)) if sec == 0 else int((left - sec) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec, usec))


def _set_tls_timeout(sock: socket.socket, deadline: float) -> None:
    """Bound each of a TLS socket's next calls by ``deadline`` (a ``SO_RCVTIMEO`` under
    OpenSSL would make a blocking ``SSL_read`` retry at once, forever)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
