"""The step channel's default token: a worker's step port on loopback admits only its own user.

Runs in the worker processes (:class:`StepGate`, in :func:`step_protocol.serve.serve_steps`'s
loop, the thread that owns the sockets; not thread-safe) and in the scheduler
(:func:`scheduler_token`, while it makes its DEALERs). ``docs/security.md``, "The engine".

Why: a worker obeys whoever reaches its ROUTER: a ``hello`` makes it forget every request, a
``step`` runs compute on its device and, with ``--kvserver``, stores its GPU blocks in the
daemon under the keys the plan names (with the worker's own daemon token) — a local user who
could connect to a worker's TCP port could poison the shared cache. CURVE with
``--step-curve-clients-dir`` restricts that (required beyond loopback); without CURVE, on
loopback, a worker is safe by default the daemon's way:

- a worker bound to ``tcp://`` without CURVE (and without ``--step-no-auth``) makes a random
  token, requires it at the ZMQ handshake (PLAIN, the token as password, checked by the
  daemon's ZAP handler logic, :meth:`kvserver.daemon.zap.HandshakeGate.answer`: one digest and
  one look-up per handshake, a refused peer is disconnected before any message of it is read),
  and leaves it for its user in ``kvserver/token_file.py``'s file of its port (0600 in a 0700
  directory; removed at exit);
- the scheduler, connecting to a loopback worker without CURVE, reads that file of the
  worker's port (:func:`scheduler_token`) and presents the token
  (:func:`kvserver.crypto.apply_token`) on every new DEALER (a restarted worker's new token is
  read when the scheduler reconnects);
- ``ipc://`` endpoints are guarded by the file system (the synthetic workers' sockets live in
  the scheduler's private 0700 directory) and take no token; with CURVE the CURVE rules apply
  (a ZMQ socket has one mechanism).
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from kvserver.crypto import CurveClient, apply_token
from kvserver.daemon.auth import Authenticator
from kvserver.daemon.refusals import HandshakeCounts
from kvserver.daemon.zap import ZAP_ENDPOINT, HandshakeGate
from kvserver.token_file import (
    TokenFile,
    TokenFiles,
    remove_token_files,
    server_token,
    token_path,
    write_token_files,
)

logger = logging.getLogger(__name__)


def _tcp_port(endpoint: str) -> int | None:
    """The port of a bound ``tcp://host:port`` endpoint; None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rsplit(":", 1)[-1]
    return int(port) if port.isdigit() else None


class StepGate:
    """A worker ROUTER's handshake check; see the module docstring.

    Call order: ``StepGate.for_worker(ctx, bind, ...)`` (None when no token applies) →
    ``guard(router)`` before it binds → ``publish(endpoint)`` once bound → the serve loop polls
    :attr:`socket` and calls :meth:`drain` when it is readable → ``close()``.
    """

    def __init__(self, ctx: zmq.Context[Any], token: str) -> None:
        self.token = token
        self.counts = HandshakeCounts()
        self._gate = HandshakeGate(ctx, self.counts, auth=Authenticator.single(token))
        # the handler must be bound before the ROUTER binds: PLAIN without one admits anyone
        self.socket: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.bind(ZAP_ENDPOINT)
        self._files: TokenFiles | None = None

    @classmethod
    def for_worker(
        cls, ctx: zmq.Context[Any], bind: str, *, curve: bool, no_auth: bool
    ) -> StepGate | None:
        """The gate of a worker binding ``bind``: a random token for a ``tcp://`` endpoint
        without CURVE, unless ``no_auth``; None otherwise. A file left for the port by a killed
        worker is removed by :meth:`publish` of a worker that takes no token (see there)."""
        if curve or no_auth or not bind.startswith("tcp://"):
            return None
        return cls(ctx, server_token("", False))

    def guard(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (the ROUTER, not yet bound) a PLAIN server checked by this gate."""
        sock.setsockopt(zmq.PLAIN_SERVER, 1)

    def publish(self, endpoint: str) -> None:
        """Leave the token for this user's scheduler in the token file of ``endpoint``'s
        port. Raises KVServerError when the token directory is not private to this user."""
        port = _tcp_port(endpoint)
        if port is not None:
            self._files = write_token_files(self.token, {port})

    def drain(self) -> None:
        """Answer the ZAP requests waiting (libzmq asks one per handshake)."""
        sock = self.socket
        while sock.poll(0):
            # made by libzmq from the handshake (inproc, bounded frames), not sent by a peer
            frames = sock.recv_multipart()
            reply = self._gate.answer(frames[2:]) if len(frames) >= 2 else None
            if reply is not None:
                sock.send_multipart([*frames[:2], *reply])
                if reply[2] != b"200":
                    logger.warning("step channel: refused a handshake (a wrong or missing "
                                   "token; %d so far)", self.counts.refused_token)  # fmt: skip

    def close(self) -> None:
        """Close the handler's socket and remove the token file."""
        self.socket.close(0)
        if self._files is not None:
            self._files.close()
            self._files = None


def unpublish_stale(endpoint: str) -> None:
    """A worker that takes no token removes a token file a killed worker left for its port
    (the scheduler would otherwise present a stale token and be refused)."""
    port = _tcp_port(endpoint)
    if port is not None:
        remove_token_files([token_path(port)])


def scheduler_token(address: str, curve: CurveClient | None) -> tuple[str, str | None]:
    """The token the scheduler presents to the worker at ``address`` and the file it came
    from: without CURVE, a loopback ``tcp://`` worker's token file (``("", path)`` when it has
    none: a worker with ``--step-no-auth``); ``("", None)`` otherwise."""
    if curve is not None:
        return "", None
    source = TokenFile(address)
    return source.token(), source.path


def present_token(sock: zmq.Socket[Any], token: str) -> str:
    """Make the DEALER ``sock`` (not yet connected) present ``token`` (none when empty);
    returns its mechanism for :class:`kvserver.client.links.ConnectionWatch`."""
    if not token:
        return "null"
    apply_token(sock, token)
    return "plain"


def explain(mechanism: str, why: str, token_path_: str | None) -> str:
    """``why`` (a failed handshake, said by ``kvserver.client.handshake``) in the step
    channel's terms when the step token is involved: a refused token, or none presented to a
    worker that may want one."""
    if mechanism == "plain":
        return (
            f"the worker refused the step token read from {token_path_} at the handshake (a "
            "stale file, or another worker on that port): restart the worker, or give it "
            "--step-no-auth"
        )
    if mechanism == "null" and token_path_ is not None:
        return (
            f"{why}; or it requires its step token, which this scheduler could not read from "
            f"{token_path_} (run the scheduler as the worker's user, or give the worker CURVE "
            "keys or --step-no-auth; docs/security.md)"
        )
    return why
