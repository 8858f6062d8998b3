"""benchmarks/colocated_instructions.py: its dumps summed per step name (warm-up and unnamed
dumps skipped), and its round driving a real daemon's co-located path step by step, without
valgrind (the bytes loaded are the bytes stored)."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from pathlib import Path

import pytest

from benchmarks.bench_daemon import _spec, _split
from benchmarks.colocated_instructions import STEPS, _steps, _sums
from benchmarks.daemon_refs import own_daemon
from kvserver.client import KVClient


def write(out: Path, name: str, trigger: str, summary: int) -> None:
    (out / name).write_text(f"version: 1\ndesc: Trigger: {trigger}\nsummary: {summary}\n")


def test_sums_add_every_dump_of_a_step(tmp_path: Path) -> None:
    write(tmp_path, "daemon.7.1", "Program started", 999)  # no step: skipped
    write(tmp_path, "daemon.7.2", "Client Request: step:262144:writes", 40)
    write(tmp_path, "daemon.7.3", "Client Request: step:262144:writes", 2)
    write(tmp_path, "daemon.7.4", "Client Request: step:262144:empty", 5)
    write(tmp_path, "client.8.1", "Client Request: step:262144:writes", 7)  # another process
    assert _sums(tmp_path, "daemon.*.*") == {"262144:writes": 42, "262144:empty": 5}


@pytest.mark.multiprocess
def test_steps_run_the_colocated_round_in_order() -> None:
    """One round of 4 parts of 256 KiB through a real daemon: every step reported, in order,
    and the load returns what the store wrote."""
    size, n = 256 << 10, 4
    src_buf = memoryview(bytearray(bytes(range(256)) * (size * n // 256)))
    dst_buf = memoryview(bytearray(size * n))
    src, dst = _split(src_buf, size, n), _split(dst_buf, size, n)
    done: list[str] = []
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        target = stack.enter_context(own_daemon("64MiB", work, {}))
        kv = stack.enter_context(KVClient(target.zmq, colocated=True, timeout=30))
        _steps(kv, kv.register_namespace(_spec(size, "test")).ns_id, src, dst, done.append)
    assert done == ["before", *STEPS]
    assert bytes(dst_buf) == bytes(src_buf)
