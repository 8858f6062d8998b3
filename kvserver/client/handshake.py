"""Why a client's DEALER gets no replies: the ZMTP handshake with the daemon failed.

Runs in client processes, on the thread (or event loop) that owns the socket; not
thread-safe. A ZMQ socket whose security handshake fails (a wrong daemon public key, a client
key the daemon does not admit, a token the daemon refuses, CURVE or a token on one side only)
reconnects and fails again forever, and its requests simply go unanswered.
:class:`~kvserver.client.links.ConnectionWatch` listens to the socket's monitor events so that
the client can say which of these happened instead of "no reply": its ``failure()`` is
:func:`explain` of the latest failed handshake (None once one succeeds), in the option names
of ``docs/security.md``. And when no handshake failed, :func:`explain_silence` says why a
request timed out all the same: nothing accepted the connection (no daemon there), or what
accepted it never began the ZMQ handshake (a wrong port: the daemon's gRPC or metrics port).
Works for blocking and asyncio sockets alike (the monitor socket is a blocking one on the same
libzmq context, read without waiting).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from kvserver.errors import KVServerError, Unauthenticated, Unavailable

#: the monitor events :func:`explain` reads
EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a handshake failed, in the option names of ``docs/security.md``;
    ``unauthenticated``: the daemon refused the token the client presented, or wants one and
    got none (a wrong token, or a daemon restarted with a new one: worth re-reading the token
    file and retrying once)."""

    reason: str
    unauthenticated: bool = False
    #: no handshake failed: why the server never answered (:func:`explain_silence`)
    silent: bool = False

    def __str__(self) -> str:
        return self.reason

    def error(self, message: str, **context: object) -> KVServerError:
        """The error a request waiting on the socket fails with: Unauthenticated for a token
        refused or wanted, else Unavailable."""
        kind = Unauthenticated if self.unauthenticated else Unavailable
        return kind(message, **context)


#: the mechanisms of a client socket: no credentials, a token (PLAIN), CURVE keys
MECHANISMS = ("null", "plain", "curve")

_NO_TOKEN = (
    "requires a token at the handshake: give auth_token (a daemon on this host "
    "leaves its token in a file only its user can read; set KVSERVER_SHM_DIR if it runs with "
    "another --shm-dir), or curve_server_key_file if it uses CURVE (docs/security.md)"
)


def explain(
    event: int, value: int, mechanism: str, *, peer: str = "daemon", option_prefix: str = ""
) -> Failure | None:
    """The reason for one monitor event of a client socket whose security ``mechanism`` is one
    of :data:`MECHANISMS`; None for a successful handshake. ``peer`` names the server
    ("daemon", or "worker" for the scheduler's step channel), ``option_prefix`` the options'
    prefix on that channel (``step_``)."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    curve = mechanism == "curve"
    server_key = f"{option_prefix}curve_server_key_file"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if mechanism == "plain":
            return Failure(
                f"the {peer} refused this client's auth token at the handshake (a wrong token; "
                "give the daemon's --auth-token or a tenant's token as auth_token)",
                unauthenticated=True,
            )
        return Failure(
            f"the {peer} refused this client's CURVE key: its public key is not in the "
            f"{peer}'s {option_prefix}curve_clients_dir (give "
            f"{option_prefix}curve_secret_key_file, a key pair listed there)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve:
                return Failure(f"the {peer} does not use CURVE (leave {server_key} unset)")
            if mechanism == "plain":
                return Failure(
                    f"the {peer} takes no token at the handshake: it requires CURVE (give "
                    f"{server_key}) or no token at all (it runs with --no-auth: leave "
                    "auth_token unset)"
                )
            if peer != "daemon":  # no tokens on that channel: it can only be CURVE
                return Failure(
                    f"the {peer} requires CURVE: give {server_key}, the {peer}'s public "
                    "key (docs/security.md)"
                )
            return Failure(f"the daemon {_NO_TOKEN}", unauthenticated=True)
        if curve and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return Failure(
                "the CURVE handshake failed a cryptographic check (a wrong or corrupt key)"
            )
        return Failure(f"the security handshake failed (ZMTP protocol error {value:#x})")
    if curve:  # the server closed the connection during the handshake: it could not decrypt
        return Failure(
            f"the {peer} dropped the CURVE handshake: {server_key} is not the {peer}'s public key"
        )
    if mechanism == "null" and peer == "daemon":  # it saw the mismatch first and hung up
        return Failure(
            f"the daemon dropped the handshake: it probably {_NO_TOKEN}", unauthenticated=True
        )
    # the server saw the mechanism mismatch first and hung up (or it exited during the
    # handshake, which a retry tells apart)
    tail = " or takes no token (--no-auth: leave auth_token unset)" if mechanism == "plain" else ""
    return Failure(
        f"the {peer} dropped the handshake: it probably requires CURVE (give "
        f"{server_key}, the {peer}'s public key; docs/security.md){tail}"
    )


#: where each server's ZMQ port is set, for :func:`explain_silence`
_PORT_HINTS = {
    "daemon": (
        "the daemon's ZMQ data port: `kvserver start --zmq-port`, 9471 by default; 9470 is "
        "its gRPC port, 9473 its metrics"
    ),
    "worker": "a worker's step channel: its `kvserver worker --listen` address",
}


def explain_silence(*, connected: bool, refused: bool, peer: str = "daemon") -> Failure | None:
    """Why a socket whose handshake never failed got no reply, from what its monitor saw:
    ``refused`` (a connection attempt failed: refused, unreachable) and ``connected`` (one was
    accepted) since it was made, no handshake completed. None when neither explains it (the
    server is slow, or nothing was tried yet)."""
    hint = f" ({_PORT_HINTS[peer]})" if peer in _PORT_HINTS else ""
    if connected:
        return Failure(
            "it accepted the connection but never began the ZMQ handshake: is that the "
            f"{peer}'s ZMQ port?{hint}",
            silent=True,
        )
    if refused:
        start = "`kvserver start`" if peer == "daemon" else f"the {peer}"
        return Failure(
            f"nothing accepts connections there (refused or unreachable): is {start} running "
            f"on that host and port?{hint}",
            silent=True,
        )
    return None
