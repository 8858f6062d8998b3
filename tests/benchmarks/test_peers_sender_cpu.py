"""benchmarks/peers_sender_cpu.py fetches real batches from daemon A through daemon B beside
the raw ZMQ reference, and reports every figure (CPU per fetch, the user / system split per
process and per thread of A, the segments on the senders' sockets); its segment count reads a
real loopback connection of this process."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from benchmarks.peers_sender_cpu import measure, segments


def test_a_run_reports_every_figure(tmp_path: Path) -> None:
    out = measure(4 << 20, 3, "free", tmp_path)  # 8 parts of 4 MiB per fetch, 3 fetches
    assert out["fetch_ms_median"] > 0 and out["reference_ms_median"] > 0 and out["ratio"] > 0
    assert out["cpu_ms_median"]["a"] > 0 and out["cpu_ms_median"]["ref_sender"] > 0
    assert set(out["user_sys_ms_per_fetch"]) == {"a", "b", "ref_sender"}
    assert all(v >= 0 for row in out["user_sys_ms_per_fetch"].values() for v in row.values())
    assert out["a_threads_user_sys_ms_per_fetch"]  # A's loop thread at least ran
    if shutil.which("ss"):
        # 32 MiB per fetch leave A in at least 32 MiB / 64 KiB segments each
        assert out["segments_per_fetch"]["a"]["data_segs_out"] >= 500


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_segments_counts_a_connection_of_the_process() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    try:
        before = segments(os.getpid())
        for _ in range(5):
            ours.sendall(b"x" * 1000)
            assert theirs.recv(1000)  # one segment each way per round, at least
        after = segments(os.getpid())
        assert after["data_segs_out"] - before.get("data_segs_out", 0) >= 5
        assert after["data_segs_in"] - before.get("data_segs_in", 0) >= 5
    finally:
        ours.close()
        theirs.close()
        listener.close()
