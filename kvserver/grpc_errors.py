"""The kvserver error of a failed gRPC call to a daemon: the daemon's typed error rebuilt from
the ``kvserver-error-code`` trailing metadata, else one from the gRPC status (with a hint when
TLS is the likely reason a connection failed).

Runs in any process with a gRPC client of the daemon (``kvserver.grpc_client``,
``kvserver.grpc_events``); pure functions and one error type, no state. The daemon's side of
the mapping (its errors to a status and trailing metadata) is in
``kvserver/daemon/grpc_server.py``; the metadata keys both use are in
``kvserver/grpc_format.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc

from kvserver.errors import (
    InvalidArgument,
    KVServerError,
    Unauthenticated,
    Unavailable,
    error_from_code,
)
from kvserver.grpc_format import ERROR_CODE_KEY, EVENTS_DROPPED_CODE, OLDEST_SEQ_KEY


class EventsDropped(KVServerError):
    """WatchEvents cannot resume where asked (events dropped, or the daemon restarted).

    Resynchronise (e.g. Lookup what you track), then watch again from ``oldest_seq``.
    """

    code: ClassVar[str] = EVENTS_DROPPED_CODE

    def __init__(self, message: str, *, oldest_seq: int = 0) -> None:
        super().__init__(message)
        self.oldest_seq = oldest_seq


def rpc_error(exc: grpc.RpcError, target: str, tls: bool | None = None) -> KVServerError:
    """The kvserver error of a failed call (typed when the daemon said which). ``tls``:
    whether the channel uses TLS (None: unknown), to say when a TLS mismatch is the likely
    reason a connection failed."""
    call: Any = exc
    status = call.code()
    details = call.details() or status.name
    metadata = dict(call.trailing_metadata() or ())
    code = metadata.get(ERROR_CODE_KEY)
    if code == EVENTS_DROPPED_CODE:
        oldest = metadata.get(OLDEST_SEQ_KEY, "0")
        return EventsDropped(details, oldest_seq=int(oldest) if oldest.isdigit() else 0)
    if isinstance(code, str) and code:
        return error_from_code(code, details)
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        hint = _tls_hint(details, tls)
        return Unavailable(f"kvserver at {target} is unreachable ({status.name}): {details}{hint}")
    if status == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(details)
    if status in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return InvalidArgument(details, status=status.name)
    return KVServerError(details, status=status.name)


def _tls_hint(details: str, tls: bool | None) -> str:
    """What a connection failure's ``details`` say about TLS, in the client options' names."""
    low = details.lower()
    if tls and any(w in low for w in ("ssl", "handshake", "certificate", "tls")):
        return (
            "; the TLS handshake failed: tls_ca_file must be the CA of the daemon's "
            "certificate, tls_server_name a name in it, and tls_cert_file/tls_key_file a "
            "client certificate when the daemon requires one (docs/security.md)"
        )
    if tls is False and "socket closed" in low:
        return (
            "; the daemon closed the connection: if it serves gRPC over TLS, give tls_ca_file "
            "(--tls-ca-file; docs/security.md)"
        )
    return ""
