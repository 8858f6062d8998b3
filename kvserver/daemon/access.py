"""Which data-plane request a principal may make: every wire op mapped to its
:class:`~kvserver.daemon.auth.Principal` check.

Runs in the daemon process, on its event loop; :meth:`DataOps.handle
<kvserver.daemon.zmq_ops.DataOps.handle>` calls :func:`authorize` for every validated request
of the ZMQ ROUTER and the local channel alike, before the op runs: a refused request raises
``PermissionDenied`` and changes nothing. The admin principal is never checked (no cost on the
hot path). The gRPC front end calls the same ``Principal`` methods, through
:func:`allow_prefix` for the RPCs that name a prompt.

What is checked: the namespace an op names (``ns_id``: one the tenant may not see is
answered as if not registered, ``auth.py``; the spec to register; or the namespace of the
lease an op names: ``complete_store``, ``write_parts``, ``complete_load``,
``read_parts``) against the tenant's models, and the lease's owner: a tenant uses its own
clients' leases only (lease ids are small integers; two tenants may share a model); writes
(register, store, pin, unpin) against ``read_only``; ``lookup_tokens``' ``cache_salt``
against the tenant's salts. Chunk keys are opaque hashes: an op that names keys cannot tell
which cache_salt made them, so a tenant with salts still reaches, by key, every chunk of a
namespace its models allow. A lease op naming a
lease the daemon itself owns (``owners.py``: bytes are moving in or out of its pages) is
refused for every principal, the admin included.
"""

from __future__ import annotations

from typing import Any

from kvserver import wire
from kvserver.daemon.auth import Principal
from kvserver.daemon.owners import DAEMON_OWNERS
from kvserver.daemon.service import KVService
from kvserver.errors import KVServerError, PermissionDenied, Unauthenticated
from kvserver.namespace import NamespaceSpec

#: ops that read a namespace named by ``ns_id``.
_READ_NS = frozenset({wire.LOOKUP, wire.LOOKUP_TOKENS, wire.TOUCH, wire.PREPARE_LOAD, wire.GET,
                      wire.READ_PARTS})  # fmt: skip
#: ops that change a namespace named by ``ns_id``.
_WRITE_NS = frozenset({wire.PREPARE_STORE, wire.PUT, wire.PIN, wire.UNPIN})
#: ops on a lease, by whether they write.
_LEASE_OPS = {wire.COMPLETE_STORE: True, wire.WRITE_PARTS: True, wire.COMPLETE_LOAD: False,
              wire.READ_PARTS: False}  # fmt: skip


def authorize(who: Principal, service: KVService, op: str, args: dict[str, Any]) -> None:
    """Raise PermissionDenied (or UnknownNamespace: not registered, or not ``who``'s to
    see, one answer for both) unless ``who`` may make request ``op`` with (validated)
    ``args``; see the module docstring."""
    owner = service.lease_owner(args["lease_id"]) if op in _LEASE_OPS else None
    if owner in DAEMON_OWNERS:
        # the admin too: the daemon's own leases guard bytes in flight (``owners.py``)
        raise PermissionDenied("the lease is the daemon's own", lease=args["lease_id"])
    if who.is_admin:
        return
    if op == wire.REGISTER_NAMESPACE:
        who.may_register(NamespaceSpec.from_dict(args["spec"]))
        return
    if op in _READ_NS or op in _WRITE_NS:
        who.may_use(service.namespace(args["ns_id"]), write=op in _WRITE_NS)
    if op == wire.LOOKUP_TOKENS:
        who.may_salt(args["cache_salt"])
    write = _LEASE_OPS.get(op)
    if write is not None:
        spec = service.lease_namespace(args["lease_id"])
        if spec is not None and owner is not None:  # no such lease: the op itself says so
            who.may_use_lease(spec, args["lease_id"], owner, write=write)
        elif write:
            who.may_write()


def allow_prefix(who: Principal, spec: NamespaceSpec, request: Any, *, write: bool = False) -> None:
    """gRPC: UnknownNamespace (as if not registered) unless ``who`` sees ``spec``;
    PermissionDenied unless it may use it (``write``: change it) with the
    cache_salt of ``request``'s ``tokens`` prefix, if it has one (Lookup, Pin, Unpin,
    ScoreHosts)."""
    if who.is_admin:
        return
    who.may_use(spec, write=write)
    if request.WhichOneof("prefix") == "tokens":
        who.may_salt(request.tokens.cache_salt or None)


def visible_namespaces(who: Principal, service: KVService) -> list[NamespaceSpec]:
    """The registered namespaces ``who`` may see."""
    return [spec for spec in service.list_namespaces() if who.sees(spec)]


def visible_stats(who: Principal, service: KVService, stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` (``KVService.stats()``) with the per-namespace sections cut to what ``who``
    sees; daemon-wide totals and capacities stay (they name no namespace)."""
    if who.is_admin:
        return stats
    seen = {spec.ns_id for spec in visible_namespaces(who, service)}
    out = dict(stats)
    out["namespaces"] = {k: v for k, v in stats["namespaces"].items() if k in seen}
    for tier, _ in service.tier_stats():
        section = out.get(tier.name)
        if isinstance(section, dict) and isinstance(section.get("namespaces"), dict):
            rows = section["namespaces"]
            out[tier.name] = section | {"namespaces": {k: v for k, v in rows.items() if k in seen}}
    return out


def replay_refusal(who: Principal | None) -> KVServerError | None:
    """Why a ZMQ replay request of a connection whose last authenticated request was made by
    ``who`` (None: none) is refused, or None: the replay carries every namespace's events, so
    it is the admin's only."""
    if who is None:
        return Unauthenticated("replay needs a connection that sent an authenticated request")
    if not who.is_admin:
        return PermissionDenied(f"tenant {who.name!r} may not replay KV events (admin only)")
    return None
