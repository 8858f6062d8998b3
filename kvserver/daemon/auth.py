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

Tenants (``[[tenants]]`` in the config file, ``kvserver/daemon/tenants.py``) are restricted
principals: the namespace models they may use, optionally the cache_salt values they may hash
with, and whether they may write. The daemon's own token (and no token at all) is the
unrestricted admin principal. The checks live here, in :class:`Principal`, and only here: both
front ends call them (``kvserver/daemon/access.py`` for the data plane, ``grpc_server.py``) for
every operation that names a namespace, before anything changes.

A namespace a tenant may not see is, to it, not registered: :meth:`Principal.may_use` raises
the very ``UnknownNamespace`` (message and context) that a namespace id registered nowhere
gets, so no answer tells a tenant whether another tenant's namespace id exists (listings and
stats already leave such namespaces out). Registering another model's spec, which the
caller names itself, stays ``PermissionDenied``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from kvserver.errors import PermissionDenied, Unauthenticated, UnknownNamespace
from kvserver.namespace import NamespaceSpec

#: in a tenant's ``models``: every model.
ANY_MODEL = "*"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: the admin (every field at its default) or a tenant.

    ``models``: the namespace models it may use (None: any; ``"*"`` in it: any);
    ``cache_salts``: the cache_salt values it may hash prompts with (None: any, including
    none); ``read_only``: lookups, loads, stats and events only (no register, store or pin).
    """

    name: str
    models: frozenset[str] | None = None
    cache_salts: frozenset[str] | None = None
    read_only: bool = False

    @property
    def is_admin(self) -> bool:
        """True for the unrestricted principal (the daemon's own token, or no auth)."""
        return self.models is None and self.cache_salts is None and not self.read_only

    def sees(self, spec: NamespaceSpec) -> bool:
        """True if this caller may use namespace ``spec`` at all (listing, stats, events)."""
        return self.models is None or ANY_MODEL in self.models or spec.model in self.models

    def may_use(self, spec: NamespaceSpec, *, write: bool = False) -> None:
        """Raise :func:`not_registered` unless this caller sees registered namespace ``spec``
        (the answer of an unregistered id: see the module docstring); PermissionDenied if
        ``write`` (store or pin in it) and this caller is read-only."""
        if not self.sees(spec):
            raise not_registered(spec.ns_id)
        if write:
            self.may_write()

    def may_register(self, spec: NamespaceSpec) -> None:
        """Raise PermissionDenied unless this caller may register ``spec`` (a spec the caller
        sent: naming its model tells it nothing)."""
        if not self.sees(spec):
            raise PermissionDenied(
                f"tenant {self.name!r} may not use namespaces of model {spec.model[:64]!r}"
            )
        self.may_write()

    def may_use_lease(self, spec: NamespaceSpec, lease_id: int, owner: str, *, write: bool) -> None:
        """Raise PermissionDenied unless this caller may use live lease ``lease_id`` of
        namespace ``spec`` owned by ``owner`` (``write``: write into it): a tenant only its own
        clients' leases (:meth:`owner`), in a namespace it sees; the refusal names neither the
        namespace, its model nor the owner. Namespace rights alone are not enough: two tenants
        may share a model, and a lease id is a small integer, easily guessed."""
        if not self.sees(spec) or not self.owns(owner):
            raise PermissionDenied(f"tenant {self.name!r} may not use this lease", lease=lease_id)
        if write:
            self.may_write()

    def owns(self, owner: str) -> bool:
        """True if lease owner ``owner`` is one of this caller's clients (the admin: every
        owner; a tenant: ``NAME/CLIENT``, and tenant names hold no '/')."""
        return self.is_admin or owner.startswith(f"{self.name}/")

    def may_write(self) -> None:
        """Raise PermissionDenied for a read-only caller."""
        if self.read_only:
            raise PermissionDenied(f"tenant {self.name!r} is read-only")

    def may_salt(self, cache_salt: str | None) -> None:
        """Raise PermissionDenied unless this caller may hash with ``cache_salt`` (None or
        "": no salt, allowed only when ``cache_salts`` is unset or lists "")."""
        if self.cache_salts is None or (cache_salt or "") in self.cache_salts:
            return
        raise PermissionDenied(
            f"tenant {self.name!r} may not use this cache_salt",
            cache_salt=(cache_salt or "")[:64],
        )

    def owner(self, client: str) -> str:
        """The lease owner of a request naming ``client``: a tenant's clients live in a name
        space of their own (one tenant cannot release another's leases by naming them)."""
        return client if self.is_admin else f"{self.name}/{client}"


def not_registered(ns_id: str) -> UnknownNamespace:
    """The error of a namespace id that is not registered here (``kvserver.engine.namespaces``), and
    so of one a tenant may not see."""
    return UnknownNamespace("namespace not registered", ns=ns_id)


#: the caller when the daemon requires no token.
ANONYMOUS = Principal("anonymous")
#: the holder of the daemon's own token.
ADMIN = Principal("default")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Maps tokens to principals; see the module docstring."""

    def __init__(self, tokens: Iterable[tuple[str, Principal]] = ()) -> None:
        self._by_digest = {_digest(token): who for token, who in tokens if token}

    @classmethod
    def single(cls, token: str) -> Authenticator:
        """One shared token for the daemon's own principal ("" = no token required)."""
        return cls([(token, ADMIN)] if token else [])

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
