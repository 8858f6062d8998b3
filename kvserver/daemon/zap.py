"""Authentication at the ZMQ handshake: the daemon's ZAP handler.

Runs in the daemon process, on its event loop (the handler's socket is read by a reader
callback on its file descriptor, as the ROUTER is: ``zmq_server.py``). Not thread-safe: one
instance per daemon context, used from the loop only.

Call order: ``HandshakeGate.start_for(...)`` (or ``HandshakeGate(ctx, ...)`` → ``start()``: bind
``inproc://zeromq.zap.01``, before any socket of the context binds, so no handshake goes
unchecked) → ``guard(router)`` (PLAIN server when tokens are checked; ``watch``: count the
handshakes that fail before ZAP is asked) → serving → ``stop()``.

Why: ZMQ hands the application whole messages, so a token inside a request header can only be
checked after the daemon's ZMQ I/O thread has received every byte of the request; a client
that pipelines big requests without a valid token keeps that thread — which carries every other
client's messages too — busy copying them (``docs/benchmarks.md``, the abuse section). ZAP
(ZeroMQ RFC 27) lets libzmq ask the application during the handshake instead: a peer the
handler refuses gets an ERROR command and its connection is closed before any message of it is
read, so an unauthenticated peer's requests never reach the daemon (nor its memory).

What it checks (``docs/security.md``, "Tokens at the handshake"):

- **PLAIN** (the ROUTER of a daemon that requires a token and has no CURVE key): the password is
  a token the daemon's :class:`~kvserver.daemon.auth.Authenticator` accepts — the admin's or a
  tenant's; the user name is not checked (clients send :data:`kvserver.crypto.PLAIN_USERNAME`).
  The reply's User-Id is the principal's name (libzmq then attaches it to the connection's
  messages as the ``User-Id`` property; the daemon does not read it: each request's own token
  decides what it may do, on every transport alike).
- **CURVE** with a clients directory: the client's public key is one of the listed ones.
- **NULL** (the KV-event PUB, the ROUTER with no token): admitted.

Every refusal and admission is counted (``refusals.HandshakeCounts``, owned by ``KVService``:
``stats()["handshakes"]``, ``/metrics`` ``kvserver_zmq_handshakes_*``), and so is a handshake
that fails before ZAP is asked — a peer that speaks another mechanism (a client without a token,
``NULL``, reaching a PLAIN ROUTER), breaks the protocol or hangs up midway — from the ROUTER's
monitor events (only failures are subscribed to: a good client causes none; under a flood of
connections the monitor's queue may drop some, so ``failed`` is a lower bound). A handshake
costs the loop one digest and one dictionary look-up, whatever the peer sends; ZAP requests are
small (libzmq bounds the PLAIN credentials at 255 bytes each).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, cast

import zmq
from zmq.utils import z85

from kvserver.crypto import CurveServer
from kvserver.daemon.auth import Authenticator
from kvserver.daemon.refusals import HandshakeCounts
from kvserver.errors import Unauthenticated
from kvserver.key_files import load_client_keys

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
#: the ROUTER's monitor events counted as failed handshakes (ZAP's refusals are counted by ZAP)
FAILED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
#: ZAP requests answered before the reader callback lets the loop run other callbacks.
MAX_DRAIN = 64


class HandshakeGate:
    """The ZAP handler of one ZMQ context; see the module docstring.

    ``auth``: the tokens a PLAIN handshake may carry (None: PLAIN is refused);
    ``curve_keys``: the Z85 public keys a CURVE client may have (None: any key is admitted).
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        counts: HandshakeCounts,
        *,
        auth: Authenticator | None = None,
        curve_keys: frozenset[bytes] | None = None,
    ) -> None:
        self._ctx = ctx
        self._counts = counts
        self._auth = auth
        self._curve_keys = curve_keys
        self._sock: zmq.Socket[bytes] | None = None
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._monitor_fd: int | None = None

    @classmethod
    def start_for(
        cls,
        ctx: zmq.Context[Any],
        counts: HandshakeCounts,
        auth: Authenticator,
        curve: CurveServer | None,
    ) -> HandshakeGate | None:
        """The started gate of a daemon with these settings: tokens at the handshake when a
        token is required and there is no CURVE key (PLAIN), listed keys when CURVE has a
        clients directory; None when it needs neither (``--no-auth``, CURVE admitting any
        key)."""
        plain = curve is None and auth.required
        if not plain and (curve is None or not curve.clients_dir):
            return None
        keys = load_client_keys(curve.clients_dir) if curve is not None else None
        gate = cls(ctx, counts, auth=auth if plain else None, curve_keys=keys)
        gate.start()
        return gate

    def guard(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (the ROUTER, not yet bound; a CURVE server already if CURVE is used) a
        PLAIN server when this gate checks tokens, and count its failed handshakes
        (:meth:`watch`)."""
        if self._auth is not None:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        self.watch(sock)

    def start(self) -> None:
        """Bind the ZAP endpoint of the context and answer its requests on the running loop."""
        # a plain socket on the same libzmq context (inproc needs it), read without blocking
        sock: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # anything queued before the reader was added

    def watch(self, sock: zmq.Socket[Any]) -> None:
        """Count ``sock``'s handshakes that fail before ZAP is asked (see the module). Call
        after ``start()``, before ``sock`` binds; ``stop()`` before ``sock`` closes."""
        assert self._loop is not None, "start() first"
        addr = f"inproc://kvserver-handshakes-{id(self):x}"
        sock.monitor(addr, FAILED_EVENTS)
        pair: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(addr)
        self._watched, self._monitor = sock, pair
        self._monitor_fd = cast(int, pair.getsockopt(zmq.FD))
        self._loop.add_reader(self._monitor_fd, self._count_failures)
        self._loop.call_soon(self._count_failures)  # the descriptor signals changes only

    def stop(self) -> None:
        """Stop answering and watching, close the sockets (before the context is
        terminated, and before the watched socket is closed)."""
        for fd in (self._fd, self._monitor_fd):
            if fd is not None and self._loop is not None:
                self._loop.remove_reader(fd)
        self._fd = self._monitor_fd = None
        if self._watched is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._watched.disable_monitor()
            self._watched = None
        for sock in (self._sock, self._monitor):
            if sock is not None:
                sock.close(linger=0)
        self._sock = self._monitor = None

    def _count_failures(self) -> None:
        pair = self._monitor
        if pair is None:
            return
        try:
            while cast(int, pair.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                # libzmq's own monitor (inproc, two frames): no peer writes it
                pair.recv_multipart(zmq.NOBLOCK)  # the event's kind does not matter here
                self._counts.failed += 1
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ETERM):
                logger.warning("handshake monitor failed: %s", exc)

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            for _ in range(MAX_DRAIN):
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                # a ZAP request is made by libzmq (inproc, 6-7 frames, each bounded by the
                # handshake: a PLAIN password <= 255 bytes, a CURVE key 32), not sent by a peer
                frames = sock.recv_multipart(zmq.NOBLOCK)
                reply = self.answer(frames[2:]) if len(frames) >= 2 else None
                if reply is not None:
                    sock.send_multipart([*frames[:2], *reply])
            assert self._loop is not None
            self._loop.call_soon(self._drain)  # more may be queued: after the other callbacks
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                logger.warning("ZAP handler failed: %s", exc)

    def answer(self, request: Sequence[bytes]) -> list[bytes] | None:
        """The ZAP reply frames to one request (RFC 27: version, request id, domain, address,
        routing id, mechanism, credentials...); None for one that cannot be answered."""
        if len(request) < 6:
            return None
        version, request_id, _domain, _address, _routing_id, mechanism = request[:6]
        credentials = request[6:]
        if version != ZAP_VERSION:
            return [ZAP_VERSION, request_id, b"400", b"unsupported ZAP version", b"", b""]
        user = self._admit(mechanism, credentials)
        counts = self._counts
        if user is None:
            if mechanism == b"PLAIN":
                counts.refused_token += 1
                text = b"wrong or missing auth token"
            else:
                counts.refused_key += 1
                text = b"client key not admitted"
            return [ZAP_VERSION, request_id, b"400", text, b"", b""]
        counts.accepted += 1
        return [ZAP_VERSION, request_id, b"200", b"OK", user, b""]

    def _admit(self, mechanism: bytes, credentials: Sequence[bytes]) -> bytes | None:
        """The User-Id of an admitted peer; None when refused."""
        if mechanism == b"NULL":
            return b"anonymous"
        if mechanism == b"PLAIN":
            if self._auth is None or not self._auth.required or len(credentials) != 2:
                return None
            try:
                who = self._auth.check(credentials[1].decode())
            except (UnicodeDecodeError, Unauthenticated):
                return None
            return who.name.encode()
        if mechanism == b"CURVE":
            if len(credentials) != 1 or len(credentials[0]) != 32:
                return None
            key = z85.encode(credentials[0])
            if self._curve_keys is not None and key not in self._curve_keys:
                return None
            return key
        return None
