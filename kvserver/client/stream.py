"""A remote client's ``put`` and ``get`` over the daemon's stream port (``docs/wire.md`` §6,
"Client ops"): the payload moves with one ``sendmsg`` / ``recv_into`` per socket-buffer's
worth, and the daemon receives it straight into the arena pages it reserved and sends a get's
parts straight from them (``kvserver/daemon/stream_ops.py``), where over ZMQ both sides' I/O
threads carry it and the daemon copies each put's frames into its arena.

Runs in client processes. A :class:`StreamLink` is one blocking TCP connection, used by one
thread at a time (``KVClient`` calls it directly; ``AsyncKVClient`` from a worker thread,
one call at a time). The format is :mod:`kvserver.wire_stream`.

Call order: :func:`kvserver.client.stream_use.stream_address` (None unless the daemon's last
``hello`` announced the capability ``stream_ops`` and a plain ``peer_stream_port``, this
client is not co-located and uses no CURVE key, and its address is ``tcp://``) →
``StreamLink.open(host, port, token, timeout)`` (connect, then the hello) → ``put`` /
``get`` any number of times → ``close()``.

Errors: an error reply to the request raises its typed error (``kvserver.errors``), the
connection staying usable. Anything else — the connection refused, closed or reset, a timeout,
a refused hello (its error reply has id 0), a reply that does not answer the request — raises
:class:`StreamFailed`, after which the link is closed and must not be used: the caller sends
the request over ZMQ instead (what the daemon did with it is unknown, as after a ZMQ timeout:
a put whose bytes did not all arrive was rolled back, and putting it again is harmless). A
link the daemon closed while idle (its restart, its idle time) is found so before a request
is sent on it. The one exception: the daemon closing or resetting the connection once a
request is all sent, before its reply is all in (it stopped or died meanwhile), raises
``Unavailable``, as a ZMQ connection lost with a request outstanding does: sent again over ZMQ
it would wait out its whole timeout for a daemon that is gone.
With ``stream_tls`` (an ``ssl.SSLContext`` with the CA of the daemon's certificate:
``kvserver.crypto.TlsClient(ca).ssl_context()``) the client dials the daemon's TLS stream port
(``peer_stream_tls_port``) and never a plain one; without it, a daemon with only a TLS port is
used over ZMQ.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from kvserver import wire, wire_stream
from kvserver.client.calls import PutResult
from kvserver.client.parts import Parts, flatten_parts
from kvserver.errors import (
    CapacityError,
    InvalidArgument,
    KVServerError,
    Unavailable,
)

#: buffers per ``sendmsg`` (Linux's UIO_MAXIOV).
IOV_MAX = 1024
#: a get whose geometry the client does not know is received into buffers of this size (or
#: of one part, when larger), each allocated once the one before it is full.
SEGMENT_BYTES = 64 << 20

T = TypeVar("T")


class StreamFailed(Exception):
    """The stream connection cannot be used (see the module docstring): send over ZMQ.
    ``closed``: the daemon had closed or reset it (not a timeout, not a refusal).
    ``error``: the daemon's reply broke its request's bounds (:func:`check_get_head`): the
    link is closed all the same, but ``error`` is raised to the caller, as the ZMQ path
    raises for a reply larger than its request may bring back (not sent again over ZMQ)."""

    def __init__(
        self, message: str, *, closed: bool = False, error: KVServerError | None = None
    ) -> None:
        super().__init__(message)
        self.closed = closed
        self.error = error


class NotHere(Exception):
    """This request is not for the stream (a put over the daemon's ``max_message_bytes``,
    which ZMQ carries in windows, or one the daemon answered ``capacity``: its stream puts in
    flight hold their share of DRAM): send it over ZMQ; the link stays open. A windowed put
    (:mod:`kvserver.client.stream_put`) sends that window and the rest over ZMQ."""


class StreamLink:
    """One connection to a daemon's stream port; see the module docstring."""

    def __init__(
        self, sock: socket.socket, sid: str | None, max_payload: int = 1 << 30, max_part: int = 0
    ) -> None:
        self._sock = sock
        #: the daemon session it was opened in (a new ``sid``: open another)
        self.sid = sid
        #: the largest put payload the daemon takes (its ``max_message_bytes``)
        self.max_payload = max_payload
        #: the largest part a get's reply may announce when the namespace is not known:
        #: ``max_part`` (the client's own bound, ``max_frame_bytes``) when > 0 and smaller,
        #: else ``max_payload``
        self.max_part = min(max_payload, max_part) if max_part > 0 else max_payload
        #: a reply has come back on it (a link found closed later went stale: the daemon
        #: restarted, or closed it after its idle time)
        self.used = False
        self._next_id = 0

    @classmethod
    def open(
        cls,
        address: tuple[str, int],
        token: str,
        timeout: float,
        sid: str | None,
        tls: ssl.SSLContext | None = None,
        max_payload: int = 1 << 30,
        max_part: int = 0,
    ) -> StreamLink:
        """Connect (with ``tls``: the TLS handshake, the daemon's certificate checked
        against the context's CA and the address's host), then send the hello. Raises
        StreamFailed."""
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as exc:
            raise StreamFailed(f"cannot connect to the stream port: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=address[0])
        except OSError as exc:  # ssl.SSLError: a certificate refused, a plain server
            sock.close()
            raise StreamFailed(f"stream TLS handshake failed: {exc}") from None
        link = cls(sock, sid, max_payload, max_part)
        try:
            link._send([memoryview(wire_stream.encode_hello(token))], deadline)
        except (OSError, KVServerError) as exc:
            link.close()
            raise StreamFailed(f"stream hello failed: {exc}") from None
        return link

    def close(self) -> None:
        """Shut the connection down (a thread blocked on it wakes at once: closing the
        descriptor alone leaves it blocked until its timeout), then close it."""
        self.shutdown()
        self._sock.close()

    def shutdown(self) -> None:
        """Wake a thread blocked sending or receiving on the link; no byte moves after
        (the TCP shutdown itself, under TLS too: its record layer is not touched)."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    # ------------------------------------------------------------------ ops

    def put(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        parts: Parts,
        lease_s: float | None,
        client: str,
        timeout: float,
    ) -> PutResult:
        """``put`` as one request, however large (a client's put cuts a large one into
        windows first when the daemon announces its quota: :mod:`kvserver.client.stream_put`).
        Raises NotHere, the daemon's error, or StreamFailed."""
        deadline = time.monotonic() + timeout
        request_id = self.send_put(ns_id, keys, parts, lease_s, client, deadline)
        return self.put_reply(request_id, deadline)

    def send_put(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        parts: Parts,
        lease_s: float | None,
        client: str,
        deadline: float,
        *,
        outstanding: bool = False,
    ) -> int:
        """Send a ``put`` request (its reply read by :meth:`put_reply`); returns its id.
        ``outstanding``: a request's reply is not read yet (a pipelined window): the link is
        not checked for staleness (that reply may be arriving), and the daemon closing it
        raises Unavailable. Raises NotHere (over ``max_payload``: nothing sent), or
        StreamFailed."""
        payload = [memoryview(p).cast("B") for p in flatten_parts(keys, parts)]
        size = sum(v.nbytes for v in payload)
        if size > self.max_payload:  # the daemon would refuse it and close: ZMQ's windows
            raise NotHere
        args = {"ns_id": ns_id, "keys": list(keys), "lease_s": lease_s}
        if not outstanding:
            return self._send_request(wire.PUT, args, client, payload, size, deadline)
        with _outstanding(wire.PUT):
            return self._send_request(wire.PUT, args, client, payload, size, deadline, True)

    def put_reply(self, request_id: int, deadline: float) -> PutResult:
        """The reply to put ``request_id``, the oldest whose reply is not read. Raises NotHere
        (``capacity``: the stream's puts in flight hold their share of DRAM), the daemon's
        error, StreamFailed, or Unavailable (module docstring)."""
        try:
            head = self._read_head(wire.PUT, request_id, deadline)
        except CapacityError:
            raise NotHere from None
        if not head.result:
            raise StreamFailed("stream put answered without a result")
        body = bytearray(head.count)
        with _outstanding(wire.PUT):
            self._recv(memoryview(body), deadline)
        return PutResult.from_result(wire_stream.decode_result(body))

    def get(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        ranks: Sequence[int] | None,
        part_bytes: int | None,
        tp: int | None,
        timeout: float,
    ) -> list[list[memoryview]]:
        """``get`` of every key (each must be ready): ``result[i][j]`` is rank ``ranks[j]``'s
        part of ``keys[i]``, views of the buffers received straight from the socket.
        ``part_bytes`` / ``tp``: the namespace's when known. The reply's head is checked
        before anything is allocated (:func:`check_get_head`); one that breaks the request's
        bounds raises StreamFailed carrying InvalidArgument (the link closed, the error raised
        to the caller). With the geometry known the payload is received into one buffer (its
        size the client's own: ``len(keys)`` x ranks x ``part_bytes``); without it, into
        buffers of at most :data:`SEGMENT_BYTES` (or one part) allocated as the bytes before
        them arrive, so a head announcing more than the daemon sends costs at most one.
        Raises the daemon's error, or StreamFailed."""
        args = {"ns_id": ns_id, "keys": list(keys), "ranks": list(ranks) if ranks else None}
        per_key = len(ranks) if ranks else tp
        deadline = time.monotonic() + timeout
        head = self._request(wire.GET, args, None, [], 0, deadline)
        problem = check_get_head(head, len(keys), per_key, part_bytes, self.max_part)
        if problem is not None:
            raise StreamFailed(f"stream get: {problem.message}", error=problem)
        size, per = head.part_bytes, head.tp
        total = head.count * per
        step = total if per_key is not None and part_bytes is not None else _segment(size)
        parts: list[memoryview] = []
        with _outstanding(wire.GET):
            for first in range(0, total, step):
                n = min(step, total - first)
                buf = np.empty(n * size, dtype=np.uint8).data.cast("B")
                self._recv(buf, deadline, wake=True)
                parts.extend(buf[j * size : (j + 1) * size] for j in range(n))
        return [parts[i * per : (i + 1) * per] for i in range(head.count)]

    # ------------------------------------------------------------------ bytes

    def _request(
        self,
        op: str,
        args: dict[str, Any],
        client: str | None,
        payload: list[memoryview],
        size: int,
        deadline: float,
    ) -> wire_stream.ReplyHead:
        """Send one op request and read its reply's head; raises the error of an error
        reply to it, StreamFailed for anything else amiss."""
        request_id = self._send_request(op, args, client, payload, size, deadline)
        return self._read_head(op, request_id, deadline)

    def _send_request(
        self,
        op: str,
        args: dict[str, Any],
        client: str | None,
        payload: list[memoryview],
        size: int,
        deadline: float,
        outstanding: bool = False,
    ) -> int:
        """Send one op request; returns its id (``outstanding``: see :meth:`send_put`)."""
        self._next_id += 1
        request_id = self._next_id
        request = wire_stream.encode_op_request(request_id, op, args, client, size)
        if self.used and not outstanding and self._stale():
            raise StreamFailed("the daemon closed the stream", closed=True)
        try:
            self._send([memoryview(request), *payload], deadline)
        except (OSError, KVServerError) as exc:
            closed = isinstance(exc, ConnectionError)
            raise StreamFailed(f"stream {op} failed: {exc}", closed=closed) from None
        return request_id

    def _read_head(self, op: str, request_id: int, deadline: float) -> wire_stream.ReplyHead:
        """The head of request ``request_id``'s reply; raises the error of an error reply,
        StreamFailed for anything else amiss."""
        raw = bytearray(wire_stream.REPLY_HEAD.size)
        with _outstanding(op):
            self._recv(memoryview(raw), deadline)
        try:
            head = wire_stream.decode_reply_head(raw, results=True)
        except KVServerError as exc:
            raise StreamFailed(f"stream {op} failed: {exc}") from None
        if head.request_id != request_id & 0xFFFFFFFF:
            raise StreamFailed("stream reply answers another request (a refused hello?)")
        self.used = True
        if not head.ok and not head.result:
            body = bytearray(head.count)
            self._recv(memoryview(body), deadline)
            raise wire_stream.decode_error(body)
        return head

    def _stale(self) -> bool:
        """Whether the daemon closed the link since its last reply (it restarted, or closed
        it after its idle time): between requests nothing is due, so anything to read (the
        end of the stream, a reset, a TLS alert) means the link is gone."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def _send(self, views: list[memoryview], deadline: float) -> None:
        """Send ``views`` whole (``sendmsg`` of up to :data:`IOV_MAX` at a time; TLS:
        ``sendall`` of each, which has no ``sendmsg``)."""
        sock, todo, i = self._sock, [v for v in views if v.nbytes], 0
        if isinstance(sock, ssl.SSLSocket):
            for view in todo:
                _bound(sock, deadline)
                sock.sendall(view)
            return
        while i < len(todo):
            _bound(sock, deadline)
            sent = sock.sendmsg(todo[i : i + IOV_MAX])
            i = wire_stream.advance(todo, i, sent)

    def _recv(self, view: memoryview, deadline: float, *, wake: bool = False) -> None:
        """Fill ``view`` (StreamFailed on EOF or past ``deadline``). ``wake`` (a payload, on a
        plain socket): woken once ``wire_stream.wake_at`` bytes are unread (``SO_RCVLOWAT``),
        not at every segment: each wake-up costs the daemon's CPU too."""
        sock, pos, size = self._sock, 0, view.nbytes
        wake = wake and not isinstance(sock, ssl.SSLSocket)
        try:
            while pos < size:
                if wake:
                    lowat = wire_stream.wake_at(size - pos, wire_stream.WAKE_BYTES)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                _bound(sock, deadline)
                got = sock.recv_into(view[pos:])
                if got == 0:
                    raise StreamFailed("the daemon closed the stream", closed=True)
                pos += got
            if wake:  # a reply's head must not wait for more than it is
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        except OSError as exc:
            closed = isinstance(exc, ConnectionError)
            raise StreamFailed(f"stream receive failed: {exc}", closed=closed) from None


@contextlib.contextmanager
def _outstanding(op: str) -> Iterator[None]:
    """A request is all sent: the daemon closing or resetting the link before its reply is
    all in raises ``Unavailable`` (module docstring), not StreamFailed."""
    try:
        yield
    except StreamFailed as exc:
        if not exc.closed:
            raise
        raise Unavailable(f"the daemon closed the stream with a {op} outstanding (what it did "
                          "with it is unknown)") from None  # fmt: skip


def check_get_head(
    head: wire_stream.ReplyHead,
    keys: int,
    per_key: int | None,
    part_bytes: int | None,
    max_part: int,
) -> InvalidArgument | None:
    """What is wrong with ``head`` as the ok reply to a get of ``keys`` keys (None: nothing),
    decided before anything is allocated: it carries exactly ``keys`` chunks of ``per_key``
    parts (the ranks asked for, else the namespace's TP world size, when known; else at
    least one) of ``part_bytes`` (the namespace's, when known; else 1 .. ``max_part``: the
    daemon's ``max_message_bytes``, or the client's own bound when smaller)."""
    if head.result:
        return InvalidArgument("a get answered with a result reply")
    if head.count != keys:
        return InvalidArgument("get reply carries another number of chunks than keys asked",
                               chunks=head.count, keys=keys)  # fmt: skip
    if (head.tp != per_key) if per_key is not None else head.tp < 1:
        return InvalidArgument("get reply carries another number of parts per chunk than asked",
                               tp=head.tp, asked=per_key)  # fmt: skip
    if part_bytes is not None:
        if head.part_bytes != part_bytes:
            return InvalidArgument("get reply parts are not the namespace's size",
                                   size=head.part_bytes, part_bytes=part_bytes)  # fmt: skip
    elif not 1 <= head.part_bytes <= max_part:
        return InvalidArgument("get reply announces parts larger than the client takes",
                               size=head.part_bytes, max=max_part)  # fmt: skip
    return None


def _segment(part_bytes: int) -> int:
    """Parts per receive buffer when the geometry is not known (:data:`SEGMENT_BYTES`)."""
    return max(1, SEGMENT_BYTES // part_bytes)


def _bound(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the stream call timed out")
    sock.settimeout(left)
