"""Rows, targets and output of ``kvserver bench``: the table, the JSON document and the chart.

Runs in the bench process after (or between) the measurements; pure functions over timings and
rows, no sockets and no processes, so the arithmetic is tested without a daemon or Redis.
matplotlib is imported only to draw the chart. Not thread-safe (nothing here keeps state).

A row (:class:`Result`) is one figure and the reference measured in the same run:
``ratio = value / reference``. Targets (docs/benchmarks.md) by kind of row:

- bandwidth against memcpy or raw ZMQ: ratio >= :data:`BANDWIDTH_TARGET` (0.8);
- remote bandwidth against Redis SET/GET: ratio >= :data:`REDIS_TARGET` (3). Redis is measured
  in two client modes (``daemon_redis.MODES``), one row each; the headline ratio of a part size
  (:func:`redis_ratios`) is the lower one, i.e. kvserver against the faster Redis;
- Lookup p99 latency, whose reference *is* the 2 ms target: ratio <= 1.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BANDWIDTH_TARGET = 0.8
REDIS_TARGET = 3.0
LOOKUP_TARGET_MS = 2.0
#: what the Redis rows compare (also in the JSON document).
REDIS_WHAT = "Redis SET/GET"
REDIS_COMPARED = (
    "kvserver put (one message with every part) + get (one message) vs redis-py SET of every "
    "part + GET of every key, either pipelined (one pipeline of SETs, one of GETs: two round "
    "trips, as kvserver) or per-command (a round trip per SET and per GET); same parts, same "
    "batch, fresh keys every round, rounds interleaved; the headline ratio is against the "
    "faster mode"
)


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    value: float
    unit: str
    reference: float
    ratio: float

    @classmethod
    def of(cls, name: str, value: float, unit: str, reference: float) -> Result:
        return cls(name, value, unit, reference, value / reference)


def gbps(nbytes: int, seconds: Sequence[float]) -> float:
    """Bandwidth of moving ``nbytes`` in the median of ``seconds``, in GB/s (10^9 B/s)."""
    return nbytes / statistics.median(seconds) / 1e9


def remote_rows(
    label: str,
    moved: int,
    ours_s: Sequence[float],
    zmq_s: Sequence[float],
    redis_s: Mapping[str, Sequence[float]] | None = None,
) -> list[Result]:
    """The remote rows of one part size: kvserver vs raw ZMQ, and vs Redis in each client mode
    of ``redis_s`` when measured.

    ``moved`` is the bytes of one round (stored + loaded); the lists are seconds per round.
    """
    ours = gbps(moved, ours_s)
    name = f"remote put+get {label} vs"
    rows = [Result.of(f"{name} raw ZMQ PUSH/PULL", ours, "GB/s", gbps(moved, zmq_s))]
    for mode, seconds in (redis_s or {}).items():
        rows.append(Result.of(f"{name} {REDIS_WHAT} ({mode})", ours, "GB/s", gbps(moved, seconds)))
    return rows


def is_redis(row: Result) -> bool:
    return f" vs {REDIS_WHAT} (" in row.name


def _redis_label_mode(row: Result) -> tuple[str, str]:
    """``("256KiB x256 (64MiB batch)", "pipelined")`` of a Redis row."""
    label, _, mode = row.name.removeprefix("remote put+get ").partition(f" vs {REDIS_WHAT} (")
    return label, mode.removesuffix(")")


def target_met(row: Result) -> str:
    """``yes`` / ``NO`` against the row's target, or ``""`` for informational rows."""
    if "informational" in row.name or "Health" in row.name:
        return ""
    if row.unit == "GB/s":
        target = REDIS_TARGET if is_redis(row) else BANDWIDTH_TARGET
        return "yes" if row.ratio >= target else "NO"
    if "p99" in row.name:
        return "yes" if row.ratio <= 1.0 else "NO"
    return ""


def redis_by_mode(results: Sequence[Result]) -> dict[str, dict[str, dict[str, float]]]:
    """Per batch label and Redis client mode: Redis' GB/s and kvserver's ratio to it."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in results:
        if is_redis(row):
            label, mode = _redis_label_mode(row)
            out.setdefault(label, {})[mode] = {"redis_gbps": row.reference, "ratio": row.ratio}
    return out


def redis_ratios(results: Sequence[Result]) -> dict[str, float]:
    """kvserver / the faster Redis mode, per batch label (``"256KiB x256 (64MiB batch)"``)."""
    return {
        label: min(m["ratio"] for m in modes.values())
        for label, modes in redis_by_mode(results).items()
    }


def redis_reference(
    results: Sequence[Result], *, skipped: str | None, server: str = "", client: str = ""
) -> dict[str, Any]:
    """The ``redis`` section of the JSON document: what ran and the ratios, or why not."""
    if skipped is not None:
        return {"status": "skipped", "reason": skipped}
    return {
        "status": "measured",
        "target": REDIS_TARGET,
        "compared": REDIS_COMPARED,
        "server": server,
        "client": client,
        "ratios": redis_ratios(results),
        "by_mode": redis_by_mode(results),
    }


def document(results: Sequence[Result], redis: dict[str, Any]) -> dict[str, Any]:
    """The JSON document ``--json`` writes."""
    return {"results": [asdict(r) for r in results], "redis": redis}


def print_table(results: Sequence[Result], redis: dict[str, Any]) -> None:
    width = max(len(r.name) for r in results)
    print(f"{'what':<{width}} {'value':>10} {'reference':>10} {'unit':>5} {'ratio':>7} target")
    for r in results:
        print(
            f"{r.name:<{width}} {r.value:>10.3f} {r.reference:>10.3f} {r.unit:>5} "
            f"{r.ratio:>7.3f} {target_met(r)}"
        )
    if redis["status"] == "skipped":
        print(f"Redis reference skipped: {redis['reason']}")
    else:
        ratios = ", ".join(f"{label.split()[0]} {x:.2f}x" for label, x in redis["ratios"].items())
        print(
            f"kvserver vs Redis {redis['server']} ({redis['client']}), the faster client mode "
            f"per size: {ratios} (target >= {REDIS_TARGET:g}x)"
        )


def write_chart(results: Sequence[Result], path: Path) -> None:
    """Bandwidth ratios (target 0.8), ratios to Redis (target 3, when measured) and Lookup
    latencies (target 2 ms) side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = [r for r in results if r.unit == "GB/s" and not is_redis(r)]
    vs_redis = [r for r in results if is_redis(r)]
    lat = [r for r in results if r.unit == "ms"]
    panels = [
        ([r.name.split(" vs ")[0] for r in bw], [r.ratio for r in bw], BANDWIDTH_TARGET,
         "target 0.8", "ratio to reference (memcpy / raw ZMQ), higher is better", False),
        ([" / ".join(_redis_label_mode(r)) for r in vs_redis], [r.ratio for r in vs_redis],
         REDIS_TARGET, "target 3", "ratio to Redis SET/GET (pipelined / per command), higher is "
         "better", False),
        ([r.name.split(" (reference")[0] for r in lat], [r.value for r in lat], LOOKUP_TARGET_MS,
         "p99 target 2 ms", "milliseconds (log scale), lower is better", True),
    ]  # fmt: skip
    panels = [p for p in panels if p[1]]
    height = 0.45 * max(len(bw), len(vs_redis), len(lat), 1) + 2
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), height), squeeze=False)
    for ax, (labels, values, line, line_label, xlabel, log) in zip(axes[0], panels, strict=True):
        ax.barh(labels, values)
        ax.axvline(line, color="red", linestyle="--", label=line_label)
        ax.set_xlabel(xlabel)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        if log:
            ax.set_xscale("log")
            ax.set_xlim(min([line, *values]) / 1.5, max([line, *values]) * 1.5)
        else:
            ax.set_xlim(0, max([line, *values]) * 1.2)
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        for y, value in enumerate(values):
            ax.annotate(f"{value:.2f}", (value, y), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=8)  # fmt: skip
    fig.suptitle("kvserver bench: each figure against a reference or target of the same run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
