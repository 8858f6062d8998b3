"""The report of ``benchmarks/bench_peers.py``: the summary over runs, the table it prints,
the chart. Plain functions over the report's dicts (no processes, no sockets).

Run as a script, it merges the runs of several reports of the same part sizes into one (its
summary per placement, its table and chart)::

    python benchmarks/peers_report.py A.json B.json --json MERGED.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
#: peer fetch through another host's daemon / raw ZMQ between two processes (issue 14).
TARGET = 0.8


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per chunk size, each run's ratios and their median over the runs."""
    out = []
    for rows in zip(*(r["results"] for r in runs), strict=True):
        entry: dict[str, Any] = {"name": rows[0]["name"], "part_bytes": rows[0]["part_bytes"]}
        for key in ("ratio", "paired_ratio_median", "zmq_ratio", "floor_ratio",
                    "stream_over_floor", "tls_ratio", "curve_ratio", "tls_over_curve"):  # fmt: skip
            values = [row[key] for row in rows]
            entry[f"{key}_per_run"] = values
            entry[f"{key}_median"] = statistics.median(values)
        stream_over_zmq = [row["value_MBps"] / row["zmq_MBps"] for row in rows]
        entry["stream_over_zmq_per_run"] = stream_over_zmq
        entry["stream_over_zmq_median"] = statistics.median(stream_over_zmq)
        for key, name in (("fetch_ms_median", "fetch_ms"), ("reference_ms_median", "reference_ms")):
            values = [row[key] for row in rows]
            entry[f"{name}_per_run"] = values
            entry[f"{name}_median"] = statistics.median(values)
        out.append(entry)
    return out


def print_table(report: dict[str, Any]) -> None:
    for n, run_report in enumerate(report["runs"], 1):
        head = f"{'case':<34} {'stream':>7} {'ZMQ':>6} {'ref':>6} {'ratio':>6} {'round range':>12}"
        where = run_report.get("placement", "free")
        print(f"\nrun {n}, placement {where}\n{head} {'paired':>7} {'ZMQ ratio':>10} "
              f"{'floor':>6} {'get from A':>11}")  # fmt: skip
        for r in run_report["results"]:
            lo, hi = min(r["round_ratios"]), max(r["round_ratios"])
            flag = "" if r["ratio"] >= TARGET else f"  (below {TARGET})"
            print(
                f"{r['name']:<34} {r['value_MBps']:>7.0f} {r['zmq_MBps']:>6.0f} "
                f"{r['reference_MBps']:>6.0f} {r['ratio']:>6.2f} {lo:>5.2f}-{hi:<5.2f} "
                f"{r['paired_ratio_median']:>7.2f} {r['zmq_ratio']:>9.2f}x "
                f"{r['floor_ratio']:>5.2f}x {r['remote_get_ratio']:>10.2f}x{flag}"
            )
        for r in run_report["results"]:
            c = r.get("cpu_ms_median")
            if c:  # CPU per round: how the draw of vCPUs went (docs/benchmarks.md, session 10)
                print(f"{r['name']:<34} CPU ms per round: A {c['a']:.2f}, B {c['b']:.2f} "
                      f"(stream fetch); raw ZMQ sender {c['ref_sender']:.2f}, receiver "
                      f"{c['ref_receiver']:.2f}")  # fmt: skip
        for r in run_report["results"]:
            print(
                f"{r['name']:<34} B's lookups of A per load {r['directory_lookups_per_load']:.2f}"
                f" (loads asking A straight away {r['directory_skipped_per_load']:.2f}); a "
                f"lookup of A: {r['lookup_ms_median']:.2f} ms, "
                f"{100 * r['lookup_share_of_fetch']:.1f}% of lookup + fetch"
            )
        for r in run_report["results"][:1]:
            masks = ", ".join(f"{k} {'/'.join(m)}" for k, m in r.get("thread_masks", {}).items())
            print(f"CPUs allowed, every thread (checked): {masks}")
        before, after = run_report["load_average_before"], run_report["load_average_after"]
        print(f"load average before {before[0]:.2f}, after {after[0]:.2f} (1 min); stream "
              f"window {run_report['stream_window_bytes'] / MiB:g} MiB (B, B_tls)")  # fmt: skip
    for name, summary in report.get("placements", {"free": report["summary"]}).items():
        print_summary(name, summary)


def print_summary(name: str, summary: list[dict[str, Any]]) -> None:
    """The medians over the runs of one placement."""
    count = len(summary[0]["ratio_per_run"]) if summary else 0
    print(f"\nplacement {name}: median over {count} run(s), per run in brackets")
    print(f"{'case':<34} {'stream/ref':>11} {'ZMQ/ref':>8} {'floor/ref':>10} {'stream/ZMQ':>11} "
          f"{'TLS/ref':>8} {'CURVE/ref':>10} {'TLS/CURVE':>10}")  # fmt: skip
    for e in summary:
        runs = " ".join(f"{x:.2f}" for x in e["ratio_per_run"])
        tls = " ".join(f"{x:.2f}" for x in e["tls_ratio_per_run"])
        print(
            f"{e['name']:<34} {e['ratio_median']:>11.2f} {e['zmq_ratio_median']:>8.2f} "
            f"{e['floor_ratio_median']:>10.2f} {e['stream_over_zmq_median']:>11.2f} "
            f"{e['tls_ratio_median']:>8.2f} {e['curve_ratio_median']:>10.2f} "
            f"{e['tls_over_curve_median']:>10.2f}  [{runs}] TLS [{tls}]"
        )
        fetch = " ".join(f"{x:.2f}" for x in e["fetch_ms_per_run"])
        ref = " ".join(f"{x:.2f}" for x in e["reference_ms_per_run"])
        print(f"{'':<34} stream fetch {e['fetch_ms_median']:.2f} ms [{fetch}], raw ZMQ "
              f"{e['reference_ms_median']:.2f} ms [{ref}]")  # fmt: skip


def write_chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if len(report.get("placements", {})) > 1:
        return _placement_chart(plt, report["placements"], path)
    rows = report["summary"]
    fig, ax = plt.subplots(figsize=(8, 1.6 + 1.3 * len(rows)))
    ys = list(range(len(rows)))
    for offset, key, label in (
        (-0.3, "ratio", "fetch through B over the peer stream"),
        (-0.15, "zmq_ratio", "fetch through B over ZMQ"),
        (0.0, "tls_ratio", "secure fleet: over the TLS peer stream"),
        (0.15, "curve_ratio", "secure fleet: over ZMQ with CURVE"),
        (0.3, "floor_ratio", "floor: raw TCP, arena pages to arena pages"),
    ):
        med = [r[f"{key}_median"] for r in rows]
        spread = [
            [max(0.0, m - min(r[f"{key}_per_run"])) for m, r in zip(med, rows, strict=True)],
            [max(0.0, max(r[f"{key}_per_run"]) - m) for m, r in zip(med, rows, strict=True)],
        ]
        ax.barh([y + offset for y in ys], med, height=0.14, xerr=spread, capsize=3, label=label)
    ax.set_yticks(ys, [r["name"] for r in rows])
    ax.axvline(TARGET, color="red", linestyle="--", label=f"target {TARGET}")
    ax.set_xlabel(f"/ raw ZMQ, same run: median of {len(report['runs'])} runs (whiskers: runs)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _placement_chart(plt: Any, by_placement: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    """Per part size, the stream fetch / raw ZMQ ratio under each placement (the fetch and the
    reference under the same one), median over runs, whiskers the runs."""
    names = list(by_placement)
    sizes = [e["name"] for e in by_placement[names[0]]]
    fig, ax = plt.subplots(figsize=(8, 1.6 + 1.1 * len(sizes)))
    height = 0.8 / len(names)
    for k, name in enumerate(names):
        rows = by_placement[name]
        med = [r["ratio_median"] for r in rows]
        spread = [
            [max(0.0, m - min(r["ratio_per_run"])) for m, r in zip(med, rows, strict=True)],
            [max(0.0, max(r["ratio_per_run"]) - m) for m, r in zip(med, rows, strict=True)],
        ]
        ys = [y - 0.4 + height * (k + 0.5) for y in range(len(sizes))]
        runs = len(rows[0]["ratio_per_run"])
        label = f"placement {name} ({runs} runs)"
        ax.barh(ys, med, height=height * 0.9, xerr=spread, capsize=3, label=label)
    ax.set_yticks(list(range(len(sizes))), sizes)
    ax.axvline(TARGET, color="red", linestyle="--", label=f"target {TARGET}")
    ax.set_xlabel("stream fetch through B / raw ZMQ, the same placement (median of runs)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of every run of ``reports`` (their part sizes the same), summarized per
    placement (a run without one: ``free``) in the order the placements first appear."""
    runs = [run for report in reports for run in report["runs"]]
    names = list(dict.fromkeys(run.get("placement", "free") for run in runs))
    by_name = {n: summarize([r for r in runs if r.get("placement", "free") == n]) for n in names}
    return {**reports[0], "placement": names[0] if len(names) == 1 else "all", "runs": runs,
            "summary": by_name[names[0]] if len(names) == 1 else [],
            "placements": by_name}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="merge bench_peers reports")
    parser.add_argument("reports", type=Path, nargs="+", help="bench_peers --json files")
    parser.add_argument("--json", type=Path, required=True, help="the merged report (and .png)")
    args = parser.parse_args(argv)
    merged = merge([json.loads(path.read_text()) for path in args.reports])
    print_table(merged)
    args.json.write_text(json.dumps(merged, indent=2) + "\n")
    write_chart(merged, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
