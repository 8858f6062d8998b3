"""The daemon's Prometheus metrics: its own stats, read at scrape time (``docs/metrics.md``).

Runs in the daemon process: the snapshot (:meth:`DaemonCollector.snapshot`, ``service.stats()``)
on the event loop, the rest on prometheus_client's scrape thread (see :mod:`kvserver.prometheus`).
Nothing here counts anything: every value is a counter or gauge the engine, the SSD tier or the
front ends already keep, so ``kvserver status``, gRPC ``Stats`` and ``/metrics`` cannot disagree.

Per-tier series carry a ``tier`` label (``dram``, ``ssd``; a future tier adds a value, not a
name). Chunk counters count chunks (one key's KV, all TP ranks). The network tier (``peer``)
has series of its own (``kvserver_peer_*``: fetches, bytes, timeouts, failures, peers known and
suspect, condition): it holds no bytes, so the per-tier capacity series do not apply.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
)
from prometheus_client.metrics_core import Metric

from kvserver.daemon.service import KVService
from kvserver.daemon.tiers import DEGRADED, OK, UNAVAILABLE
from kvserver.prometheus import LoopCollector

#: every condition the SSD tier can be in (a state set: exactly one is 1).
SSD_CONDITIONS = (OK, DEGRADED, UNAVAILABLE)

#: every condition of the fleet membership (kvserver/cluster/node.py; a state set).
CLUSTER_CONDITIONS = ("connecting", "ok", "degraded", "unavailable", "stopped")
#: fleet counters: (metric name without _total, help, ClusterNode stats key)
_CLUSTER_COUNTERS = (
    ("kvserver_cluster_registrations", "Registrations in the fleet (start, Redis back).",
     "registrations"),
    ("kvserver_cluster_resyncs", "Full resyncs of this daemon's fleet index entries.", "resyncs"),
    ("kvserver_cluster_heartbeats", "Heartbeats Redis answered (this daemon's record and index "
     "sets renewed).", "heartbeats"),
    ("kvserver_cluster_batches", "Index batches (pipelines) written to Redis.", "batches"),
    ("kvserver_cluster_commands", "Redis commands sent by the fleet membership.", "commands"),
    ("kvserver_cluster_indexed_keys", "Index entries written (adds and removes).", "indexed_keys"),
    ("kvserver_cluster_errors", "Redis calls that failed or timed out.", "errors"),
    ("kvserver_cluster_dropped_keys", "Index changes dropped while Redis was unreachable.",
     "dropped_keys"),
    ("kvserver_cluster_index_losses", "Index writes or entries Redis lost without an error "
     "(fence moved, set evicted); each resynced.", "index_losses"),
    ("kvserver_cluster_unreadable_sets", "Index sets lookups found of another type than a set "
     "on Redis (not a daemon's: that host taken to hold nothing there).", "unreadable_sets"),
)  # fmt: skip

#: per-tier gauges: (metric name, help, key of the tier's values)
_TIER_GAUGES = (
    ("kvserver_tier_capacity_bytes", "Bytes the tier can hold.", "capacity_bytes"),
    ("kvserver_tier_used_bytes", "Bytes the tier holds (ready, reserved or pinned).", "used_bytes"),
    ("kvserver_tier_pinned_bytes", "Bytes pinned (loads in flight, TTL pins).", "pinned_bytes"),
    ("kvserver_tier_reserved_bytes", "Bytes reserved by stores in flight.", "reserved_bytes"),
    ("kvserver_tier_entries", "Chunks in the tier.", "entries"),
)
#: the ZMQ front end's unauthenticated requests (refusals.py): (name without _total, help, key)
_REFUSAL_COUNTERS = (
    ("kvserver_unauthenticated_requests", "ZMQ requests refused: no or wrong token.", "refused"),
    ("kvserver_unauthenticated_replies_held", "Their error replies held back.", "held_back"),
    ("kvserver_unauthenticated_replies_dropped", "Their error replies not sent.", "dropped"),
)
#: ZMQ handshakes answered by the ZAP handler (zap.py): (name without _total, help, key)
_HANDSHAKE_COUNTERS = (
    ("kvserver_zmq_handshakes_accepted", "ZMQ handshakes admitted by the daemon's ZAP handler.",
     "accepted"),
    ("kvserver_zmq_handshakes_refused", "ZMQ handshakes refused: a wrong or missing token "
     "(PLAIN) or an unlisted CURVE key; no message of theirs was read.", "refused"),
    ("kvserver_zmq_handshakes_failed", "ZMQ handshakes failed before the ZAP handler was asked: "
     "another mechanism (no token), a protocol error or a peer that hung up.", "failed"),
)  # fmt: skip
#: prompts hashed off the loop (prompt_hashing.py): (name without _total, help, key)
_PROMPT_COUNTERS = (
    ("kvserver_prompts_hashed_off_loop",
     "Prompts of more than 65,536 tokens hashed on the hashing thread.", "off_loop_prompts"),
    ("kvserver_prompts_waited",
     "Of those, prompts that waited for the thread (another prompt was hashing or queued).",
     "waited_prompts"),
)  # fmt: skip
#: per-tier counters: (metric name without _total, help, stats counter)
_TIER_COUNTERS = (
    ("kvserver_lookups", "Lookups answered by the tier.", "lookups"),
    ("kvserver_hits", "Chunks found by lookups and loads.", "hit_chunks"),
    ("kvserver_misses", "Chunks not found by lookups and loads.", "miss_chunks"),
    ("kvserver_stores", "Chunks stored (on ssd: written down from DRAM).", "stored_chunks"),
    ("kvserver_loads", "Chunks read by clients (on ssd: read from disk).", "loaded_chunks"),
    ("kvserver_evictions", "Chunks evicted to make room.", "evicted_chunks"),
)
#: DRAM-only counters: (metric name without _total, help, engine counter)
_DRAM_COUNTERS = (
    ("kvserver_rolled_back_chunks", "Reserved chunks rolled back.", "rolled_back_chunks"),
    ("kvserver_quarantined_chunks", "Chunks of expired reservations whose pages were "
     "quarantined.", "quarantined_chunks"),
    ("kvserver_quarantined_load_chunks", "Chunks of expired load leases kept from eviction "
     "for the quarantine.", "quarantined_load_chunks"),
    ("kvserver_store_rejections", "Store requests refused: no room.", "store_rejections"),
    ("kvserver_filtered_chunks", "Chunks not admitted (reuse gating, the policy's admission).",
     "filtered_chunks"),
    ("kvserver_leases_expired", "Leases that expired before completion.", "expired_leases"),
    ("kvserver_leases_released", "Leases released when their client went away.", "released_leases"),
)  # fmt: skip
#: SSD-only counters: (metric name without _total, help, tier counter)
_SSD_COUNTERS = (
    ("kvserver_promotions", "Chunks promoted from SSD to DRAM.", "promoted_chunks"),
    ("kvserver_writedowns", "Chunks written down from DRAM to SSD.", "stored_chunks"),
    ("kvserver_corrupt_chunks", "Chunks that failed verification on read.", "corrupt_chunks"),
    (
        "kvserver_refused_direct_chunks",
        "Chunks not served straight from SSD: over the bound on read buffers alive.",
        "refused_direct_chunks",
    ),
    ("kvserver_io_errors", "Failed disk reads and writes.", "io_errors"),
    ("kvserver_ssd_written_bytes", "Bytes written to the SSD tier.", "bytes_written"),
    ("kvserver_ssd_read_bytes", "Bytes read from the SSD tier.", "bytes_read"),
    (
        "kvserver_ssd_released_slots",
        "SSD slots whose disk blocks were given back (punched) to keep the disk used within --ssd.",
        "released_slots",
    ),
)
#: the stream's server end (``stats()["peer_stream"]``): (name without _total, help, key);
#: ``kvserver_peer_stream_*`` counts peers' fetches, ``kvserver_stream_client_*`` clients' ops
_STREAM_COUNTERS = (
    ("kvserver_peer_stream_connections", "Peer stream connections accepted.", "connections"),
    ("kvserver_peer_stream_refused_connections",
     "Peer stream connections closed at once: the connection limit was reached.",
     "refused_connections"),
    ("kvserver_peer_stream_refused_hellos",
     "Peer stream hellos malformed or whose token was refused.", "refused_hellos"),
    ("kvserver_peer_stream_refused_handshakes",
     "Peer stream TLS handshakes that failed (a plain client, an untrusted certificate).",
     "refused_handshakes"),
    ("kvserver_peer_stream_requests", "Peers' fetch requests read on the peer stream.",
     "requests"),
    ("kvserver_peer_stream_errors", "Error replies to peers' fetches on the peer stream "
     "(refused hellos and unframed requests too).", "errors"),
    ("kvserver_peer_stream_sent_chunks", "Chunks sent to peers on the stream.", "sent_chunks"),
    ("kvserver_peer_stream_sent_bytes", "Payload bytes sent to peers on the stream.",
     "sent_bytes"),
    ("kvserver_stream_client_requests", "Clients' put and get requests read on the stream.",
     "client_requests"),
    ("kvserver_stream_client_errors", "Error replies to clients' puts and gets on the stream.",
     "client_errors"),
    ("kvserver_stream_client_sent_chunks", "Chunks sent to clients' gets on the stream.",
     "client_sent_chunks"),
    ("kvserver_stream_client_sent_bytes", "Payload bytes sent to clients' gets on the stream.",
     "client_sent_bytes"),
    ("kvserver_stream_client_received_chunks", "Chunks stored by clients' puts on the stream.",
     "client_received_chunks"),
    ("kvserver_stream_client_received_bytes",
     "Payload bytes stored by clients' puts on the stream.", "client_received_bytes"),
)  # fmt: skip
#: network-tier counters: (metric name without _total, help, tier counter)
_PEER_COUNTERS = (
    ("kvserver_peer_fetches", "Fetch calls (windows) to peer daemons.", "fetches"),
    ("kvserver_peer_fetched_chunks", "Chunks fetched from peer daemons.", "fetched_chunks"),
    ("kvserver_peer_fetched_bytes", "Payload bytes fetched from peer daemons.", "fetched_bytes"),
    ("kvserver_peer_timeouts", "Peer calls that timed out or found no peer.", "timeouts"),
    ("kvserver_peer_failures", "Peer calls answered with what was refused.", "failures"),
    ("kvserver_peer_missed_chunks", "Chunks a peer was named for but none sent.", "missed_chunks"),
    ("kvserver_peer_joined_chunks", "Chunks a load waited for another fetch of.", "joined_chunks"),
    ("kvserver_peer_refused_windows", "ZMQ fetch windows a peer answered 'capacity' (its "
     "zmq_send_max_unsent); asked again once.", "refused_windows"),
)  # fmt: skip
#: every condition the network tier can be in.
PEER_CONDITIONS = (OK, DEGRADED)


class DaemonCollector(LoopCollector):
    """``/metrics`` of one daemon: a snapshot of ``service.stats()`` plus the op histogram."""

    def __init__(self, service: KVService, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._service = service

    def snapshot(self) -> dict[str, Any]:
        return {**self._service.stats(), "gc": (gc.get_stats(), gc.get_freeze_count())}

    def families(self, snapshot: Any) -> Iterator[Metric]:
        s: dict[str, Any] = snapshot
        ssd: dict[str, Any] | None = s["ssd"]
        page = s["page_size"]
        dram = {
            "capacity_bytes": s["capacity_bytes"],
            "used_bytes": s["used_bytes"],
            "pinned_bytes": s["pinned_pages"] * page,
            "reserved_bytes": s["reserved_pages"] * page,
            "entries": s["num_entries"],
            **s["totals"],
        }
        tiers = [("dram", dram)] + ([("ssd", ssd)] if ssd is not None else [])
        for name, doc, key in _TIER_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, values in tiers:
                g.add_metric([tier], values[key])
            yield g
        for name, doc, key in _TIER_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, values in tiers:
                c.add_metric([tier], values[key])
            yield c
        for name, doc, key in _DRAM_COUNTERS:
            yield CounterMetricFamily(name, doc, value=s["totals"][key])
        yield GaugeMetricFamily("kvserver_leases", "Leases in flight.", s["num_leases"])
        yield GaugeMetricFamily(
            "kvserver_quarantined_bytes",
            "DRAM of expired store reservations not handed out again yet.",
            s["quarantined_pages"] * page,
        )
        yield GaugeMetricFamily(
            "kvserver_quarantined_load_bytes",
            "DRAM of ready chunks that only an expired load lease's quarantine keeps from "
            "eviction.",
            s["quarantined_load_pages"] * page,
        )
        yield CounterMetricFamily("kvserver_events", "KV events emitted.", s["events_last_seq"])
        refusals = s["refusals"]
        for name, doc, key in _REFUSAL_COUNTERS:
            yield CounterMetricFamily(name, doc, value=refusals[key])
        for name, doc, key in _HANDSHAKE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=s["handshakes"][key])
        subscribers = s["pub_subscribers"]
        yield GaugeMetricFamily(
            "kvserver_pub_subscribers",
            "Connections open to the KV-event PUB.",
            subscribers["connected"],
        )
        yield CounterMetricFamily(
            "kvserver_pub_subscribers_refused",
            "Connections to the KV-event PUB shut down at once: pub_max_subscribers were open.",
            value=subscribers["refused"],
        )
        yield CounterMetricFamily(
            "kvserver_pub_subscribers_too_many_topics",
            "Connections to the KV-event PUB shut down for subscribing to too many topics.",
            value=subscribers["too_many_topics"],
        )
        prompts = s["prompt_hashing"]
        for name, doc, key in _PROMPT_COUNTERS:
            yield CounterMetricFamily(name, doc, value=prompts[key])
        refused = CounterMetricFamily(
            "kvserver_prompts_refused",
            "Long prompts refused (CapacityError) because the caller's (bound=caller) or the "
            "daemon's (bound=daemon) allowance of tokens waiting to be hashed was spent.",
            labels=["bound"],
        )
        refused.add_metric(["caller"], prompts["refused_caller"])
        refused.add_metric(["daemon"], prompts["refused_daemon"])
        yield refused
        yield GaugeMetricFamily(
            "kvserver_prompt_tokens_waiting",
            "Tokens of long prompts hashing or waiting for the hashing thread.",
            prompts["tokens_waiting"],
        )
        sends: dict[str, int] | None = s.get("zmq_sends")
        if sends is not None:
            yield CounterMetricFamily(
                "kvserver_zmq_send_cuts",
                "ZMQ connections cut: a zero-copy reply to them was not sent within "
                "zmq_send_timeout_s (the client does not read its socket).",
                value=sends["cut_connections"],
            )
            yield GaugeMetricFamily(
                "kvserver_zmq_send_pins", "Zero-copy ZMQ replies ZMQ has not sent yet.",
                sends["pins"],
            )  # fmt: skip
            yield GaugeMetricFamily(
                "kvserver_zmq_send_unsent_bytes",
                "Bytes of zero-copy ZMQ replies ZMQ has not sent yet (all connections).",
                sends["unsent_bytes"],
            )
            yield CounterMetricFamily(
                "kvserver_zmq_send_refused",
                "get/read_parts answered 'capacity': their ZMQ connection had "
                "zmq_send_max_unsent bytes of replies unsent (a client asking faster than it "
                "reads).",
                value=sends["refused"],
            )
        yield InfoMetricFamily("kvserver_build", "The version.", {"version": s["server_version"]})
        if ssd is not None:
            for name, doc, key in _SSD_COUNTERS:
                yield CounterMetricFamily(name, doc, value=ssd[key])
            yield StateSetMetricFamily(
                "kvserver_ssd_condition",
                "The SSD tier's condition (ok, degraded: writes failing, unavailable).",
                {c: ssd["condition"] == c for c in SSD_CONDITIONS},
            )
            yield GaugeMetricFamily(
                "kvserver_ssd_writes_in_flight", "Write-downs in flight.", ssd["writes_in_flight"]
            )
            yield GaugeMetricFamily(
                "kvserver_ssd_spare_bytes",
                "Disk bytes of free SSD slots kept for reuse in place (counted against --ssd).",
                ssd["spare_bytes"],
            )
            yield GaugeMetricFamily(
                "kvserver_ssd_freeing_slots",
                "SSD slots being discarded or having their disk blocks given back.",
                ssd["freeing_slots"],
            )
        peer: dict[str, Any] | None = s.get("peer")
        if peer is not None:
            for name, doc, key in _PEER_COUNTERS:
                yield CounterMetricFamily(name, doc, value=peer[key])
            known = peer["peers_known"]
            yield GaugeMetricFamily("kvserver_peers_known", "Peer daemons known.", known)
            yield GaugeMetricFamily(
                "kvserver_peers_suspect", "Peer daemons left alone after a failure.",
                peer["peers_suspect"],
            )  # fmt: skip
            yield StateSetMetricFamily(
                "kvserver_peer_condition",
                "The network tier's condition (degraded: peers suspect or directory unreadable).",
                {c: peer["condition"] == c for c in PEER_CONDITIONS},
            )
        stream: dict[str, Any] | None = s.get("peer_stream")
        if stream is not None:
            for name, doc, key in _STREAM_COUNTERS:
                yield CounterMetricFamily(name, doc, value=stream[key])
            yield GaugeMetricFamily(
                "kvserver_peer_stream_open_connections",
                "Peer stream connections open now.",
                stream["open_connections"],
            )
        cluster: dict[str, Any] | None = s.get("cluster")
        if cluster is not None:
            yield StateSetMetricFamily(
                "kvserver_cluster_condition",
                "Fleet membership on Redis/Valkey (unavailable: serving local tiers only; "
                "degraded: a member, Redis full, new index entries deferred).",
                {c: cluster["condition"] == c for c in CLUSTER_CONDITIONS},
            )
            yield GaugeMetricFamily(
                "kvserver_cluster_live_hosts", "Live fleet members seen.", cluster["live_hosts"]
            )
            yield GaugeMetricFamily(
                "kvserver_cluster_resync_pending",
                "1 while this daemon owes the fleet index a resync (waiting for its random delay "
                "or a retry): its entries are missing from the index meanwhile.",
                cluster.get("resync_pending", 0),
            )
            yield GaugeMetricFamily(
                "kvserver_cluster_redis_full",
                "1 while Redis refuses this daemon's index writes for memory (maxmemory under "
                "noeviction): it stays a member, its new index entries wait (deferred).",
                cluster.get("redis_full", 0),
            )
            yield GaugeMetricFamily(
                "kvserver_cluster_bad_records",
                "Entries on Redis the last read of the fleet's members skipped: hosts-set "
                "members or records not as a kvserver daemon of this version writes them.",
                cluster.get("bad_records", 0),
            )
            yield GaugeMetricFamily(
                "kvserver_cluster_pending_keys",
                "Index changes waiting for the next batch to Redis.",
                cluster["pending_keys"],
            )
            yield GaugeMetricFamily(
                "kvserver_cluster_deferred_keys",
                "Index entries Redis refused for memory, waiting to be written (the index "
                "lacks them meanwhile).",
                cluster.get("deferred_keys", 0),
            )
            for name, doc, key in _CLUSTER_COUNTERS:
                yield CounterMetricFamily(name, doc, value=cluster[key])
        generations, frozen = s["gc"]
        collections = CounterMetricFamily(
            "kvserver_gc_collections",
            "Cycle-collector passes, by generation.",
            labels=["generation"],
        )
        for generation, stats in enumerate(generations):
            collections.add_metric([str(generation)], stats["collections"])
        yield collections
        yield GaugeMetricFamily(
            "kvserver_gc_frozen_objects", "Objects frozen after start-up (never collected).", frozen
        )
        yield from self._service.op_seconds.collect()
