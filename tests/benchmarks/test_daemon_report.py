"""Rows, targets and output of ``kvserver bench`` (benchmarks/daemon_report.py), with made-up
timings: no daemon, no Redis, nothing timed."""

from __future__ import annotations

import dataclasses
import json
import struct
from contextlib import ExitStack
from pathlib import Path

import pytest

from benchmarks.bench_daemon import BenchConfig, _start_redis
from benchmarks.daemon_report import (
    BANDWIDTH_TARGET,
    REDIS_TARGET,
    REDIS_WHAT,
    Result,
    document,
    is_redis,
    print_table,
    redis_ratios,
    redis_reference,
    remote_rows,
    target_met,
    write_chart,
)

LABEL = "256KiB x4 (1MiB batch)"
#: per Redis client mode: seconds per round (medians 5 s and 8 s: 0.8 and 0.5 GB/s for 4 GB).
REDIS_S = {"pipelined": [8.0, 4.0, 5.0], "per-command": [8.0]}


def rows_with_redis() -> list[Result]:
    """One co-located row, the two remote rows of one size and two Lookup rows."""
    return [
        Result.of("co-located store+load 256KiB x4 (1MiB batch) vs memcpy", 6.0, "GB/s", 10.0),
        *remote_rows(LABEL, 4_000_000_000, [1.0, 2.0, 9.0], [1.0], REDIS_S),
        Result.of("gRPC Lookup by 2,048 keys p99 (reference: 2 ms target)", 1.5, "ms", 2.0),
        Result.of("gRPC Lookup by 32k token ids (informational) p99", 9.0, "ms", 2.0),
    ]


def test_remote_rows_ratio_is_ours_over_each_reference() -> None:
    """Medians of the per-round seconds; every row shares kvserver's figure."""
    zmq_row, pipelined, per_command = remote_rows(
        LABEL, 4_000_000_000, [1.0, 2.0, 9.0], [1.0], REDIS_S
    )
    assert zmq_row.value == pytest.approx(2.0)  # 4 GB / median 2 s
    assert zmq_row.reference == pytest.approx(4.0)
    assert zmq_row.ratio == pytest.approx(0.5)
    assert pipelined.value == per_command.value == zmq_row.value
    assert pipelined.reference == pytest.approx(0.8)  # 4 GB / median 5 s
    assert pipelined.ratio == pytest.approx(2.5)
    assert per_command.ratio == pytest.approx(4.0)
    assert zmq_row.name == f"remote put+get {LABEL} vs raw ZMQ PUSH/PULL"
    assert pipelined.name == f"remote put+get {LABEL} vs {REDIS_WHAT} (pipelined)"
    assert per_command.name == f"remote put+get {LABEL} vs {REDIS_WHAT} (per-command)"
    assert not is_redis(zmq_row) and is_redis(pipelined) and is_redis(per_command)


def test_remote_rows_without_redis_has_only_the_zmq_row() -> None:
    rows = remote_rows(LABEL, 1000, [1.0], [2.0], None)
    assert [r.name.split(" vs ")[1] for r in rows] == ["raw ZMQ PUSH/PULL"]
    assert rows[0].ratio == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("name", "ratio", "expected"),
    [
        (f"remote put+get {LABEL} vs {REDIS_WHAT} (pipelined)", REDIS_TARGET, "yes"),
        (f"remote put+get {LABEL} vs {REDIS_WHAT} (per-command)", 2.9, "NO"),  # passes 0.8
        (f"remote put+get {LABEL} vs raw ZMQ PUSH/PULL", BANDWIDTH_TARGET, "yes"),
        (f"remote put+get {LABEL} vs raw ZMQ PUSH/PULL", 0.79, "NO"),
    ],
)
def test_bandwidth_rows_meet_their_own_target(name: str, ratio: float, expected: str) -> None:
    assert target_met(Result.of(name, ratio, "GB/s", 1.0)) == expected


def test_latency_targets_and_informational_rows() -> None:
    p99 = "gRPC Lookup by 2,048 keys p99 (reference: 2 ms target)"
    assert target_met(Result.of(p99, 1.9, "ms", 2.0)) == "yes"
    assert target_met(Result.of(p99, 2.1, "ms", 2.0)) == "NO"
    assert (
        target_met(Result.of("gRPC Lookup by 32k token ids (informational) p99", 9, "ms", 2)) == ""
    )


def test_redis_section_measured_holds_kvserver_to_the_faster_redis_mode() -> None:
    """The headline ratio per size is the lower one (pipelined Redis was faster here); both
    modes are kept with Redis' own bandwidth."""
    section = redis_reference(rows_with_redis(), skipped=None, server="7.0.15", client="redis-py")
    assert section["status"] == "measured"
    assert section["ratios"] == {LABEL: pytest.approx(2.5)}
    assert section["by_mode"] == {
        LABEL: {
            "pipelined": {"redis_gbps": pytest.approx(0.8), "ratio": pytest.approx(2.5)},
            "per-command": {"redis_gbps": pytest.approx(0.5), "ratio": pytest.approx(4.0)},
        }
    }
    assert section["target"] == REDIS_TARGET
    assert "pipeline" in section["compared"] and section["server"] == "7.0.15"
    assert redis_ratios(rows_with_redis()[:2]) == {}  # no Redis row: no ratio


def test_redis_section_skipped_says_why() -> None:
    section = redis_reference([], skipped="'redis-server' not found on PATH")
    assert section == {"status": "skipped", "reason": "'redis-server' not found on PATH"}


def test_document_is_json_with_rows_and_the_redis_section() -> None:
    rows = rows_with_redis()
    doc = json.loads(json.dumps(document(rows, redis_reference(rows, skipped=None))))
    assert [row["name"] for row in doc["results"]] == [r.name for r in rows]
    assert set(doc["results"][0]) == {"name", "value", "unit", "reference", "ratio"}
    assert doc["redis"]["ratios"] == {LABEL: pytest.approx(2.5)}


def test_table_prints_targets_and_the_redis_summary(capsys: pytest.CaptureFixture[str]) -> None:
    rows = rows_with_redis()
    print_table(rows, redis_reference(rows, skipped=None, server="7.0.15", client="redis-py"))
    out = capsys.readouterr().out
    redis_lines = [line for line in out.splitlines() if f"vs {REDIS_WHAT} (" in line]
    assert [line.split()[-1] for line in redis_lines] == ["NO", "yes"]  # 2.5 < 3 <= 4
    assert "the faster client mode per size: 256KiB 2.50x (target >= 3x)" in out
    print_table(rows[:2], redis_reference([], skipped="no binary"))
    assert "Redis reference skipped: no binary" in capsys.readouterr().out


def _png_width(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width: int = struct.unpack(">I", data[16:20])[0]
    return width


def test_chart_gets_a_redis_panel_only_when_redis_was_measured(tmp_path: Path) -> None:
    rows = rows_with_redis()
    write_chart(rows, tmp_path / "with.png")
    write_chart([r for r in rows if not is_redis(r)], tmp_path / "without.png")
    assert _png_width(tmp_path / "with.png") > _png_width(tmp_path / "without.png")


def test_start_redis_skips_without_a_server_binary(tmp_path: Path) -> None:
    """A missing redis-server (or --no-redis) skips the reference, saying why, starting
    nothing."""
    cfg = BenchConfig(
        sizes=(1 << 18,), repeats=1, batch_bytes=1 << 20, lookup_iters=1, token_iters=1,
        dram="64MiB", redis_server=str(tmp_path / "no-such-redis-server"),
    )  # fmt: skip
    with ExitStack() as stack:
        redis, why = _start_redis(cfg, tmp_path, stack)
        assert redis is None and why is not None and "no-such-redis-server" in why
        off = dataclasses.replace(cfg, redis_server=None)
        assert _start_redis(off, tmp_path, stack) == (None, "not requested (--no-redis)")
    assert list(tmp_path.iterdir()) == []
