"""Who may call the daemon: bearer tokens → principals.

Runs in the daemon process; used by both front ends (ZMQ and gRPC) on the event loop. An
:class:`Authenticator` is immutable once built: thread-safe.

A request carries a token (the ZMQ header's ``auth``, gRPC's ``authorization: Bearer``
metadata); :meth:`Authenticator.check` maps it to a :class:`Principal` or raises
:class:`~kvserver.errors.Unauthenticated`. With no token configured at all, every caller is
the unrestricted :data:`ANONYMOUS` principal (the daemon's own-user default is a generated
token, ``kvserver/daemon/process.py``; no token is an explicit choice). Tokens are compared by
their SHA-256 digests, so the time a check takes does not depend on how much of a guess
matches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from kvserver.errors import Unauthenticated


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller."""

    name: str


#: the caller when the daemon requires no token.
ANONYMOUS = Principal("anonymous")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Maps tokens to principals; see the module docstring."""

    def __init__(self, tokens: Iterable[tuple[str, Principal]] = ()) -> None:
        self._by_digest = {_digest(token): who for token, who in tokens if token}

    @classmethod
    def single(cls, token: str) -> Authenticator:
        """One shared token for the daemon's own principal ("" = no token required)."""
        return cls([(token, Principal("default"))] if token else [])

    @property
    def required(self) -> bool:
        """True when requests must carry a token."""
        return bool(self._by_digest)

    def check(self, token: str | None) -> Principal:
        """The principal of ``token``. Raises Unauthenticated when a token is required and
        ``token`` is missing or unknown."""
        if not self._by_digest:
            return ANONYMOUS
        who = self._by_digest.get(_digest(token)) if token else None
        if who is None:
            raise Unauthenticated("missing or wrong auth token")
        return who
