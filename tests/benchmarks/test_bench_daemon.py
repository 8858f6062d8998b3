"""``kvserver bench`` (benchmarks/bench_daemon.py): smoke runs of the real command, schema only.

A benchmark, not a timed test: nothing here asserts a speed. The first run points the Redis
reference at a missing binary (so it runs the same everywhere and covers the skip path); the
second runs it for real where ``redis-server`` and the ``redis`` package are installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.daemon_redis import redis_unavailable

QUICK = [
    sys.executable, "-m", "kvserver.cli", "bench", "--quick", "--sizes", "256KiB",
    "--repeats", "1", "--batch", "1MiB", "--dram", "160MiB", "--lookup-iters", "10",
    "--no-progress",
]  # fmt: skip


@pytest.mark.multiprocess
def test_bench_quick_writes_json_and_chart(tmp_path: Path) -> None:
    """A tiny quick run starts its own daemon, writes every result row and the PNG, exits 0."""
    out = tmp_path / "x.json"
    missing = tmp_path / "no-redis-server"
    args = [*QUICK, "--redis-server", str(missing), "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["redis"]["status"] == "skipped" and str(missing) in doc["redis"]["reason"]
    assert f"Redis reference skipped: '{missing}' not found" in proc.stdout
    rows = doc["results"]
    names = [row["name"] for row in rows]
    assert len(rows) == 10 and len(set(names)) == 10
    assert sum(name.startswith("co-located store+load 256KiB x4") for name in names) == 1
    assert sum(name.startswith("remote put+get 256KiB x4") for name in names) == 1
    assert sum(name.startswith("gRPC Lookup by 2,048 keys p99") for name in names) == 1
    assert sum(name.startswith("gRPC Lookup by 32k token ids, the same") for name in names) == 2
    assert sum(name.startswith("gRPC Lookup by 32k token ids, a new") for name in names) == 2
    for row in rows:
        assert set(row) == {"name", "value", "unit", "reference", "ratio"}
        assert row["unit"] in ("GB/s", "ms")
        assert row["value"] > 0 and row["reference"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["reference"])
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "co-located store+load" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.skipif(redis_unavailable() is not None, reason=f"{redis_unavailable()}")
def test_bench_quick_with_redis_reports_the_redis_ratio(tmp_path: Path) -> None:
    """With redis-server installed the quick run adds a kvserver-vs-Redis row per size and
    client mode, the ratio to the faster mode in the JSON document, and stops the server."""
    out = tmp_path / "x.json"
    proc = subprocess.run([*QUICK, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    label = "256KiB x4 (1MiB batch)"
    rows = [r for r in doc["results"] if " vs Redis SET/GET (" in r["name"]]
    assert len(doc["results"]) == 12
    assert [r["name"] for r in rows] == [
        f"remote put+get {label} vs Redis SET/GET (pipelined)",
        f"remote put+get {label} vs Redis SET/GET (per-command)",
    ]
    zmq_row = next(r for r in doc["results"] if r["name"].endswith("vs raw ZMQ PUSH/PULL"))
    for row in rows:
        assert row["value"] == zmq_row["value"]  # the same kvserver rounds, three references
        assert row["reference"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["reference"])
    assert doc["redis"]["status"] == "measured"
    assert doc["redis"]["ratios"] == {label: pytest.approx(min(r["ratio"] for r in rows))}
    assert "kvserver vs Redis" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_aligned_buffers_start_on_a_page_and_hold_their_fill() -> None:
    """The bench's buffers start where an arena extent does (a page boundary): a bytearray
    this large starts 16 bytes past one (see page_aligned); filled or zeroed as asked."""
    import ctypes
    import mmap

    from benchmarks.daemon_refs import page_aligned

    fill = bytes(range(256)) * 4096
    for buf, want in ((page_aligned(len(fill), fill), fill), (page_aligned(1 << 20), None)):
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert address % mmap.PAGESIZE == 0
        assert buf.nbytes == 1 << 20
        assert bytes(buf) == (want if want is not None else bytes(1 << 20))


@pytest.mark.multiprocess
def test_bench_under_arc_says_why_a_put_of_two_windows_lost_its_first() -> None:
    """Under ARC a put of two windows (32 MiB over ZMQ) on a full tier loses its first window
    to its second (tests/kvserver/test_arc_windows.py): the bench exits 1 saying so and what
    to run instead, not with a bare "chunk not present". (Over the stream port, the default,
    a put is one request and keeps every chunk.)"""
    args = [*QUICK, "--sizes", "8MiB", "--batch", "32MiB", "--no-redis", "--policy", "arc"]
    args.append("--no-stream")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "The put went over ZMQ (--no-stream) as 2 windows of at most 16MiB" in proc.stderr
    assert "ARC (--policy arc) does so by design" in proc.stderr
    assert "Run --policy chain (the daemon's default), lru or prefix, --batch 16MiB" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("wrong", ["both", "zmq"])
def test_bench_of_a_daemon_that_does_not_answer_says_so_at_once(tmp_path: Path, wrong: str) -> None:
    """``kvserver bench --zmq ... --server ...`` where no daemon runs waited its calls' 60 s
    before saying "no reply from ... within 60.0s"; now it asks as ``kvserver status`` asks
    (5 s) and says what does not answer, exit status 1 (its --help's "could not be reached").
    With a real daemon on --server but nothing on --zmq, the ZMQ endpoint is named."""
    from tests.support.daemon import start_daemon
    from tests.support.ports import free_port

    zmq, grpc = f"tcp://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    daemon = start_daemon(tmp_path / "d", "--dram", "16MiB") if wrong == "zmq" else None
    try:
        if daemon is not None:
            grpc = daemon.grpc_address
        proc = subprocess.run(
            [*QUICK, "--no-redis", "--zmq", zmq, "--server", grpc],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        if daemon is not None:
            assert daemon.terminate() == 0, daemon.log()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    first = proc.stderr.splitlines()[0]
    if wrong == "both":
        assert first == (
            f"kvserver bench: error: cannot reach the daemon at {grpc}; is `kvserver start` "
            "running there?"
        )
    else:
        assert first.startswith(
            f"kvserver bench: error: the daemon at {grpc} answers over gRPC, but no reply from "
            f"{zmq} within 5.0s: nothing accepts connections there"
        ), first
