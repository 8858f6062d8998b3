"""benchmarks/harness/callgrind.py reads the instruction benchmarks' per-kind dumps: totals
divided by the calls the dump's name gives, warm-up and final dumps skipped, a kind with no
dump named."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness.callgrind import dump_name, per_call


def write(out: Path, name: str, trigger: str, summary: int) -> None:
    (out / name).write_text(f"version: 1\ndesc: Trigger: {trigger}\nsummary: {summary}\n")


def test_per_call_divides_each_kinds_total_by_its_calls(tmp_path: Path) -> None:
    write(tmp_path, "daemon.7.1", "Program started", 999)  # the warm-up dump: no kind
    write(tmp_path, "daemon.7.2", f"Client Request: {dump_name(1, 4)}", 400)
    write(tmp_path, "daemon.7.3", f"Client Request: {dump_name(0, 10)}", 50)
    write(tmp_path, "client.8.1", f"Client Request: {dump_name(0, 10)}", 7)  # another process
    assert per_call(tmp_path, "daemon.*.*", ["a", "b"]) == {"a": 5.0, "b": 100.0}
    with pytest.raises(SystemExit, match=r"\['b'\]"):
        per_call(tmp_path, "client.*.*", ["a", "b"])
