"""The client core shared by :class:`KVClient` (sync) and :class:`AsyncKVClient` (asyncio): a
:class:`Session`.

Runs in client processes (scheduler, workers, tools); imports no daemon code. Not thread-safe:
one :class:`Session` belongs to one client object.

Sans-I/O: every operation is a generator that yields :class:`~kvserver.client.calls.Call` s
and receives :class:`~kvserver.client.calls.Answer` s (or has the daemon's error thrown into
it), so the two clients differ only in how they exchange one call for one answer. The
operations themselves are :class:`~kvserver.client.calls.SessionCalls` (``calls.py``); this
module is the session they run in: identity and token, request framing, and reading replies.
Replies are read with :meth:`Session.decode` and :meth:`Session.outcome`, so a client with
several requests outstanding (the sync client's ``submit_*``, :mod:`kvserver.client.pending`)
can hand each reply to its own request; :meth:`Session.accept` is the one-request-in-flight
shortcut.

Session life: the first call (and the first after a timeout or a daemon restart, recognised by
a new server session id ``sid`` in a reply) runs ``hello`` — which maps the arena when the
daemon is on this host — and re-registers every namespace this client registered.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Sequence
from typing import Any

from kvserver import wire, wire_local
from kvserver.arena import ArenaView, is_arena_name
from kvserver.client.calls import Answer, Call, Proc, SessionCalls
from kvserver.client.handshake import Failure
from kvserver.client.parts import frame_buffer
from kvserver.crypto import CurveClient
from kvserver.errors import InvalidArgument, InvalidState, KVServerError, Unavailable
from kvserver.namespace import NamespaceSpec
from kvserver.token_file import TokenFile

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
#: the daemon's ZMQ data port by default (``kvserver start --zmq-port``)
DEFAULT_DATA_PORT = 9471
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2000
#: a daemon's ``max_message_bytes`` when its hello does not say (the daemon's default).
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


#: the forms :func:`data_address` takes, for its errors
ADDRESS_FORMS = (
    "tcp://HOST:PORT (PORT 1-65535, an IPv6 HOST may be in brackets), HOST[:PORT] "
    "(tcp:// and port 9471 implied) or ipc://PATH"
)


def data_address(text: str) -> str:
    """The daemon's ZMQ data endpoint for ``text``: an endpoint with a scheme
    (``tcp://HOST:PORT``, ``ipc://PATH``) as it is; ``HOST[:PORT]`` (ZMQ refuses it with a bare
    "Invalid argument") with ``tcp://`` and, without a port, the daemon's default
    :data:`DEFAULT_DATA_PORT`. IPv6 hosts may be bracketed (``tcp://`` with an unbracketed one
    is taken as ZMQ takes it: the port after the last colon; daemons before session 14 wrote
    that form into their fleet records, which ScoreHosts and the peer tier hand out, and
    ``tcp://`` requires a port, so it is not ambiguous). Raises InvalidArgument, naming ``text`` and
    :data:`ADDRESS_FORMS`, for anything else: "", another scheme (a daemon binds neither
    ``inproc://`` nor any other), a ``tcp://`` address without a host or with a port that is
    not 1-65535, an empty ``ipc://`` path (ZMQ would raise a bare ZMQError at the first
    call, or connect for ever to port 0 or 99999)."""
    text = text.strip()
    if not text:
        raise InvalidArgument(f"no daemon address: give {ADDRESS_FORMS} (its ZMQ data port)")
    if "://" in text:
        endpoint = text
    elif text.startswith("["):  # [v6] or [v6]:port
        endpoint = f"tcp://{text}" if "]:" in text else f"tcp://{text}:{DEFAULT_DATA_PORT}"
    elif text.count(":") > 1:  # a bare IPv6 address
        endpoint = f"tcp://[{text}]:{DEFAULT_DATA_PORT}"
    else:
        endpoint = f"tcp://{text}" if ":" in text else f"tcp://{text}:{DEFAULT_DATA_PORT}"
    why = endpoint_problem(endpoint)
    if why:
        raise InvalidArgument(f"bad daemon address {text[:200]!r}: {why}; give {ADDRESS_FORMS}")
    return endpoint


def endpoint_problem(endpoint: str) -> str:
    """Why ZMQ's connect to ``endpoint`` (``SCHEME://...``: a daemon's, or a scheduler's
    worker, ``scheduler/config.py``) could not work; "" when it can."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        return "" if rest else "no ipc:// path"
    if scheme != "tcp":
        return f"{scheme}:// is no transport of the daemon's data port"
    host, colon, port = rest.rpartition(":")
    if not colon:
        return "no port"
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        return f"port {port[:20]!r} is not 1-65535"
    if "[" in host or "]" in host:
        if not (host.startswith("[") and host.endswith("]") and len(host) > 2):
            return f"host {host[:80]!r} is not an IPv6 address in brackets"
        host = host[1:-1]
    if not host or host == "*":
        return "no host"
    if any(c.isspace() or c in "/[]" for c in host):
        return f"host {host[:80]!r} is no host name or address"
    return ""


def default_client_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class Session(SessionCalls):
    """Identity, daemon session, registered namespaces, the mapped arena, request ids; the
    operations are inherited from :class:`SessionCalls`."""

    def __init__(
        self,
        address: str,
        *,
        client_id: str | None = None,
        auth_token: str = "",
        colocated: bool | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        self.address = data_address(address)
        self.client_id = client_id or default_client_id()
        self.auth_token = auth_token
        #: without a token of our own: the one a daemon on this host left for its user
        self._token_file = TokenFile(self.address) if not auth_token else None
        self._sent_token = auth_token  # the token of the last request encoded
        self._presented = ""  # the token the newest DEALER presents at its handshake
        #: CURVE settings applied to every ZMQ socket of this session (None: plain TCP).
        self.curve = curve
        #: None: use shared memory when possible; False: never; True: required.
        self.colocated_mode = colocated
        self.needs_hello = True
        self.sid: str | None = None
        self.server: dict[str, Any] = {}
        self.specs: dict[str, NamespaceSpec] = {}
        self.arena: ArenaView | None = None
        self._next_id = 0

    # ------------------------------------------------------------------ framing

    def encode(self, call: Call) -> tuple[int, list[Any]]:
        """Frames of ``call`` with a fresh request id, carrying the token read last (no
        system call: the token file is read at connect and after a refusal)."""
        self._next_id += 1
        auth = self.auth_token if self._token_file is None else self._token_file.token()
        self._sent_token = auth
        header = wire.encode_request(
            self._next_id, call.op, call.args, auth=auth, client=self.client_id
        )
        return self._next_id, [header, *call.payload]

    def accept(self, frames: Sequence[Any], req_id: int) -> Answer | None:
        """The answer to ``req_id`` in ``frames``; None for a stale or unreadable reply.

        For a client with one request in flight. Raises the daemon's error (a typed
        KVServerError) for an error reply. A reply from a new daemon instance marks the session
        for a fresh hello.
        """
        reply = self.decode(frames)
        if reply is None:
            return None
        # id 0: the daemon could not read our header, and only one request is in flight.
        if reply.req_id != req_id and not (reply.req_id == 0 and not reply.ok):
            logger.debug("discarding stale reply %d (waiting for %d)", reply.req_id, req_id)
            return None
        outcome = self.outcome(reply, frames)
        if isinstance(outcome, KVServerError):
            raise outcome
        return outcome

    def decode(self, frames: Sequence[Any]) -> wire.Reply | None:
        """The reply header in ``frames``; None (logged) when it cannot be read."""
        try:
            return wire.decode_reply(frame_buffer(frames[0]))
        except InvalidArgument as exc:
            logger.warning("discarding unreadable reply from %s: %s", self.address, exc)
            return None

    def outcome(self, reply: wire.Reply, frames: Sequence[Any]) -> Answer | KVServerError:
        """What the request ``reply`` answers got: an Answer, or the daemon's typed error. A
        reply from a new daemon instance marks the session for a fresh hello."""
        if self.sid is not None and reply.sid != self.sid:
            logger.info("daemon at %s restarted; renewing the session", self.address)
            self.needs_hello = True
        if reply.error is not None:
            return reply.error
        return Answer(reply.result, [frame_buffer(f) for f in frames[1:]], reply.sid)

    @property
    def max_message_bytes(self) -> int:
        """The largest frame the daemon takes or sends, from its hello (``max_message_bytes``);
        its default, 1 GiB, when the hello did not say. The clients bound what they receive
        from it by this: a stream get's part, a local channel reply's frame."""
        limit = self.server.get("max_message_bytes")
        return limit if type(limit) is int and limit > 0 else DEFAULT_MAX_MESSAGE_BYTES

    def token(self) -> str:
        """The token requests carry now: ours, else the token file's (as read last)."""
        return self.auth_token if self._token_file is None else self._token_file.token()

    def token_changed(self) -> bool:
        """True when the token file (read again) holds another token than our last request
        carried or our DEALER presented (a restarted daemon refused it): retry once."""
        if self._token_file is None:
            return False
        token = self._token_file.reload()
        presented = self._presented if self.curve is None else token
        return bool(token) and (token != self._sent_token or token != presented)

    def handshake_token(self) -> str:
        """The token a new DEALER presents at the ZMQ handshake (``docs/wire.md`` §0): ours,
        else the token file's, read again (it may reach a restarted daemon); "" under CURVE
        (keys instead: a refused header token reloads it, :meth:`token_changed`) or without."""
        if self.curve is not None:
            return ""
        token = self.auth_token if self._token_file is None else self._token_file.reload()
        self._presented = token
        return token

    def timed_out(self, call: Call, timeout: float, why: Failure | None = None) -> KVServerError:
        """The error of a call without a reply (Unavailable); ``why``: the failed handshake
        that explains it (:meth:`kvserver.client.handshake.Failure.error`)."""
        self.needs_hello = True
        if why is not None and not why.silent:
            return why.error(f"cannot talk to {self.address}: {why}", op=call.op)
        because = f": {why}" if why is not None else ""
        return Unavailable(f"no reply from {self.address} within {timeout}s{because}", op=call.op)

    def local_path(self, refused: str | None = None) -> str | None:
        """The path of the daemon's local channel when this session may use it: its hello is
        current, the arena is mapped (same host), the daemon speaks this client's
        ``LOCAL_VERSION``, the path is the arena's beside it (``<arena_path>.sock``: not just
        any socket a daemon's ``hello`` names), and not ``refused`` (one that could not be
        used); else None (the transport uses ZMQ)."""
        info = self.server
        if self.needs_hello or self.arena is None:
            return None
        path = f"{self.arena.path}.sock"
        if (
            info.get("local_path") != path
            or info.get("local_version") != wire_local.LOCAL_VERSION
            or path == refused
        ):
            return None
        return path

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # ------------------------------------------------------------------ session

    def hello(self) -> Proc[dict[str, Any]]:
        answer = yield Call(wire.HELLO, {})
        info = answer.result
        self.sid, self.server = str(info["sid"]), info
        self.needs_hello = False
        self._map_arena(info)
        return info

    def _map_arena(self, info: dict[str, Any]) -> None:
        mode = self.colocated_mode
        path = info.get("arena_path")
        same_host = info.get("host_id") == wire.host_id() and isinstance(path, str)
        if self.arena is not None and (not same_host or self.arena.path != path):
            self.close()
        if mode is False or self.arena is not None:
            return
        if not same_host:
            if mode:
                raise InvalidState("colocated=True but the daemon runs on another host")
            return
        if not is_arena_name(str(path)):  # the daemon's word: never map just any file
            if mode:
                raise InvalidState("the daemon's arena_path does not name an arena", path=path)
            logger.info("not mapping %r: not an arena's name; using the remote data path", path)
            return
        try:
            arena = ArenaView.attach(str(path))
        except KVServerError as exc:
            if mode:
                raise
            logger.info("cannot map the arena (%s); using the remote data path", exc)
            return
        if arena.size != info.get("arena_size"):
            arena.close()
            raise InvalidState("arena size differs from what the daemon reports", path=path)
        self.arena = arena
