"""Why a client's DEALER gets no replies: the ZMTP handshake with the daemon failed.

Runs in client processes, on the thread (or event loop) that owns the socket; not
thread-safe. A ZMQ socket whose security handshake fails (a wrong daemon public key, a client
key the daemon does not admit, CURVE on one side only) reconnects and fails again forever, and
its requests simply go unanswered. :class:`~kvserver.client.links.ConnectionWatch` listens to
the socket's monitor events so that the client can say which of these happened instead of "no
reply": its ``failure()`` is :func:`explain` of the latest failed handshake (None once one
succeeds), in the option names of ``docs/security.md``. Works for blocking and asyncio sockets
alike (the monitor socket is a blocking one on the same libzmq context, read without waiting).
"""

from __future__ import annotations

import zmq

#: the monitor events :func:`explain` reads
EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


def explain(event: int, value: int, curve: bool) -> str | None:
    """The reason for one monitor event of a client socket (``curve``: it uses CURVE); None
    for a successful handshake."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            "the daemon refused this client's CURVE key: its public key is not in the "
            "daemon's curve_clients_dir (give curve_secret_key_file, a key pair listed there)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve:
                return "the daemon does not use CURVE (leave curve_server_key_file unset)"
            return (
                "the daemon requires CURVE: give curve_server_key_file, the daemon's public "
                "key (docs/security.md)"
            )
        if curve and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "the CURVE handshake failed a cryptographic check (a wrong or corrupt key)"
        return f"the security handshake failed (ZMTP protocol error {value:#x})"
    if curve:  # the daemon closed the connection during the handshake: it could not decrypt
        return (
            "the daemon dropped the CURVE handshake: curve_server_key_file is not the daemon's "
            "public key"
        )
    # a plain client: the daemon saw the mechanism mismatch first and hung up (or it exited
    # during the handshake, which a retry tells apart)
    return (
        "the daemon dropped the handshake: it probably requires CURVE (give "
        "curve_server_key_file, the daemon's public key; docs/security.md)"
    )
