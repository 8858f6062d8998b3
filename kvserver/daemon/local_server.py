"""The local channel: the data plane on a Unix-domain stream socket, for clients on this host.

Runs in the daemon process, on its event loop, owned by the ZMQ front end
(:mod:`kvserver.daemon.zmq_server`), which serves its connections exactly as it serves ROUTER
connections: same messages, same handlers, requests of one connection in arrival order, one
reply each (``docs/wire.md`` §1, "Local channel"). Not thread-safe: loop only.

Why it exists: a co-located client's batch costs four round trips. Over ZMQ each one wakes six
threads (client, its ZMQ I/O thread, the daemon's I/O thread, the daemon's loop, and back) and
runs libzmq in both processes; on a small VM that is ~250 µs per round trip once a large copy
has evicted everything from the caches. A Unix socket wakes the two threads that do the work.

Call order: ``LocalListener(path, deliver, max_size)`` → ``await start()`` (binds ``path``,
mode 0600: only the daemon's user can connect, as only it can map the arena) → the loop calls
``deliver(connection, message)`` for every complete message of every connection, in order;
``message`` is the body after the size field (:func:`kvserver.wire_local.decode` splits it) or
:class:`Refused` → the front end answers with ``connection.send(frames)`` → ``await stop()``
(closes every connection, removes ``path``).

Reception: a connection reads into a fixed buffer and copies each complete message out of it
(a message larger than the buffer is received into a buffer of its own); while its replies wait
in the transport above the high-water mark, it stops reading (backpressure: a client that does
not read its replies cannot grow the daemon's memory).

Memory is bounded whatever a peer announces: a message's own buffer is only started once the
fixed buffer is full of it, and grows (doubling, at most to the announced size) as its bytes
arrive, never ahead of them; every byte of those buffers is taken from one
:class:`InflightBudget` shared by the listener's connections (``max_inflight`` bytes in all).
A message that would exceed the budget, or whose size field exceeds the per-message limit, is
refused (:class:`Refused`, answered, then the connection closes: the stream cannot be
resynchronized). The listener holds at most ``max_connections`` connections; one more is closed
at once. An idle connection thus costs its fixed buffer (:data:`RECV_BUFFER`) and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvserver import wire_local
from kvserver.daemon.local_exits import peer_pidfd
from kvserver.errors import CapacityError, InvalidArgument, KVServerError

logger = logging.getLogger(__name__)

RECV_BUFFER = 256 << 10
#: write-buffer high-water mark of a connection's transport. 0: every reply is written at once
#: (uvloop otherwise queues writes below the mark until the end of the loop iteration, behind
#: whatever else is ready, e.g. the KV-event publisher), and a connection whose replies the
#: kernel cannot take stops being read until they are written.
WRITE_HIGH_WATER = 0
#: longest path a Unix socket can be bound to (sun_path is 108 bytes with its NUL).
MAX_PATH_BYTES = 107
#: default bound on the connections of one listener.
MAX_CONNECTIONS = 256


class Refused:
    """A message that cannot be received (its size field exceeds the limit, or its buffer the
    in-flight budget): ``error`` is answered, then the connection closes."""

    def __init__(self, error: KVServerError) -> None:
        self.error = error


class InflightBudget:
    """Bytes of message buffers all connections of a listener may hold at once.

    Invariant: ``0 <= used <= limit``; ``take`` either takes all of ``n`` or nothing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class LocalFrame:
    """One frame of a local message, shaped like ``zmq.Frame`` for the handlers."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer

    def __len__(self) -> int:
        return self.buffer.nbytes


LocalMessage = memoryview | Refused
Deliver = Callable[["LocalConnection", LocalMessage], None]


class LocalConnection(asyncio.BufferedProtocol):
    """One client connection; see the module docstring."""

    def __init__(
        self,
        name: str,
        deliver: Deliver,
        max_size: int,
        forget: Callable[[LocalConnection], None] | None = None,
        budget: InflightBudget | None = None,
    ) -> None:
        self.name = name
        self._deliver = deliver
        self._max_size = max_size
        self._forget = forget
        self._budget = budget if budget is not None else InflightBudget(max_size)
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unparsed bytes: _buf[_start:_end]
        #: a message larger than _buf, being received: _big[:_big_pos] of _big_size bytes;
        #: len(_big) bytes are taken from the budget.
        self._big: memoryview | None = None
        self._big_pos = 0
        self._big_size = 0
        self._failed = False  # a Refused was delivered: read nothing more
        self._write_paused = False  # replies wait in the transport: handle nothing more
        #: a pidfd of the client's process (``local_exits.py``), until :meth:`take_pidfd`
        self._pidfd: int | None = None

    @property
    def closed(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def take_pidfd(self) -> int | None:
        """The pidfd of the client's process (None if unknown), now the caller's to close."""
        pidfd, self._pidfd = self._pidfd, None
        return pidfd

    # ------------------------------------------------------------------ protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=0)
        self._pidfd = peer_pidfd(transport.get_extra_info("socket"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._drop_big()
        if self._forget is not None:
            self._forget(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._failed:
            self._transport.resume_reading()
            self._parse()  # messages received before the pause

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return self._big[self._big_pos :]
        if self._end == len(self._buf):  # full: move the unparsed tail to the front
            n = self._end - self._start
            self._buf[:n] = bytes(self._view[self._start : self._end])  # they may overlap
            self._start, self._end = 0, n
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._failed or self.closed:
            return
        if self._big is not None:
            self._big_pos += nbytes
            if self._big_pos == self._big_size:
                body = self._big
                self._drop_big()
                self._deliver(self, body)
            elif self._big_pos == self._big.nbytes:
                self._grow(self._big[: self._big_pos])
            return
        self._end += nbytes
        self._parse()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    # ------------------------------------------------------------------ messages

    def _parse(self) -> None:
        size_len = wire_local.SIZE.size
        while not (self._failed or self._write_paused) and self._end - self._start >= size_len:
            start = self._start
            (size,) = wire_local.SIZE.unpack_from(self._buf, start)
            if size > self._max_size:
                error = InvalidArgument("message too large", size=size, max=self._max_size)
                self._fail(Refused(error))
                return
            have = self._end - start - size_len
            if have >= size:
                body = bytes(self._view[start + size_len : start + size_len + size])
                self._start = start + size_len + size
                self._deliver(self, memoryview(body))
            elif size_len + size > len(self._buf) and self._end == len(self._buf):
                # the buffer is full of the start of a larger message: a buffer of its own
                self._big_size = size
                self._start = self._end = 0
                self._grow(self._view[start + size_len :])
                return
            else:
                break  # wait for more (get_buffer moves the tail to the front when full)
        if self._start == self._end:
            self._start = self._end = 0

    def _grow(self, have: memoryview) -> None:
        """Continue the large message in a buffer twice the size of ``have`` (its bytes so far),
        at most its announced size, taken from the budget; refuse it when the budget is out."""
        cap = min(self._big_size, max(2 * have.nbytes, RECV_BUFFER))
        old = self._big.nbytes if self._big is not None else 0
        if not self._budget.take(cap - old):
            self._drop_big()
            error = CapacityError(
                "local channel: in-flight message buffers exhausted; retry later",
                limit=self._budget.limit,
            )
            self._fail(Refused(error))
            return
        big = memoryview(bytearray(cap))
        big[: have.nbytes] = have
        self._big, self._big_pos = big, have.nbytes

    def _drop_big(self) -> None:
        if self._big is not None:
            self._budget.give(self._big.nbytes)
            self._big = None

    def _fail(self, why: Refused) -> None:
        self._failed = True
        self._start = self._end = 0
        if self._transport is not None:
            self._transport.pause_reading()
        self._deliver(self, why)

    def send(self, frames: Sequence[Any]) -> None:
        """Queue one reply (never blocks). The buffers are referenced until written: pass
        nothing that may change meanwhile. No-op once the connection is closed."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.writelines(wire_local.encode(frames))

    def close(self) -> None:
        """Close after the queued replies are written."""
        if self._transport is not None:
            self._transport.close()


class LocalListener:
    """The listening socket and its connections; see the module docstring."""

    def __init__(
        self,
        path: str,
        deliver: Deliver,
        max_size: int,
        *,
        max_inflight: int | None = None,
        max_connections: int = MAX_CONNECTIONS,
        closed: Callable[[LocalConnection], None] | None = None,
    ) -> None:
        """``closed(connection)`` is called once when a connection is lost (client gone)."""
        self.path = path
        self._deliver = deliver
        self._closed = closed
        self._max_size = max_size
        self.budget = InflightBudget(max_size if max_inflight is None else max_inflight)
        self._max_connections = max_connections
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[LocalConnection] = set()
        self._names = itertools.count(1)

    async def start(self) -> None:
        """Bind ``path`` (mode 0600) and accept connections. Raises OSError."""
        if len(os.fsencode(self.path)) > MAX_PATH_BYTES:
            raise OSError(f"socket path longer than {MAX_PATH_BYTES} bytes: {self.path}")
        loop = asyncio.get_running_loop()
        old = os.umask(0o077)  # created 0600: no moment at which others could connect
        try:
            self._server = await loop.create_unix_server(self._connection, path=self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def _connection(self) -> asyncio.BufferedProtocol:
        if len(self._connections) >= self._max_connections:
            logger.warning("local channel: %d connections, refusing more", self._max_connections)
            return _Rejected()
        name = f"local-{os.getpid()}-{next(self._names)}"
        conn = LocalConnection(name, self._deliver, self._max_size, self._lost, self.budget)
        self._connections.add(conn)
        return conn

    def _lost(self, conn: LocalConnection) -> None:
        self._connections.discard(conn)
        if self._closed is not None:
            self._closed(conn)  # it takes the pidfd (take_pidfd), now or after its lane
        elif (pidfd := conn.take_pidfd()) is not None:
            os.close(pidfd)

    async def stop(self) -> None:
        """Stop accepting, close every connection, remove the socket file. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            for conn in list(self._connections):
                conn.close()
            self._connections.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _Rejected(asyncio.BufferedProtocol):
    """A connection over the listener's bound: closed at once, nothing read."""

    _scratch = bytearray(64)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        pass
