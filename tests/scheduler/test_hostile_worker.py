"""A real scheduler process whose worker lies (``tests/support/lying_worker.py``: the real
synthetic worker answering its first step with bytes no correct worker sends): undecodable,
not a map, another protocol version, a result of the wrong shape, an error for a step it was
not asked, a reply over the scheduler's limit of the step channel (``step_protocol/limits.py``,
refused unread). The request of that step ends UNAVAILABLE naming the worker and what it sent
(or the limit); the scheduler stays up (its stats, another client's, answered meanwhile), says
hello to the worker again, and the next request is generated exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest

from benchmarks.harness.proc import start_process
from tests.scheduler.builders import expected_output, tokens
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler
from tests.support.daemon import wait_until
from tests.support.lying_worker import LIES

pytestmark = pytest.mark.multiprocess

#: what the failed request's status says, per lie
SAID = {
    "garbage": "bad reply to step",
    "not-a-map": "bad reply to step",
    "wrong-version": "bad reply to step",
    "wrong-shape": "malformed result of step",
    "error-for-another-step": "no reply to step",
    # dropped by ZMQ at its length prefix, unread (MAXMSGSIZE: the scheduler's default limit
    # with these settings, 64 MiB); before the limit it was received whole ("bad reply")
    "oversized": "ZMQ drops a connection carrying a "
    "message over the limit (this scheduler's for replies, 64 MiB, --step-max-message-mib; "
    "the worker's for plans, 256 MiB)",
}


def start_lying_worker(tmp_path: Path, lie: str) -> Proc:
    ready = tmp_path / "liar.ready"
    args = [sys.executable, "-m", "tests.support.lying_worker", lie,
            "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready)]  # fmt: skip
    proc, info = start_process(args, ready, tmp_path / "liar.log", name="lying worker")
    return Proc(proc, info, tmp_path / "liar.log", args)


def test_the_table_names_every_lie() -> None:
    assert set(SAID) == set(LIES)


@pytest.mark.parametrize("lie", LIES)
def test_a_lying_worker_fails_its_step_only_and_the_scheduler_serves_on(
    tmp_path: Path, lie: str
) -> None:
    worker = start_lying_worker(tmp_path, lie)
    sched = start_scheduler(
        tmp_path, "--workers", worker.info["endpoint"], "--num-gpu-blocks", "1024",
        "--step-timeout-s", "2", "--probe-interval-s", "0.2",
    )  # fmt: skip
    try:
        with (
            EngineClient(sched.info["grpc_port"]) as client,
            EngineClient(sched.info["grpc_port"]) as other,
        ):
            with pytest.raises(grpc.RpcError) as info:
                client.generate(tokens(24), 4)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "worker 0" in info.value.details() and SAID[lie] in info.value.details()
            assert other.stats().total_blocks == 1024  # the front door answers meanwhile
            wait_until(lambda: other.stats().workers[0].up, timeout=30)
            stats = other.stats()
            assert stats.running == 0 and stats.free_blocks == stats.total_blocks - 1
            prompt = tokens(20, 7)
            assert output_tokens(client.generate(prompt, 5)) == expected_output(prompt, 5)
        assert sched.proc.poll() is None and worker.proc.poll() is None
        assert sched.terminate() == 0
        assert "Traceback" not in sched.log_path.read_text()
    finally:
        sched.kill()
        worker.kill()
