"""``kvserver bench`` (kvserver/bench.py): one smoke run of the real command, schema only.

A benchmark, not a timed test: nothing here asserts a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.multiprocess
def test_bench_quick_writes_json_and_chart(tmp_path: Path) -> None:
    """A tiny quick run starts its own daemon, writes every result row and the PNG, exits 0."""
    out = tmp_path / "x.json"
    args = [
        sys.executable, "-m", "kvserver.cli", "bench", "--quick", "--sizes", "256KiB",
        "--repeats", "1", "--batch", "1MiB", "--dram", "160MiB", "--lookup-iters", "10",
        "--no-progress", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    names = [row["name"] for row in rows]
    assert len(rows) == 8 and len(set(names)) == 8
    assert sum(name.startswith("co-located store+load 256KiB x4") for name in names) == 1
    assert sum(name.startswith("remote put+get 256KiB x4") for name in names) == 1
    assert sum(name.startswith("gRPC Lookup by 2,048 keys p99") for name in names) == 1
    assert sum(name.startswith("gRPC Lookup by 32k token ids") for name in names) == 2
    for row in rows:
        assert set(row) == {"name", "value", "unit", "reference", "ratio"}
        assert row["unit"] in ("GB/s", "ms")
        assert row["value"] > 0 and row["reference"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["reference"])
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "co-located store+load" in proc.stdout
