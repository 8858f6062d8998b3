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


def explain(
    event: int, value: int, curve: bool, *, peer: str = "daemon", option_prefix: str = ""
) -> str | None:
    """The reason for one monitor event of a client socket (``curve``: it uses CURVE); None
    for a successful handshake. ``peer`` names the server ("daemon", or "worker" for the
    scheduler's step channel), ``option_prefix`` the options' prefix on that channel
    (``step_``)."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    server_key = f"{option_prefix}curve_server_key_file"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the {peer} refused this client's CURVE key: its public key is not in the "
            f"{peer}'s {option_prefix}curve_clients_dir (give "
            f"{option_prefix}curve_secret_key_file, a key pair listed there)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve:
                return f"the {peer} does not use CURVE (leave {server_key} unset)"
            return (
                f"the {peer} requires CURVE: give {server_key}, the {peer}'s public "
                "key (docs/security.md)"
            )
        if curve and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "the CURVE handshake failed a cryptographic check (a wrong or corrupt key)"
        return f"the security handshake failed (ZMTP protocol error {value:#x})"
    if curve:  # the server closed the connection during the handshake: it could not decrypt
        return (
            f"the {peer} dropped the CURVE handshake: {server_key} is not the {peer}'s "
            "public key"
        )
    # a plain client: the server saw the mechanism mismatch first and hung up (or it exited
    # during the handshake, which a retry tells apart)
    return (
        f"the {peer} dropped the handshake: it probably requires CURVE (give "
        f"{server_key}, the {peer}'s public key; docs/security.md)"
    )
