"""benchmarks/peers_wire.py moves real batches over loopback TCP from both senders into every
kind of destination (and pinned to one CPU), beside the raw ZMQ reference (and the ZMQ pair
pinned): each case's bytes are the sender's, and every figure of the report is there and
positive; a case it does not know is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers_wire import Case, measure


def test_every_sender_and_destination_moves_the_batch(tmp_path: Path) -> None:
    cases = ["blocking:rotate", "loop:rotate", "loop:same", "loop:heap", "loop:rotate:same",
             "zmq:heap:split"]  # fmt: skip
    result = measure(4 << 20, 1, cases, tmp_path)  # 8 parts of 4 MiB, one timed round
    assert result["reference_ms"] > 0 and result["reference_sender_cpu_ms"] > 0
    assert sorted(result["cases"]) == sorted(cases)
    for row in result["cases"].values():
        assert row["ms"] > 0 and row["ratio"] > 0 and row["paired_ratio"] > 0
        assert row["receiver_cpu_ms"] > 0 and row["sender_cpu_ms"] > 0


def test_an_unknown_case_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SENDER:DEST"):
        Case("sendfile:rotate", tmp_path, 1 << 20, {})
    with pytest.raises(ValueError, match="SENDER:DEST"):
        Case("loop:rotate:elsewhere", tmp_path, 1 << 20, {})
    with pytest.raises(ValueError, match="SENDER:DEST"):
        Case("zmq:rotate", tmp_path, 1 << 20, {})
