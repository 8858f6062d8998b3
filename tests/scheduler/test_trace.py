"""The per-step JSONL trace : off by default; when on, per step a
snapshot, the admission lookups and the decision, all under the plan's step number."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.errors import StorageError
from scheduler.scheduler import Scheduler
from scheduler.trace import StepTrace, read_trace
from tests.scheduler.builders import config, harness, tokens


def test_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = Scheduler(config())
    assert s.trace is None
    s.add_request(s.make_request("A", tokens(4), max_tokens=1))
    s.schedule()
    assert list(tmp_path.iterdir()) == []


def test_records_per_step(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    h = harness(num_gpu_blocks=5, trace_path=str(path))
    h.add("A", tokens(4, 100), max_tokens=8)
    h.add("B", tokens(4, 200), max_tokens=8)
    h.run()
    h.scheduler.close()
    records = list(read_trace(path))
    assert records[0]["type"] == "header" and records[0]["version"] == 1
    assert records[0]["config"]["num_gpu_blocks"] == 5
    steps = [r for r in records if r["type"] == "decision"]
    assert [r["step"] for r in steps] == [p.step for p in h.plans]
    for plan, rec in zip(h.plans, steps, strict=True):
        assert rec["num_scheduled_tokens"] == plan.num_scheduled_tokens
        assert rec["preempted"] == plan.preempted_req_ids
        assert rec["total_scheduled_tokens"] == plan.total_num_scheduled_tokens
    first = [r for r in records if r.get("step") == 1]
    assert [r["type"] for r in first] == ["snapshot", "prefix_cache", "prefix_cache", "decision"]
    snap = first[0]
    assert snap["free_blocks"] == 4 and snap["running"] == 0 and snap["waiting"] == 2
    lookups = [r for r in records if r["type"] == "prefix_cache"]
    resumed = [r for r in lookups if r["req_id"] == "B"][-1]
    assert resumed["local_hit_tokens"] > 0  # B came back after preemption, prefix-cached
    assert resumed["connector"] is None and resumed["load_async"] is False
    assert any(r["preempted"] for r in steps)
    assert any(r["resumed"] == ["B"] for r in steps)


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    trace = StepTrace(path)
    trace.snapshot(1, running=0)
    trace.close()
    trace.close()
    with open(path, "a") as f:
        f.write('{"type": "deci')
    assert [r["type"] for r in read_trace(path)] == ["header", "snapshot"]


def test_unwritable_path_is_a_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as info:
        StepTrace(tmp_path / "missing" / "t.jsonl")
    assert "missing" in str(info.value)
