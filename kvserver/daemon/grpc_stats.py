"""The gRPC ``Stats`` reply: a :class:`~kvserver.daemon.service.KVService`'s ``stats()`` as a
``StatsResponse``, cut to what the caller sees.

Runs in the daemon process, on its event loop (called by ``grpc_server.py``). Not thread-safe.
"""

from __future__ import annotations

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.cluster.rpc import cluster_stats
from kvserver.daemon.auth import Principal
from kvserver.daemon.service import KVService
from kvserver.grpc_format import MEDIUM_TO_PROTO

#: longest status details or tier condition detail sent.
MAX_STATUS_DETAILS = 1024
#: the per-namespace counters of ``stats()`` a NamespaceStats carries
_NS_COUNTERS = (
    "entries",
    "bytes",
    "lookups",
    "hit_chunks",
    "miss_chunks",
    "stored_chunks",
    "loaded_chunks",
    "evicted_chunks",
    "rolled_back_chunks",
    "filtered_chunks",
    "store_rejections",
    "expired_leases",
)
_TIER_COUNTERS = (
    "hit_chunks",
    "miss_chunks",
    "evicted_chunks",
    "stored_chunks",
    "loaded_chunks",
    "lookups",
)
#: the TierStats fields a lower tier's ``stats()`` fills by name (``kvserver/daemon/tiers.py``)
_LOWER_TIER_FIELDS = tuple(
    f.name
    for f in pb.TierStats.DESCRIPTOR.fields
    if f.name not in ("name", "medium", "condition_detail")
)


def stats_response(service: KVService, who: Principal, log_id: str) -> pb.StatsResponse:
    """The Stats reply of ``service`` for ``who`` (another tenant's namespaces left out);
    ``log_id``: the front end's event log identity."""
    s = service.stats()
    totals, page = s["totals"], s["page_size"]
    specs = {spec.ns_id: spec for spec in service.list_namespaces()}
    dram = pb.TierStats(
        name="dram",
        medium=pb.MEDIUM_CPU,
        policy=s["policy"],
        capacity_bytes=s["capacity_bytes"],
        used_bytes=s["used_bytes"],
        pinned_bytes=s["pinned_pages"] * page,
        reserved_bytes=s["reserved_pages"] * page,
        entries=s["num_entries"],
        condition="ok",
        **{k: totals[k] for k in _TIER_COUNTERS},
    )
    tiers = [dram]
    lower = service.tier_stats()
    for tier, st in lower:
        tiers.append(
            pb.TierStats(
                name=tier.name,
                medium=MEDIUM_TO_PROTO.get(tier.medium, pb.MEDIUM_UNSPECIFIED),
                condition_detail=st.get("condition_detail", "")[:MAX_STATUS_DETAILS],
                **{k: st[k] for k in _LOWER_TIER_FIELDS if k in st},
            )
        )
    namespaces = []
    for ns_id, row in s["namespaces"].items():
        spec = specs.get(ns_id)
        if not who.is_admin and (spec is None or not who.sees(spec)):
            continue  # another tenant's
        counters = {k: row[k] for k in _NS_COUNTERS if k in row}
        usage = [pb.TierUsage(tier="dram", entries=row["entries"], bytes=row["bytes"])]
        for tier, st in lower:
            entries, nbytes = st.get("namespaces", {}).get(ns_id, (0, 0))
            usage.append(pb.TierUsage(tier=tier.name, entries=entries, bytes=nbytes))
        namespaces.append(
            pb.NamespaceStats(
                namespace_id=ns_id,
                model=spec.model if spec is not None else "",
                tiers=usage,
                **counters,
            )
        )
    log = service.events
    return pb.StatsResponse(
        server_version=s["server_version"],
        host_id=service.host_id,
        tiers=tiers,
        namespaces=namespaces,
        num_leases=s["num_leases"],
        event_log_id=log_id,
        events_last_seq=log.last_seq,
        events_oldest_seq=log.oldest_seq,
        cluster=cluster_stats(s.get("cluster")),
    )
