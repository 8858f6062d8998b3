"""``ScoreHosts`` and the cluster part of ``Stats`` on the gRPC API: both ends of the mapping
between protobuf messages and ``kvserver.cluster`` values (docs/grpc.md, docs/cluster.md).

Server side (runs on the daemon's event loop, called by ``kvserver/daemon/grpc_server.py``):
``await score_hosts(service, request)`` → ``ScoreHostsResponse``; ``cluster_stats(dict)`` →
``ClusterStats``. Client side (any process): ``call_score_hosts(grpc_client, ...)`` →
``list[HostScore]``-like dicts for ``kvserver lookup --fleet`` and routers.

The prompt is hashed with the namespace's parameters: the daemon's own registration, or
else the spec a member published in the fleet (``kvs1:{fleet}:ns``), so any daemon of the
fleet can score a prompt of any model in it. The hashing is the service's
(``ScoringService.hash_prompt``): a long prompt hashes on a thread, the loop serving others.
"""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.cluster.config import check_weights
from kvserver.cluster.schema import MAX_SPEC_BYTES, TIERS
from kvserver.cluster.scoring import HostScore, score_runs
from kvserver.engine.types import CutKeys
from kvserver.errors import InvalidArgument, InvalidState, UnknownNamespace
from kvserver.grpc_format import keys_from_proto, token_ids_from_proto
from kvserver.namespace import NamespaceSpec
from kvserver.prompts import check_prompt_size

MAX_KEYS = 1 << 16
NOWHERE = "namespace registered nowhere in the fleet"
MAX_NAMESPACE_ID = 64
#: most ``candidate_hosts`` one ScoreHosts may name (duplicates counted): a bound on the
#: strings and sets a request makes, far above any fleet's size. 1.5M names (12 MB) cost the
#: daemon +254 MB and ~1.2 s of its loop when there was none.
MAX_CANDIDATE_HOSTS = 4096


class ScoringService(Protocol):
    """What ``score_hosts`` reads of the daemon's service (``kvserver.daemon.service.KVService``,
    which this package does not import: the daemon builds on it)."""

    #: the daemon's ``ClusterNode``, or None when it is not in a fleet.
    cluster: Any

    def find_namespace(self, ns_id: str) -> NamespaceSpec | None:
        """The namespace registered on this daemon with that id, or None."""
        ...

    def hash_prompt(
        self,
        spec: NamespaceSpec,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        caller: str = "",
    ) -> Sequence[bytes] | Awaitable[Sequence[bytes]]:
        """The chunk keys of a prompt in ``spec``; awaitable when hashed on a thread."""
        ...


async def score_hosts(
    service: ScoringService,
    req: Any,
    *,
    allow: Callable[[NamespaceSpec, Any], None] | None = None,
    caller: str = "",
) -> Any:
    """Answer one ``ScoreHostsRequest`` (see the proto for the contract). ``allow(spec,
    req)``, when given, raises (e.g. PermissionDenied) if the caller may not ask about the
    namespace, before any hashing or fleet lookup (an UnknownNamespace it raises, for a
    namespace the caller may not see, is answered as one registered nowhere); ``caller``
    names it to the service's bound on prompts hashing (``hash_prompt``)."""
    node = service.cluster
    if node is None:
        raise InvalidState("this daemon is not part of a fleet (start it with --cluster)")
    ns_id = req.namespace_id
    if not ns_id or len(ns_id) > MAX_NAMESPACE_ID:
        raise InvalidArgument("namespace_id is required (at most 64 characters)")
    # counted before a Python object is made of any of them
    if len(req.candidate_hosts) > MAX_CANDIDATE_HOSTS:
        raise InvalidArgument(
            f"at most {MAX_CANDIDATE_HOSTS} candidate_hosts", count=len(req.candidate_hosts)
        )
    if len(req.tier_weights) > len(TIERS):
        raise InvalidArgument(
            f"tier_weights names at most {len(TIERS)} tiers ({', '.join(TIERS)})",
            count=len(req.tier_weights),
        )
    weights = dict(node.config.tier_weights)
    weights.update(check_weights(dict(req.tier_weights)))
    try:
        spec = await _spec(service, ns_id)
        if allow is not None:
            allow(spec, req)
    except UnknownNamespace:
        if allow is None:
            raise
        # one answer for a tenant, whether the id is registered nowhere, its spec unusable,
        # or a namespace it may not see (docs/security.md, "Tenants")
        raise UnknownNamespace(NOWHERE, ns=ns_id) from None
    keys = _keys(service, spec, req, caller)
    if inspect.isawaitable(keys):
        keys = await keys
    candidates = list(req.candidate_hosts) or None
    runs = await node.reader.lookup(ns_id, keys, hosts=candidates, exact=req.exact)
    scores = score_runs(runs, spec.chunk_tokens, weights)
    seen = {s.host.host_id for s in scores}
    wanted = set(candidates) if candidates is not None else None
    for host in await node.reader.hosts(forget=False):  # reads only (as the lookup's)
        if host.host_id not in seen and (wanted is None or host.host_id in wanted):
            scores.append(HostScore(host, 0, 0, dict.fromkeys(TIERS, 0), 0.0))
    reply = pb.ScoreHostsResponse(
        namespace_id=ns_id, num_chunks=len(keys), chunk_tokens=spec.chunk_tokens
    )
    for s in scores:
        reply.hosts.append(
            pb.HostScore(
                host_id=s.host.host_id,
                data_address=s.host.data_address,
                grpc_address=s.host.grpc_address,
                hit_chunks=s.hit_chunks,
                hit_tokens=s.hit_tokens,
                tiers=[
                    pb.TierHits(tier=t, chunks=n // spec.chunk_tokens, tokens=n)
                    for t, n in s.tier_tokens.items()
                ],
                score=s.score,
            )
        )
    return reply


#: specs read from the fleet, by ns id (most recent last). An ns id is a digest of the spec's
#: identity, so a spec whose own id is the one asked for never goes stale: a router asking a
#: daemon without the model pays the round trip for it once.
_fleet_specs: OrderedDict[str, NamespaceSpec] = OrderedDict()
FLEET_SPECS_CACHED = 256


async def _spec(service: ScoringService, ns_id: str) -> NamespaceSpec:
    local = service.find_namespace(ns_id)
    if local is not None:
        return local
    cached = _fleet_specs.get(ns_id)
    if cached is not None:
        _fleet_specs.move_to_end(ns_id)
        return cached
    raw = await service.cluster.reader.namespace_spec(ns_id)
    if raw is None:
        raise UnknownNamespace(NOWHERE, ns=ns_id)
    spec = _fleet_spec(raw, ns_id)
    if spec.ns_id != ns_id:
        raise UnknownNamespace("the fleet's spec of this namespace has another id", ns=ns_id)
    _fleet_specs[ns_id] = spec
    while len(_fleet_specs) > FLEET_SPECS_CACHED:
        _fleet_specs.popitem(last=False)
    return spec


def _fleet_spec(raw: bytes, ns_id: str) -> NamespaceSpec:
    """The spec a member published (``raw``, as Redis holds it: not trusted, another
    version's daemon or a buggy writer may have put anything there), or UnknownNamespace
    saying why it is unusable: over :data:`~kvserver.cluster.schema.MAX_SPEC_BYTES`, not
    UTF-8 JSON of an object, not a valid spec. Before, bytes that were not UTF-8, JSON that
    was not an object and JSON nested too deep failed the call with INTERNAL."""
    try:
        if len(raw) > MAX_SPEC_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than {MAX_SPEC_BYTES}")
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not an object")
        return NamespaceSpec.from_dict(d)
    except (ValueError, TypeError, RecursionError, InvalidArgument) as exc:
        raise UnknownNamespace(
            f"the fleet's spec of this namespace is unusable: {exc}", ns=ns_id
        ) from None


def _keys(
    service: ScoringService, spec: NamespaceSpec, req: Any, caller: str
) -> Sequence[bytes] | Awaitable[Sequence[bytes]]:
    which = req.WhichOneof("prefix")
    if which == "keys":
        keys = keys_from_proto(req.keys, spec.key_size, MAX_KEYS)
        if isinstance(keys, CutKeys):
            return list(keys)  # every key its key_size by construction
        if len(keys) > MAX_KEYS:
            raise InvalidArgument("too many keys", count=len(keys), max=MAX_KEYS)
        if keys and set(map(len, keys)) != {spec.key_size}:  # in C: 2,048 keys in ~30 us
            raise InvalidArgument("every key must be key_size bytes", key_size=spec.key_size)
        return list(keys)
    if which == "tokens":
        t = req.tokens
        token_ids = token_ids_from_proto(t)  # in bulk, as the daemon's Lookup takes them
        check_prompt_size(len(token_ids), spec.chunk_tokens, MAX_KEYS)  # chunks: keys at most
        lora = (t.lora.name, t.lora.path) if t.HasField("lora") else None
        return service.hash_prompt(
            spec, token_ids, cache_salt=t.cache_salt or None, lora=lora, caller=caller
        )
    raise InvalidArgument("set exactly one of 'tokens' or 'keys'")


def cluster_stats(stats: dict[str, Any] | None) -> Any:
    """The ``ClusterStats`` message of ``KVService.stats()["cluster"]`` (None: unset)."""
    if stats is None:
        return None
    fields = pb.ClusterStats.DESCRIPTOR.fields_by_name
    return pb.ClusterStats(**{k: v for k, v in stats.items() if k in fields})


# ---------------------------------------------------------------------- client side


@dataclass(frozen=True, slots=True)
class ScoredHost:
    """One host of a ``ScoreHosts`` reply."""

    host_id: str
    data_address: str
    grpc_address: str
    hit_chunks: int
    hit_tokens: int
    #: tokens of the run per tier.
    tiers: dict[str, int]
    score: float


def call_score_hosts(
    client: Any,
    ns_id: str,
    *,
    keys: Sequence[bytes] | None = None,
    token_ids: Sequence[int] | None = None,
    cache_salt: str | None = None,
    candidate_hosts: Sequence[str] = (),
    tier_weights: dict[str, float] | None = None,
    exact: bool = False,
    timeout: float | None = None,
) -> list[ScoredHost]:
    """``ScoreHosts`` through ``client`` (a ``kvserver.grpc_client.GrpcClient``)."""
    if (keys is None) == (token_ids is None):
        raise InvalidArgument("pass exactly one of keys= or token_ids=")
    req = pb.ScoreHostsRequest(
        namespace_id=ns_id,
        candidate_hosts=list(candidate_hosts),
        tier_weights=tier_weights or {},
        exact=exact,
    )
    if keys is not None:
        reply = client.call_keys("ScoreHosts", req, keys, pb.ScoreHostsResponse, timeout)
    else:
        req.tokens.token_ids.extend(token_ids or ())
        req.tokens.cache_salt = cache_salt or ""
        reply = client._call("ScoreHosts", req, pb.ScoreHostsResponse, timeout)
    return [
        ScoredHost(
            h.host_id,
            h.data_address,
            h.grpc_address,
            h.hit_chunks,
            h.hit_tokens,
            {t.tier: t.tokens for t in h.tiers},
            h.score,
        )
        for h in reply.hosts
    ]
