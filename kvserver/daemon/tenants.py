"""Tenants: the ``[[tenants]]`` tables of the daemon's config file → tokens and principals.

Runs in the daemon process while the configuration is read (``DaemonConfig``), before
anything listens: a malformed table, an unreadable or world-readable token file, a duplicate
name or token is an ``InvalidArgument`` that names the tenant, and ``kvserver start`` exits 2.
Immutable once built: thread-safe.

One table per tenant (docs/security.md, "Tenants")::

    [[tenants]]
    name = "team-a"
    token_file = "/etc/kvserver/team-a.token"  # or token = "..."; the file is preferred
    models = ["llama-3-8b"]                     # namespace models it may use; "*": any
    cache_salts = ["team-a"]                    # optional: the cache_salt values it may use
    read_only = false                           # true: look up, load, stats, events only

What a tenant may do is decided by its :class:`~kvserver.daemon.auth.Principal`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserver.crypto import MAX_TOKEN_BYTES
from kvserver.daemon.auth import Principal
from kvserver.errors import InvalidArgument
from kvserver.token_file import read_token_file

_FIELDS = frozenset({"name", "token", "token_file", "models", "cache_salts", "read_only"})
MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of the config file, its token already read (see the module docstring)."""

    name: str
    token: str = field(repr=False)
    models: tuple[str, ...]
    cache_salts: tuple[str, ...] | None = None
    read_only: bool = False

    @property
    def principal(self) -> Principal:
        salts = frozenset(self.cache_salts) if self.cache_salts is not None else None
        return Principal(self.name, frozenset(self.models), salts, self.read_only)


def parse_tenants(value: Any) -> tuple[Tenant, ...]:
    """The tenants of the config file's ``tenants`` value (a list of tables); raises
    InvalidArgument naming the tenant and the field for anything malformed."""
    if isinstance(value, tuple) and all(isinstance(t, Tenant) for t in value):
        return value
    if not isinstance(value, list):
        raise InvalidArgument(
            "tenants must be [[tenants]] tables in the config file (docs/security.md)"
        )
    tenants = tuple(_tenant(i, table) for i, table in enumerate(value))
    names = [t.name for t in tenants]
    tokens = [t.token for t in tenants]
    if len(set(names)) != len(names):
        raise InvalidArgument("tenant names must be unique", names=names)
    if len(set(tokens)) != len(tokens):
        raise InvalidArgument("two tenants have the same token")
    return tenants


def _tenant(index: int, table: Any) -> Tenant:
    where = f"tenants[{index}]"
    if not isinstance(table, dict):
        raise InvalidArgument(f"{where} must be a table")
    name = table.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or "/" in name:
        raise InvalidArgument(f"{where}: name must be a non-empty string (<= 64 chars, no '/')")
    where = f"tenant {name!r}"
    unknown = set(table) - _FIELDS
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown fields {', '.join(sorted(map(str, unknown)))}; "
            f"valid: {', '.join(sorted(_FIELDS))}"
        )
    models = _strings(where, "models", table.get("models"))
    if models is None or not models:
        raise InvalidArgument(f'{where}: models must list the models it may use ("*": any)')
    salts = _strings(where, "cache_salts", table.get("cache_salts"))
    read_only = table.get("read_only", False)
    if not isinstance(read_only, bool):
        raise InvalidArgument(f"{where}: read_only must be true or false")
    return Tenant(name, _token(where, table), models, salts, read_only)


def _strings(where: str, key: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{where}: {key} must be a list of strings")
    return tuple(value)


def _token(where: str, table: dict[str, Any]) -> str:
    token, path = table.get("token"), table.get("token_file")
    if (token is None) == (path is None):
        raise InvalidArgument(f"{where}: set exactly one of token_file or token")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise InvalidArgument(f"{where}: token_file must be a path")
        token = read_token_file(path, where)
    if not isinstance(token, str) or len(token.strip()) < 16:
        raise InvalidArgument(f"{where}: the token must be a string of at least 16 characters")
    if len(token.strip().encode()) > MAX_TOKEN_BYTES:  # the handshake's PLAIN password
        raise InvalidArgument(f"{where}: the token is over {MAX_TOKEN_BYTES} bytes")
    return token.strip()


def tenant_tokens(tenants: Sequence[Tenant]) -> list[tuple[str, Principal]]:
    """(token, principal) of every tenant, for the ``Authenticator``."""
    return [(t.token, t.principal) for t in tenants]
