"""benchmarks/bench_cluster.py runs end to end at a tiny size and reports what docs/benchmarks.md
records (figures are the benchmark's business, not the test's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_cluster
from tests.support.redis import require_redis

pytestmark = pytest.mark.multiprocess


def test_the_cluster_benchmark_runs_and_reports(tmp_path: Path) -> None:
    require_redis()
    result = bench_cluster.run(True, chunks=128, calls=3, fill=10)
    store, score = result["store"], result["score_hosts"]
    assert store["ratio"] > 0 and store["commands_per_chunk"] > 0
    assert store["cluster"]["condition"] == "ok" and store["cluster"]["indexed_keys"] > 0
    assert score["hosts"][0][1] == bench_cluster.PROMPT_BLOCKS
    for name in ("lookup_local", "score_hosts", "score_hosts_exact"):
        assert 0 < score[name]["p50_ms"] <= score[name]["p99_ms"]
    png = tmp_path / "cluster.png"
    assert bench_cluster.write_plot(result, png) and png.stat().st_size > 0
