"""The bytes under the peer stream's server end: one accepted connection, plain TCP or TLS.

Runs in the daemon process, on its event loop (loop only, not thread-safe);
``kvserver/daemon/stream_server.py`` serves each connection through one of these. Call order:
``PlainIO(sock)``, or ``await TlsIO.accept(sock, context, timeout_s)`` (the TLS handshake,
before any byte of the stream is read) → ``read`` / ``send`` in turns (one at a time: a
connection's requests are served in order) → ``linger`` after an error that ends the
stream → ``close()``.

- :class:`PlainIO`: ``loop.sock_*`` on the non-blocking socket; a reply goes out with one
  ``sendmsg`` of the arena views per :data:`IOV_MAX` of them, so the kernel's copy is the only
  one.
- :class:`TlsIO`: ``ssl`` sockets support neither ``sendmsg`` nor the loop's ``sock_*``, so
  reads (hellos and request headers: small) decrypt on the loop with the socket
  non-blocking, waiting for the descriptor to become readable (``loop.add_reader``), and a
  reply of more than :data:`SMALL_REPLY_BYTES` is sent from a worker thread (of
  :data:`SENDERS`, not the loop's default executor) that ``sendall``\\ s
  each arena view (no copy here; OpenSSL copies each 16 KiB record from the pages into its
  record buffer and encrypts it there: its record layer's one copy), and the loop serves other
  connections meanwhile. If the awaiting task is cancelled (the daemon stops), the socket is
  shut down and the thread awaited before the cancellation goes on, so no page is read after
  its pin ends.

``read_into`` fills a client put's arena views (plain: ``recvmsg_into``; TLS: ``recv_into``
per record, on the loop); ``drain`` reads and drops a refused put's payload.

Every read and send is bounded (``timeout_s``); past it, or on EOF, a reset or a TLS error,
:class:`Closed` is raised and the connection is to be closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserver import wire_stream

#: buffers per ``sendmsg`` (Linux's UIO_MAXIOV).
IOV_MAX = 1024
#: input read and dropped at most after an error that closes the connection.
LINGER_BYTES = 1 << 20
#: the scratch buffer a refused put's payload is read into and dropped.
DRAIN_BYTES = 1 << 20
#: TLS replies up to this size are encrypted on the loop (no thread hop).
SMALL_REPLY_BYTES = 64 << 10
#: the threads that send larger TLS replies: the stream's own, so that a reply never waits
#: for the loop's default executor (the daemon's other off-loop work can keep it busy past the
#: send's timeout, and the fetcher then loses the reply) and replies to slow peers (each up to
#: the timeout) do not fill it. At most one per connection (``stream_server.MAX_CONNECTIONS``).
SENDERS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="kvserver-stream-tls")


class Closed(Exception):
    """The connection ended (EOF, a timeout, an error that ends the stream)."""


class PlainIO:
    """A plain TCP connection; see the module docstring."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self._lowat = 1  # the socket's SO_RCVLOWAT

    def close(self) -> None:
        self.sock.close()

    async def read(
        self, n: int, timeout_s: float, *, at_boundary: bool = False
    ) -> bytearray | None:
        """Exactly ``n`` bytes within ``timeout_s``; None on EOF before the first byte when
        ``at_boundary`` (a clean close between requests), else :class:`Closed`."""
        loop = asyncio.get_running_loop()
        buf = bytearray(n)
        view = memoryview(buf)
        pos = 0
        try:
            async with asyncio.timeout(timeout_s):
                while pos < n:
                    got = await loop.sock_recv_into(self.sock, view[pos:])
                    if got == 0:
                        if at_boundary and pos == 0:
                            return None
                        raise Closed
                    pos += got
        except (TimeoutError, OSError):
            raise Closed from None
        return buf

    async def read_into(self, views: Sequence[memoryview], within_s: float) -> None:
        """Fill ``views``, in order (a client's put: straight into the arena pages reserved
        for it), with one scattering ``recvmsg_into`` per :data:`IOV_MAX` views of what has
        arrived; :class:`Closed` on EOF, when no byte comes for ``timeout_s``, or when it
        has not all come within ``within_s`` (the reservation's lease outlives it, so no
        byte lands in a page after it was given back)."""
        try:
            async with asyncio.timeout(within_s):
                await self._read_into(views)
        except TimeoutError:
            raise Closed from None

    async def _read_into(self, views: Sequence[memoryview]) -> None:
        loop = asyncio.get_running_loop()
        sock = self.sock
        todo = [v for v in views if v.nbytes]
        left = sum(v.nbytes for v in todo)
        i = 0
        try:
            while i < len(todo):
                try:
                    got = sock.recvmsg_into(todo[i : i + IOV_MAX])[0]
                except BlockingIOError:  # nothing unread: wait for the next bytes, woken
                    # once wake_at(left) are in (SO_RCVLOWAT), not at every segment
                    self._set_lowat(wire_stream.wake_at(left, wire_stream.WAKE_BYTES))
                    try:
                        async with asyncio.timeout(self.timeout_s):
                            got = await loop.sock_recv_into(sock, todo[i])
                    except TimeoutError:
                        # not woken: fewer than the bound came. A slow sender is not a
                        # silent one: only nothing unread after timeout_s closes
                        self._set_lowat(1)
                        got = sock.recv_into(todo[i])  # BlockingIOError: nothing came
                if got == 0:
                    raise Closed
                left -= got
                i = wire_stream.advance(todo, i, got)
        except (TimeoutError, OSError):
            raise Closed from None
        finally:
            self._set_lowat(1)  # a request's head must not wait for more than it is

    def _set_lowat(self, n: int) -> None:
        """``SO_RCVLOWAT`` = ``n`` (the kernel caps it at half its largest receive buffer)."""
        if n != self._lowat:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
                self._lowat = n

    async def drain(self, n: int, within_s: float) -> None:
        """Read and drop ``n`` bytes (a refused put's payload), as :meth:`read_into`."""
        await _drain(self, n, within_s)

    async def send(self, buffers: list[Any]) -> None:
        """Send ``buffers`` whole within the timeout, else :class:`Closed`: as much as the
        socket takes now with one ``sendmsg`` per :data:`IOV_MAX` buffers, the rest of a
        buffer it did not take with ``sock_sendall`` (which waits for room)."""
        loop = asyncio.get_running_loop()
        views = [_bytes_view(b) for b in buffers]
        try:
            async with asyncio.timeout(self.timeout_s):
                i = 0
                while i < len(views):
                    try:
                        sent = self.sock.sendmsg(views[i : i + IOV_MAX])
                    except BlockingIOError:
                        sent = 0
                    while i < len(views) and sent >= views[i].nbytes:
                        sent -= views[i].nbytes
                        i += 1
                    if i < len(views):  # the socket is full: wait for room for this one
                        await loop.sock_sendall(self.sock, views[i][sent:])
                        i += 1
        except (TimeoutError, OSError):
            raise Closed from None

    async def linger(self) -> None:
        """Before closing on an error: stop sending and read (and drop) what the peer still
        sends, at most :data:`LINGER_BYTES` within the timeout, so that closing with unread
        input does not reset the connection before the error reply is read."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        scratch = bytearray(1 << 16)
        dropped = 0
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(self.timeout_s):
                while dropped < LINGER_BYTES:
                    got = await loop.sock_recv_into(self.sock, scratch)
                    if got == 0:
                        return
                    dropped += got


async def _drain(io: PlainIO | TlsIO, n: int, within_s: float) -> None:
    scratch = memoryview(bytearray(min(n, DRAIN_BYTES)))
    try:
        async with asyncio.timeout(within_s):  # the whole payload, not each 1 MiB of it
            while n > 0:
                step = min(n, scratch.nbytes)
                await io._read_into([scratch[:step]])
                n -= step
    except TimeoutError:
        raise Closed from None


def _bytes_view(buf: Any) -> memoryview:
    """``buf`` as a flat view of bytes (an arena view already is one: no new view)."""
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1:
        return buf
    return memoryview(buf).cast("B")


class TlsIO:
    """A TLS connection (server side); see the module docstring."""

    def __init__(self, sock: ssl.SSLSocket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s

    @classmethod
    async def accept(cls, sock: socket.socket, context: ssl.SSLContext, timeout_s: float) -> TlsIO:
        """The TLS handshake on the accepted (non-blocking) ``sock`` within ``timeout_s``;
        :class:`Closed` when it fails (a plain client, an untrusted or missing client
        certificate, a timeout): the caller closes it."""
        tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        io = cls(tls, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                await io._nonblocking(tls.do_handshake)
        except (TimeoutError, OSError):
            tls.close()
            raise Closed from None
        return io

    def close(self) -> None:
        self.sock.close()

    async def read(
        self, n: int, timeout_s: float, *, at_boundary: bool = False
    ) -> bytearray | None:
        """As :meth:`PlainIO.read` (decrypted on the loop)."""
        buf = bytearray(n)
        view = memoryview(buf)
        pos = 0
        try:
            async with asyncio.timeout(timeout_s):
                while pos < n:
                    rest = view[pos:]
                    got = await self._nonblocking(lambda rest=rest: self.sock.recv_into(rest))
                    if got == 0:
                        if at_boundary and pos == 0:
                            return None
                        raise Closed
                    pos += got
        except (TimeoutError, OSError):  # ssl.SSLError (an EOF without close_notify too)
            raise Closed from None
        return buf

    async def read_into(self, views: Sequence[memoryview], within_s: float) -> None:
        """As :meth:`PlainIO.read_into`, decrypted on the loop (one ``recv_into`` per TLS
        record into the view: OpenSSL's copy of the plaintext the only one)."""
        try:
            async with asyncio.timeout(within_s):
                await self._read_into(views)
        except TimeoutError:
            raise Closed from None

    async def _read_into(self, views: Sequence[memoryview]) -> None:
        try:
            for view in views:
                pos, size = 0, view.nbytes
                while pos < size:
                    rest = view[pos:]
                    async with asyncio.timeout(self.timeout_s):
                        got = await self._nonblocking(lambda r=rest: self.sock.recv_into(r))
                    if got == 0:
                        raise Closed
                    pos += got
        except (TimeoutError, OSError):
            raise Closed from None

    async def drain(self, n: int, within_s: float) -> None:
        """As :meth:`PlainIO.drain`."""
        await _drain(self, n, within_s)

    async def send(self, buffers: list[Any]) -> None:
        """Send ``buffers`` whole within the timeout, else :class:`Closed`: encrypted on the
        loop when small, else from a worker thread (module docstring)."""
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            async with asyncio.timeout(self.timeout_s):
                if sum(v.nbytes for v in views) <= SMALL_REPLY_BYTES:
                    for view in views:
                        # no partial writes: a write that would block is retried whole
                        await self._nonblocking(lambda v=view: self.sock.sendall(v))
                else:
                    await self._in_thread(views)
        except (TimeoutError, OSError):
            raise Closed from None

    async def linger(self) -> None:
        """As :meth:`PlainIO.linger`; what arrives is dropped undecrypted."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_WR)
        scratch = bytearray(1 << 16)
        dropped = 0
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(self.timeout_s):
                while dropped < LINGER_BYTES:
                    await self._wait(writable=False)
                    got = socket.socket.recv_into(self.sock, scratch)  # the raw bytes
                    if got == 0:
                        return
                    dropped += got

    async def _nonblocking(self, call: Any) -> Any:
        """``call()`` on the non-blocking socket, again each time the descriptor is ready
        for what it wanted (``SSLWantRead`` / ``SSLWantWrite``)."""
        while True:
            try:
                return call()
            except ssl.SSLWantReadError:
                await self._wait(writable=False)
            except ssl.SSLWantWriteError:
                await self._wait(writable=True)

    async def _wait(self, *, writable: bool) -> None:
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        if writable:
            loop.add_writer(fd, wake)
        else:
            loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            if writable:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)

    async def _in_thread(self, views: list[memoryview]) -> None:
        """Send ``views`` from a worker thread with the socket in timeout mode; back to
        non-blocking after. A cancellation shuts the socket down and waits for the thread."""
        sock = self.sock

        def send_all() -> None:
            sock.settimeout(self.timeout_s)
            for view in views:
                sock.sendall(view)  # SSL_write of the view itself (no copy here)

        fut = asyncio.get_running_loop().run_in_executor(SENDERS, send_all)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # its call returns at once
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([fut])
            raise
        finally:
            if fut.done():
                with contextlib.suppress(OSError):
                    sock.setblocking(False)
