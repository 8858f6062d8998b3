"""Checking and carrying out one data-plane request: the token, the size, the header, the op.

Runs in the daemon process, on its one event loop, called by the receive loop of
``zmq_server.py`` (:class:`~kvserver.daemon.zmq_server.DataFrontend`) for each message of a
ROUTER connection or a local-channel connection, in arrival order per connection. Not
thread-safe: one instance per front end, used from the loop only.

Call order: :meth:`RequestHandler.handle` per request → an :class:`~kvserver.daemon.zmq_ops.
Answer` to send now, a coroutine function whose answer is sent later (on the connection's lane:
a ``Deferred`` op, or a header over :data:`OFFLOAD_HEADER_BYTES` decoded on a thread), or None
(an error reply held back or dropped by ``refusals.py``, which sends it itself through the
front end's send). :meth:`~RequestHandler.replay_refusal` before a replay request is served;
:meth:`~RequestHandler.release_local` once a local connection is gone.

It holds what the checks learn about connections: which principal each ROUTER connection last
authenticated as (a replay request carries no token: the connection's last authenticated
request decides; oldest forgotten past :data:`MAX_AUTHENTICATED_PEERS`), and which clients
(lease owners) each local connection's requests named, whose reservations and pins are
released when it closes. A ROUTER connection's ``get``/``read_parts`` is first admitted by the
zero-copy sender (``capacity`` when that connection has too many reply bytes unsent:
``zmq_send.py``). Every failure becomes an error reply with the request's id (0 when the
header is unreadable); nothing raised here reaches the receive loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence

from kvserver import wire
from kvserver.daemon.access import replay_refusal
from kvserver.daemon.auth import ANONYMOUS, Authenticator, Principal
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.local_server import LocalConnection
from kvserver.daemon.owners import DAEMON_OWNERS
from kvserver.daemon.service import KVService
from kvserver.daemon.zmq_ops import (
    Answer,
    DataOps,
    Deferred,
    OpCall,
    PayloadFrame,
    Result,
    failed,
    finish,
)
from kvserver.daemon.zmq_receive import Overflow
from kvserver.errors import InvalidArgument, KVServerError, Unauthenticated

#: request headers larger than this are decoded and validated on a thread, off the loop.
OFFLOAD_HEADER_BYTES = 256 << 10
#: ROUTER connections remembered as authenticated (for replay requests, which carry no token).
MAX_AUTHENTICATED_PEERS = 1 << 16

#: ops whose replies a ROUTER connection gets zero-copy (their pages pinned until sent)
_ZERO_COPY_OPS = frozenset((wire.GET, wire.READ_PARTS))

#: a connection: a ROUTER routing id, or a connection of the local channel.
Peer = bytes | LocalConnection
Frames = Sequence[PayloadFrame]
#: the rest of a request answered later (on its connection's lane)
Later = Callable[[], Awaitable[Answer]]


class RequestHandler:
    """Checks and carries out requests; see the module docstring."""

    def __init__(
        self,
        service: KVService,
        config: DaemonConfig,
        auth: Authenticator,
        ops: DataOps,
        send: Callable[[Peer, Answer], None],
        admit_send: Callable[[bytes], None] = lambda ident: None,
    ) -> None:
        self._service = service
        self._config = config
        self._auth = auth
        self._ops = ops
        self._send = send
        #: raises CapacityError when a ROUTER connection has too many reply bytes unsent
        #: (``ZeroCopySender.admit``); before its ``get``/``read_parts`` is carried out
        self._admit_send = admit_send
        #: local-channel connection → the lease owners (clients) its requests named
        self._local_clients: dict[LocalConnection, set[str]] = {}
        #: ROUTER connection → principal of its last authenticated request (oldest first, bounded)
        self._authenticated: dict[bytes, Principal] = {}

    def replay_refusal(self, peer: bytes) -> KVServerError | None:
        """Why ROUTER connection ``peer`` may not replay KV events now (None: it may)."""
        if not self._auth.required:
            return None
        return replay_refusal(self._authenticated.get(peer))

    def release_local(self, conn: LocalConnection) -> list[tuple[str, int]]:
        """Release the reservations and pins of every client ``conn``'s requests named;
        returns ``(client, leases released)`` for each that had any."""
        released = []
        for client in self._local_clients.pop(conn, ()):
            count = self._service.release_client(client)
            if count:
                released.append((client, count))
        return released

    def forget_connection(self, conn: LocalConnection) -> set[str]:
        """Forget which clients ``conn``'s requests named, releasing nothing; returns them."""
        return self._local_clients.pop(conn, set())

    def forget_local(self) -> None:
        """Stopping: the service rolls every lease back itself."""
        self._local_clients.clear()

    def handle(
        self,
        peer: Peer,
        owner: str,
        frames: Sequence[PayloadFrame],
        overflow: Overflow | None = None,
    ) -> Answer | Later | None:
        """Check and carry out one request; ``owner`` owns its leases unless it names its
        ``client``. The token is checked first, before anything else of the header is decoded
        (``wire.peek_auth``); a header over :data:`OFFLOAD_HEADER_BYTES` is decoded and
        validated on a thread (the rest of the request then runs on the connection's lane).
        ``overflow``: a ROUTER message received past its budget (``frames`` its header only),
        answered with its error once its token is checked."""
        req_id, who = 0, ANONYMOUS
        try:
            total = overflow.size if overflow is not None else sum(len(f) for f in frames)
            limit = self._config.max_message_bytes
            if total > limit:
                raise InvalidArgument("message too large", size=total, max=limit)
            if not frames:
                raise InvalidArgument("empty message")
            if self._auth.required:
                token, req_id = wire.peek_auth(frames[0].buffer)
                try:
                    who = self._auth.check(token)
                except Unauthenticated as exc:
                    if not isinstance(peer, bytes):
                        raise
                    refusal = failed(req_id, exc)  # sent now, later or never (refusals.py)
                    send = functools.partial(self._send, peer, refusal)
                    self._service.refusals.answer(peer, total, send)
                    return None
                if isinstance(peer, bytes):
                    self._remember(peer, who)
            if overflow is not None:
                raise overflow.error(limit)
            if len(frames[0]) > OFFLOAD_HEADER_BYTES:
                header = frames[0].buffer
                return lambda: self._handle_offloaded(req_id, header, peer, owner, frames, who)
            obj = wire.unpack_header(frames[0].buffer)
            req_id = wire.request_id_of(obj)
            out = self._carry_out(wire.parse_request(obj), peer, owner, frames, who)
        except Exception as exc:
            return failed(req_id, exc)
        if isinstance(out, Deferred):
            return lambda: finish(req_id, out)
        return Answer(req_id, out)

    async def _handle_offloaded(
        self,
        req_id: int,
        header: memoryview,
        peer: Peer,
        owner: str,
        frames: Frames,
        who: Principal,
    ) -> Answer:
        """A large request: decoded and validated on a thread, carried out on the loop."""
        try:
            obj = await asyncio.to_thread(wire.unpack_header, header)
            req_id = wire.request_id_of(obj)
            req = await asyncio.to_thread(wire.parse_request, obj)
            out = self._carry_out(req, peer, owner, frames, who)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return failed(req_id, exc)
        if isinstance(out, Deferred):
            return await finish(req_id, out)
        return Answer(req_id, out)

    def _remember(self, peer: bytes, who: Principal) -> None:
        """Note who a ROUTER connection is (the oldest is forgotten past the bound)."""
        self._service.refusals.forgive(peer)
        known = self._authenticated
        if peer not in known and len(known) >= MAX_AUTHENTICATED_PEERS:
            del known[next(iter(known))]
        known[peer] = who

    def _carry_out(
        self, req: wire.Request, peer: Peer, owner: str, frames: Frames, who: Principal
    ) -> Result | Deferred:
        if req.op not in wire.OPS_WITH_PAYLOAD and len(frames) > 1:
            raise InvalidArgument(f"{req.op} takes no payload frames", frames=len(frames) - 1)
        if req.client in DAEMON_OWNERS:  # their leases move bytes no request may cut short
            raise InvalidArgument("header field 'client' names a lease owner reserved for the "
                                  "daemon itself", client=req.client)  # fmt: skip
        client = who.owner(req.client or owner)
        if isinstance(peer, LocalConnection):
            self._local_clients.setdefault(peer, set()).add(client)
        elif req.op in _ZERO_COPY_OPS:
            self._admit_send(peer)
        return self._ops.handle(req.op, OpCall(req.args, frames[1:], client, who))
