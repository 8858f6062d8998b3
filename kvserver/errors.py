"""The one exception hierarchy of kvserver.

Every error a caller can provoke with bad input is a :class:`KVServerError` subclass. Each
carries a stable machine-readable ``code`` (used in ZMQ error replies and mapped to gRPC status
codes at the edge) and keyword context (namespace, key, lease, path, errno ...) that is shown in
the message. A full cache is *not* an error: ``prepare_store`` returns ``None`` for it.

Raising any of these leaves the raising object's state unchanged (the check-then-act rule).
"""

from __future__ import annotations

from typing import Any, ClassVar


class KVServerError(Exception):
    """Base class. ``code`` names the error kind on the wire."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.context = context
        super().__init__(message)

    def __str__(self) -> str:
        if not self.context:
            return self.message
        ctx = ", ".join(f"{k}={_short(v)}" for k, v in sorted(self.context.items()))
        return f"{self.message} ({ctx})"


def _short(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return value.hex()[:16] + ("…" if len(value) > 8 else "")
    return repr(value)


class InvalidArgument(KVServerError):
    """A request is malformed: wrong types, out-of-range values, wrong sizes."""

    code = "invalid_argument"


class UnsupportedVersion(InvalidArgument):
    """A wire message or on-disk record has a version this build does not speak."""

    code = "unsupported_version"


class UnknownNamespace(KVServerError):
    """A namespace id that was never registered (or was removed)."""

    code = "unknown_namespace"


class UnknownKey(KVServerError):
    """A chunk key that is not present (or not ready) in the namespace."""

    code = "unknown_key"


class LeaseError(KVServerError):
    """A lease id that does not exist: never issued, already completed, or expired."""

    code = "lease_error"


class LeaseExpired(LeaseError):
    """The lease existed but its deadline passed and its resources were reclaimed."""

    code = "lease_expired"


class InvalidState(KVServerError):
    """The operation is not allowed in the current state (e.g. a part completed twice)."""

    code = "invalid_state"


class CapacityError(KVServerError):
    """A request can never fit (larger than the whole tier), as opposed to a full cache."""

    code = "capacity"


class StorageError(KVServerError):
    """An OS-level failure of a storage medium; carries ``path`` and ``errno``."""

    code = "storage_error"


class Unauthenticated(KVServerError):
    """Missing or wrong shared secret."""

    code = "unauthenticated"


class PermissionDenied(KVServerError):
    """An authenticated caller (a tenant) asked for a namespace, cache_salt or operation its
    token does not grant; nothing changed."""

    code = "permission_denied"


class Unavailable(KVServerError):
    """The daemon could not be reached within the call's timeout, or the connection a
    request was outstanding on failed or was lost (what the daemon did with it is unknown)."""

    code = "unavailable"


ERRORS_BY_CODE: dict[str, type[KVServerError]] = {
    cls.code: cls
    for cls in (
        KVServerError,
        InvalidArgument,
        UnsupportedVersion,
        UnknownNamespace,
        UnknownKey,
        LeaseError,
        LeaseExpired,
        InvalidState,
        CapacityError,
        StorageError,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
    )
}


def error_from_code(code: str, message: str, **context: Any) -> KVServerError:
    """Rebuild a typed error from a wire reply (unknown codes become the base class)."""
    return ERRORS_BY_CODE.get(code, KVServerError)(message, **context)
