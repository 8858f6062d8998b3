"""benchmarks/peers_report.py: runs of several reports merged and summarized per placement
(fetch and reference ms per run beside the ratios; a run from before --placement counts as
free), and the per-placement chart drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.peers_report import merge, write_chart

KEYS = ("ratio", "paired_ratio_median", "zmq_ratio", "floor_ratio", "stream_over_floor",
        "tls_ratio", "curve_ratio", "tls_over_curve")  # fmt: skip


def row(ratio: float, fetch_ms: float, ref_ms: float) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(KEYS, ratio)
    out.update(name="peer fetch, 1024 KiB parts x 32", part_bytes=1 << 20, value_MBps=2.0,
               zmq_MBps=1.0, fetch_ms_median=fetch_ms, reference_ms_median=ref_ms)  # fmt: skip
    return out


def report(*runs: tuple[str | None, float, float, float]) -> dict[str, Any]:
    out = []
    for place, ratio, fetch_ms, ref_ms in runs:
        run: dict[str, Any] = {"results": [row(ratio, fetch_ms, ref_ms)]}
        if place is not None:
            run["placement"] = place
        out.append(run)
    return {"benchmark": "peers", "runs": out}


def test_runs_are_merged_and_summarized_per_placement(tmp_path: Path) -> None:
    merged = merge([
        report(("same", 0.9, 10.0, 9.0), ("split", 0.7, 20.0, 14.0)),
        report(("split", 0.8, 18.0, 14.4), ("same", 1.1, 9.0, 9.9), ("split", 0.6, 25.0, 15.0)),
    ])  # fmt: skip
    assert merged["placement"] == "all" and len(merged["runs"]) == 5
    assert list(merged["placements"]) == ["same", "split"]
    (same,), (split,) = merged["placements"]["same"], merged["placements"]["split"]
    assert same["ratio_per_run"] == [0.9, 1.1] and same["ratio_median"] == 1.0
    assert split["ratio_per_run"] == [0.7, 0.8, 0.6] and split["ratio_median"] == 0.7
    assert split["fetch_ms_per_run"] == [20.0, 18.0, 25.0] and split["fetch_ms_median"] == 20.0
    assert split["reference_ms_median"] == 14.4
    assert write_chart(merged, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 0


def test_a_report_from_before_placements_is_free() -> None:
    merged = merge([report((None, 0.5, 2.0, 1.0)), report((None, 0.7, 3.0, 2.1))])
    assert merged["placement"] == "free"
    assert merged["summary"][0]["ratio_per_run"] == [0.5, 0.7]
    assert list(merged["placements"]) == ["free"]
