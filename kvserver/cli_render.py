"""The text ``kvserver status`` and ``kvserver lookup`` print: the daemon's typed replies as
readable tables (the ``--json`` output is the replies' own dictionaries, made in
``kvserver/cli_ops.py``).

Runs in the CLI process, called by ``cli_ops`` once a call has answered. Pure functions of
the replies (``kvserver.grpc_replies`` types, ``cluster.rpc``'s scored hosts), no I/O; each
returns the whole text, lines ending in a newline. Sizes in IEC units (``size``), ratios as a
percentage or "-" when there is nothing to divide by (``pct``), columns padded to their
widest cell with numbers right-aligned (``table``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render_status(stats: Any, server: str) -> str:
    """``kvserver status``: the daemon (``stats``, a ``ServerStats``, of the daemon at
    ``server``), its fleet, its tiers and their notes, and its namespaces."""
    events = (  # an empty log's range reads "1..0"
        f"seq {stats.events_oldest_seq}..{stats.events_last_seq}"
        if stats.events_last_seq >= stats.events_oldest_seq
        else "none yet"
    )
    head = (
        f"kvserver {stats.server_version} at {server}  host {stats.host_id}\n"
        f"leases {stats.num_leases}  events: {events} (log {stats.event_log_id})\n"
    )
    if stats.cluster is not None:
        c = stats.cluster
        head += (
            f"fleet {c.get('url', '')}: {c.get('condition', '')}  as {c.get('host_id', '')} "
            f"(incarnation {c.get('incarnation', '')}), {c.get('live_hosts', 0)} live host(s)"
            + (f"\n  ({c['condition_detail']})" if c.get("condition_detail") else "")
            + (_resync_note(c) if c.get("resync_pending") else "")
            + _foreign_note(c)
            + "\n"
        )
    elif any(t.name == "peer" for t in stats.tiers):
        head += "fleet: none (a fixed list of peers, --peers: the peer tier below)\n"
    else:
        head += "fleet: none (standalone; kvserver start --cluster URL joins one)\n"
    head += "\n"
    tiers = table(
        [
            "TIER",
            "MEDIUM",
            "POLICY",
            "CAPACITY",
            "USED",
            "USED%",
            "PINNED",
            "ENTRIES",
            "HITS",
            "MISSES",
            "HIT%",
            "EVICTIONS",
            "STATE",
        ],
        [
            [
                t.name,
                t.medium,
                t.policy,
                size(t.capacity_bytes),
                size(t.used_bytes),
                pct(t.used_bytes, t.capacity_bytes),
                size(t.pinned_bytes),
                t.entries,
                t.hit_chunks,
                t.miss_chunks,
                pct(t.hit_chunks, t.hit_chunks + t.miss_chunks),
                t.evicted_chunks,
                t.condition or "ok",
            ]
            for t in stats.tiers
        ],
    )
    tiers += tier_notes(stats.tiers)
    if not stats.namespaces:
        return head + tiers + "\n(no namespaces registered)\n"
    namespaces = table(
        [
            "NAMESPACE",
            "MODEL",
            "ENTRIES",
            "SIZE",
            "PER TIER",
            "LOOKUPS",
            "HITS",
            "MISSES",
            "HIT%",
            "EVICTIONS",
        ],
        [
            [
                n.namespace_id,
                n.model,
                n.entries,
                size(n.bytes),
                " ".join(f"{tier}:{entries}" for tier, (entries, _b) in n.tiers.items()) or "-",
                n.lookups,
                n.hit_chunks,
                n.miss_chunks,
                pct(n.hit_chunks, n.hit_chunks + n.miss_chunks),
                n.evicted_chunks,
            ]
            for n in stats.namespaces
        ],
    )
    return head + tiers + "\n" + namespaces


def tier_notes(tiers: Sequence[Any]) -> str:
    """One line per lower tier (SSD): I/O mode and its health counters; its condition first
    when it is not ok (DRAM keeps serving)."""
    lines = []
    for t in tiers:
        if t.condition not in ("", "ok"):
            lines.append(f"!! {t.name} {t.condition}: {t.condition_detail} (DRAM keeps serving)\n")
        if t.io_mode:
            lines.append(
                f"{t.name}: {t.io_mode} I/O, recovered {t.recovered_chunks} at start, "
                f"promoted {t.promoted_chunks}, corrupt {t.corrupt_chunks}, "
                f"I/O errors {t.io_errors}, not written down {t.skipped_chunks}\n"
            )
    if not any(t.name == "ssd" for t in tiers):
        lines.append("ssd: none (kvserver start --ssd-dir DIR --ssd SIZE adds one)\n")
    return "".join(lines)


def render_lookup(ns: Any, reply: Any, num_tokens: int) -> str:
    """``kvserver lookup``: the hit of a prompt of ``num_tokens`` tokens in namespace ``ns``
    (a ``NamespaceReply``; ``reply``: the ``LookupReply``)."""
    spec = ns.spec
    tiers = ", ".join(
        f"{tier} {n} chunks ({n * reply.chunk_tokens} tokens)" for tier, n in reply.tiers.items()
    )
    return (
        f"namespace {ns.namespace_id}  model {spec.model}  ({spec.hash_algo}, "
        f"{spec.block_size} tokens/block, {spec.chunk_blocks} block(s)/chunk)\n"
        f"hit: {reply.hit_tokens} of {num_tokens} tokens, {reply.hit_chunks} of "
        f"{reply.num_chunks} chunks ({pct(reply.hit_chunks, reply.num_chunks)})\n"
        f"tiers: {tiers or 'none'}\n"
    )


def render_fleet(ns_id: str, num_tokens: int, scored: Sequence[Any]) -> str:
    """``kvserver lookup --fleet``: the fleet's hosts as ScoreHosts ``scored`` them for a
    prompt of ``num_tokens`` tokens in namespace ``ns_id``."""
    if not scored:
        return f"namespace {ns_id}: no live host in the fleet\n"
    return f"namespace {ns_id}, {num_tokens} tokens\n" + table(
        ["HOST", "SCORE", "HIT TOKENS", "CHUNKS", "DRAM", "SSD", "DATA PLANE"],
        [
            [h.host_id, f"{h.score:g}", h.hit_tokens, h.hit_chunks, h.tiers.get("dram", 0),
             h.tiers.get("ssd", 0), h.data_address]
            for h in scored
        ],
    )  # fmt: skip


def size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(isinstance(r[i], int) for r in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip() + "\n"

    return line(headers) + "".join(line(r) for r in cells)


def _resync_note(cluster: dict[str, Any]) -> str:
    """The fleet line's note while the daemon owes the index a resync."""
    wait = float(cluster.get("resync_in_s", 0.0))
    when = f"starts in {wait:.1f} s (spread)" if wait > 0 else "after the next retry"
    return f"\n  (index resync pending: {when}; this host's entries are missing meanwhile)"


def _foreign_note(cluster: dict[str, Any]) -> str:
    """The fleet line's note when Redis holds what no daemon of this version writes
    (``bad_records``, ``unreadable_sets``: docs/cluster.md, failure cases); "" when neither."""
    parts = []
    if cluster.get("bad_records"):
        parts.append(f"bad_records {cluster['bad_records']} (skipped at the last members read)")
    if cluster.get("unreadable_sets"):
        parts.append(f"unreadable_sets {cluster['unreadable_sets']} (index sets of another type)")
    if not parts:
        return ""
    return (
        f"\n  (Redis holds what no kvserver of this version writes: {', '.join(parts)}; "
        "docs/cluster.md, failure cases)"
    )
