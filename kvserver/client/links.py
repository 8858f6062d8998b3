"""The blocking client's two connections to the daemon: the ZMQ DEALER and the local channel.

Runs in client processes, on the thread that owns the :class:`~kvserver.client.KVClient`; not
thread-safe. Both links carry the same messages (``docs/wire.md``) and have the same shape:
``send(frames, timeout)`` / ``ready()`` / ``wait(timeout)`` / ``recv(timeout)`` in any order,
then ``close()``; which one a request takes is the client's business (``sync.py``).

- :class:`ZmqLink`: a DEALER socket to the daemon's ROUTER (any host). It reconnects by itself
  and queues requests while the daemon is away; ``send`` raises TimeoutError only when its
  queue is full. Its :class:`ConnectionWatch` tells when its connection broke (a ``wait``
  then ends at once; the client fails what is outstanding and replaces the socket), and why
  a security handshake failed (:mod:`kvserver.client.handshake`), which ends a ``wait`` at
  once and becomes the error.
  :func:`open_dealer` makes the DEALER and its watch for both clients (the asyncio one,
  ``aio_transport.py``, uses them directly).
- :class:`LocalLink`: a Unix-domain stream socket to the daemon's local channel, framed by
  :mod:`kvserver.wire_local`. A co-located client (it mapped the arena) connects when ``hello``
  announces a ``local_path`` of a framing version it speaks, and then sends every request
  there: a round trip wakes two threads instead of six (the client's and the daemon's ZMQ I/O
  threads drop out), which is most of a co-located batch's protocol cost. Every failure of the
  connection (the daemon closed it or exited, a timeout) raises OSError, after which the link
  is unusable. A reply is bounded as a DEALER with ``MAXMSGSIZE`` bounds it (``open_dealer``):
  each frame at most the daemon's ``max_message_bytes`` (its hello's), checked at the reply's
  framing before its bytes are received, which are received into a buffer grown as they
  arrive (:data:`GROW_BYTES` at a time), never to the announced size ahead of them: a reply
  announcing more raises InvalidArgument, after which the link is unusable too.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import time
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvserver import wire_local
from kvserver.client import handshake, replies
from kvserver.client.common import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RECONNECT_IVL_MAX_MS,
    RECONNECT_IVL_MS,
)
from kvserver.crypto import CurveClient, apply_token
from kvserver.errors import InvalidArgument
from kvserver.netaddr import is_ipv6_endpoint

RECV_BUFFER = 256 << 10
#: messages up to this size are written with one system call (joined), larger ones piecewise.
JOIN_LIMIT = 64 << 10
#: a local reply larger than the receive buffer is received into a buffer grown by this much
#: at a time as its bytes arrive (the stream client's ``SEGMENT_BYTES``, for the same reason).
GROW_BYTES = 64 << 20

S = TypeVar("S", bound=zmq.Socket[Any])
_watch_ids = itertools.count()


class ConnectionWatch:
    """Whether a DEALER's connection to the daemon broke, from the socket's monitor events.

    Why: a DEALER whose connection broke (the daemon exited) reconnects by itself, but waits
    ``RECONNECT_IVL`` and then ever longer, up to ``RECONNECT_IVL_MAX``, between attempts; a
    request sent meanwhile waits in its queue, so the first request to a daemon restarted on
    the same address could go unanswered within its timeout although the daemon was up. And
    the replies to the requests outstanding when it broke can never come (the daemon routes a
    reply to the connection its request came on), so waiting for them only runs out their
    timeouts. A client therefore asks :meth:`broke` while it waits for replies (a ``zmq.Poller``
    or an event loop watches :attr:`fd`) and before it sends; when True it routes the replies
    already received, fails the requests still outstanding with Unavailable and replaces the
    socket: a new DEALER's first connection attempt is immediate. Nothing is sent twice: the
    requests not yet written are discarded with the old socket and fail too.

    ``broke()`` is True once a connection of this socket completed its handshake
    (``EVENT_HANDSHAKE_SUCCEEDED``, any mechanism) and then broke (``EVENT_DISCONNECTED``), and
    stays True (even when the socket connected again by itself: the requests outstanding were
    lost with the old connection). A socket that never connected (no daemon listening yet) has
    not broken: it is still trying, and a request waiting on it times out and replaces it
    anyway; nor has one whose handshake failed (its requests were never delivered: they wait
    for their timeout, which then says why). ``failure()``: why the latest security handshake
    failed (None when it succeeded or none was tried). Not thread-safe: the socket's owner
    calls it (one non-blocking check of an inproc PAIR socket when nothing happened).
    """

    EVENTS = (
        zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | handshake.EVENTS
    )

    def __init__(
        self,
        sock: zmq.Socket[Any],
        *,
        mechanism: str = "null",
        peer: str = "daemon",
        option_prefix: str = "",
    ) -> None:
        """Watch ``sock`` (``mechanism``: its security, one of ``handshake.MECHANISMS``); call
        before ``sock.connect`` so no event is missed. ``peer`` and ``option_prefix``: how
        ``failure()`` names the server and the options
        (:func:`~kvserver.client.handshake.explain`)."""
        addr = f"inproc://kvserver-client-watch-{id(self):x}-{next(_watch_ids)}"
        sock.monitor(addr, self.EVENTS)
        # a plain socket on the same libzmq context (inproc needs it), also for zmq.asyncio
        pair: zmq.Socket[bytes] = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(addr)
        self._sock, self._pair = sock, pair
        self._mechanism = mechanism
        self._peer, self._option_prefix = peer, option_prefix
        self._broke = False
        self._established = False  # the current connection completed its handshake
        self._failure: handshake.Failure | None = None
        # for ``why_silent``: a connection accepted / an attempt failed, and whether any
        # handshake completed, since the socket was made
        self._connected = self._refused = self._handshaken = False

    @property
    def fd(self) -> zmq.Socket[bytes]:
        """The monitor socket, for a zmq.Poller: readable when an event came in."""
        return self._pair

    def _read(self) -> None:
        pair = self._pair
        while cast(int, pair.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            # libzmq's own monitor (inproc, two frames): no peer writes it
            message = parse_monitor_message(pair.recv_multipart())
            event = int(message["event"])
            if event == zmq.EVENT_CONNECT_RETRIED:
                self._refused = True
            elif event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                # only a connection that completed its handshake can have carried requests
                # (a failed handshake is its own error: ``failure()``)
                self._broke |= self._established
                self._established = False
            else:
                self._failure = handshake.explain(
                    event, int(message["value"]), self._mechanism,
                    peer=self._peer, option_prefix=self._option_prefix,
                )  # fmt: skip
                self._established = self._failure is None
                self._handshaken |= self._established

    def broke(self) -> bool:
        """True once an established connection broke (see the class docstring)."""
        self._read()
        return self._broke

    @property
    def known_broken(self) -> bool:
        """``broke()`` as of the events already read (reads none)."""
        return self._broke

    @property
    def known_failure(self) -> handshake.Failure | None:
        """``failure()`` as of the events already read (reads none)."""
        return self._failure

    def failure(self) -> handshake.Failure | None:
        """Why the latest handshake failed; None if it did not (see the class docstring)."""
        self._read()
        return self._failure

    def why_silent(self) -> handshake.Failure | None:
        """Why a request on this socket got no reply: ``failure()``, else, when no handshake
        ever completed, what the connection attempts saw (nothing listening, or a server
        that does not speak ZMTP: :func:`~kvserver.client.handshake.explain_silence`); None
        when the daemon was reached (it is just slow)."""
        failure = self.failure()
        if failure is not None or self._handshaken:
            return failure
        return handshake.explain_silence(
            connected=self._connected, refused=self._refused, peer=self._peer
        )

    def close(self) -> None:
        """Stop watching (before the socket is closed)."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._pair.close(linger=0)


def open_dealer(
    ctx: zmq.Context[S],
    address: str,
    curve: CurveClient | None,
    token: str = "",
    max_frame_bytes: int = 0,
) -> tuple[S, ConnectionWatch]:
    """A DEALER connected to ``address`` (LINGER 0, the client's reconnect intervals; CURVE
    when given, else ``token`` presented at the handshake when given: PLAIN, ``docs/wire.md``),
    watched from before its first connection attempt. Both clients' sockets.
    ``max_frame_bytes`` > 0: a frame announced larger is not received: ZMQ drops the
    connection at its length prefix (``MAXMSGSIZE``), which the watch reports as broken.
    Whatever raises (ZMQ refusing ``address``: ``tcp://HOST`` without a port, an unknown
    transport) closes the socket and its watch first: nothing is left open in ``ctx``."""
    sock = ctx.socket(zmq.DEALER)
    watch: ConnectionWatch | None = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if max_frame_bytes > 0:
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        if is_ipv6_endpoint(address):  # ZMQ connects to an IPv6 host only when told
            sock.setsockopt(zmq.IPV6, 1)
        mechanism = "null"
        if curve is not None:
            curve.apply(sock)
            mechanism = "curve"
        elif token:
            apply_token(sock, token)
            mechanism = "plain"
        watch = ConnectionWatch(sock, mechanism=mechanism)
        sock.connect(address)
    except BaseException:
        if watch is not None:
            watch.close()
        sock.close(linger=0)
        raise
    return sock, watch


class ZmqLink:
    """A DEALER socket to the daemon's ROUTER; see the module docstring."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        curve: CurveClient | None = None,
        token: str = "",
    ) -> None:
        self._sock, self._watch = open_dealer(ctx, address, curve, token)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._watch.fd, zmq.POLLIN)

    def close(self) -> None:
        self._watch.close()
        self._sock.close(linger=0)

    def why_silent(self) -> handshake.Failure | None:
        """Why a request got no reply (:meth:`ConnectionWatch.why_silent`)."""
        return self._watch.why_silent()

    def broke(self) -> bool:
        """The connection broke (the daemon went away): no reply to what is outstanding can
        come; route what was received, then replace this link (fail the rest)."""
        return self._watch.broke()

    def send(self, frames: Sequence[Any], timeout: float) -> None:
        """Queue one message; TimeoutError if the DEALER's queue is full (never blocks)."""
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise TimeoutError("the DEALER's send queue is full") from None

    def ready(self) -> bool:
        """A message can be received now (ZMQ_EVENTS: cheaper than a poll)."""
        return bool(cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a message; False sooner when the connection
        broke (``broke()``: no reply can come) or a handshake with the daemon failed (the
        socket would only retry and fail again). One poll of the DEALER and its monitor
        socket; the monitor wakes it only when the connection changes."""
        if self.ready():
            return True
        if self._watch.known_broken:
            return False
        if self._watch.known_failure is not None and self._watch.failure() is not None:
            # read earlier (before a send, say): no event may come to wake the poll (ZMQ
            # lets a connection whose handshake failed go, and may never connect again)
            return self.ready()
        deadline = time.monotonic() + timeout
        while True:
            ms = max(1, int((deadline - time.monotonic()) * 1000))
            ready = self._poller.poll(ms)
            if len(ready) == 1 and ready[0][0] is self._sock:  # the common case: a reply
                return True
            if self._watch.broke() or self._watch.failure() is not None:
                return self.ready()
            if self.ready():
                return True
            if time.monotonic() >= deadline:
                return False

    def recv_header(self) -> zmq.Frame:
        """A message's first frame (``copy=False``). REQUIRES: ``ready()``."""
        return self._sock.recv(zmq.NOBLOCK, copy=False)

    def recv_rest(self, header: zmq.Frame, keep: int) -> list[zmq.Frame] | replies.Oversized:
        """The message whose first frame is ``header``, frame by frame, its payload frames kept
        up to ``keep`` (:func:`kvserver.client.replies.receive`)."""
        return replies.receive(self._sock, header, keep)


class LocalLink:
    """One connection to the local channel; see the module docstring."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._sock = sock
        #: the largest frame of a reply taken (the daemon's ``max_message_bytes``).
        self._max_frame = max_frame
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # received, not yet returned: _buf[_start:_end]

    @classmethod
    def connect(
        cls, path: str, timeout: float, max_frame: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> LocalLink:
        """Connect to ``path``; its replies' frames at most ``max_frame`` bytes. Raises
        OSError (no daemon there, no permission, timeout)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return cls(sock, max_frame)

    def close(self) -> None:
        self._sock.close()

    def send(self, frames: Sequence[Any], timeout: float) -> None:
        """Write one message (``frames``: header, then payload). Raises OSError."""
        buffers = wire_local.encode(frames)
        self._sock.settimeout(max(timeout, 1e-3))
        if sum(memoryview(b).nbytes for b in buffers) <= JOIN_LIMIT:
            self._sock.sendall(b"".join(buffers))
        else:
            for buf in buffers:
                self._sock.sendall(buf)

    def ready(self) -> bool:
        """True if a reply can be read now: received, or at least started (the daemon writes
        each reply at once, so ``recv`` then waits only for the rest of it to stream in)."""
        return self._end > self._start or bool(self._poller.poll(0))

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a reply to start arriving."""
        return self._end > self._start or bool(self._poller.poll(max(1, int(timeout * 1000))))

    def recv(self, timeout: float) -> list[memoryview]:
        """Read one whole message; its frames. Raises OSError (EOF included); InvalidArgument
        when its framing announces a frame over ``max_frame`` bytes (before they are
        received). After either the link is unusable: close it."""
        self._sock.settimeout(max(timeout, 1e-3))
        size_len = wire_local.SIZE.size
        self._fill(size_len + wire_local.COUNT.size)  # every message has its frame count
        (size,) = wire_local.SIZE.unpack_from(self._buf, self._start)
        (count,) = wire_local.COUNT.unpack_from(self._buf, self._start + size_len)
        if not 1 <= count <= wire_local.MAX_FRAMES or size < wire_local.overhead(count):
            raise ConnectionResetError(f"unreadable local message: bad frame count ({count})")
        if size > wire_local.overhead(count) + count * self._max_frame:
            raise InvalidArgument(
                "local reply announces frames larger than the daemon's max_message_bytes",
                size=size, frames=count, max_frame_bytes=self._max_frame,
            )  # fmt: skip
        self._start += size_len
        have = self._end - self._start
        if size <= have:
            body = memoryview(bytes(self._view[self._start : self._start + size]))
            self._start += size
        else:  # the rest goes straight into a buffer of its own
            body = self._recv_rest(size)
        if self._start == self._end:
            self._start = self._end = 0
        try:
            frames = wire_local.decode(body)
        except InvalidArgument as exc:  # not the daemon's framing: the stream cannot be trusted
            raise ConnectionResetError(f"unreadable local message: {exc}") from None
        if size > self._max_frame and (big := max(f.nbytes for f in frames)) > self._max_frame:
            raise InvalidArgument(
                "local reply has a frame larger than the daemon's max_message_bytes",
                size=big, max_frame_bytes=self._max_frame,
            )  # fmt: skip
        return frames

    def _recv_rest(self, size: int) -> memoryview:
        """The ``size`` bytes of a message body begun in the receive buffer (all of it
        taken), received into a buffer grown :data:`GROW_BYTES` at a time as they arrive: one
        announcing more than comes costs at most that much more than came."""
        whole = bytearray(self._view[self._start : self._end])
        self._start = self._end = 0
        have = len(whole)
        while have < size:
            whole.extend(bytes(min(size, have + GROW_BYTES) - have))
            with memoryview(whole) as view:
                while have < len(whole):
                    got = self._sock.recv_into(view[have:])
                    if got == 0:
                        raise ConnectionResetError("the daemon closed the local channel")
                    have += got
        return memoryview(whole)

    def _fill(self, need: int) -> None:
        """Receive until ``need`` bytes are buffered (``need`` <= the buffer size)."""
        if self._start + need > len(self._buf):  # move what is left to the front
            n = self._end - self._start
            self._buf[:n] = bytes(self._view[self._start : self._end])  # they may overlap
            self._start, self._end = 0, n
        while self._end - self._start < need:
            got = self._sock.recv_into(self._view[self._end :])
            if got == 0:
                raise ConnectionResetError("the daemon closed the local channel")
            self._end += got
