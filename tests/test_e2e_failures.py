"""End to end, failures: a real daemon, a real scheduler (with --kvserver) and two real TP
worker processes (tiny model, CPU); one worker is SIGKILLed in the middle of a generation.

The scheduler must fail the affected request with an UNAVAILABLE error naming the worker, stay
up (health, EngineStats, prompt UNAVAILABLE for new requests while the workers are down), and
resume once the workers are back at their addresses; the daemon must be left with no lease,
reservation or pin of the failed run (the scheduler's connector holds them: reset() releases
them, lease expiry is the backstop).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserver.grpc_client import GrpcClient
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler
from tests.support.cluster import free_port, start_tp_workers
from tests.support.connector import PATIENT_ARGS
from tests.support.daemon import start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

BLOCK_SIZE = 16
PROMPT = [(i * 37 + 11) % 512 for i in range(48)]
LONG_PROMPT = [(i * 53 + 5) % 512 for i in range(40)]


def _daemon_clean(client: GrpcClient) -> bool:
    s = client.stats(timeout=5)
    busy = any(t.reserved_bytes or t.pinned_bytes for t in s.tiers)
    return s.num_leases == 0 and not busy


def _health(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_worker_killed_mid_run_fails_requests_and_daemon_reclaims(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "daemon", "--dram", "16MiB")
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    workers: list[Proc] = []
    sched: Proc | None = None
    try:
        workers = start_tp_workers(tmp_path, daemon.zmq_address, listen=addrs)
        sched = start_scheduler(
            tmp_path, "--workers", ",".join(addrs), "--num-gpu-blocks", "80",
            "--block-size", str(BLOCK_SIZE), "--model", "tiny-fail",
            "--kvserver", daemon.zmq_address, *PATIENT_ARGS, "--chunk-blocks", "1",
            "--step-timeout-s", "3", "--probe-interval-s", "0.3",
        )  # fmt: skip
        port = sched.info["grpc_port"]
        with EngineClient(port) as c, GrpcClient(daemon.grpc_address) as kv:
            want = output_tokens(c.generate(PROMPT, 8))
            assert len(want) == 8

            # a long generation; the first rank dies once it streams
            stream = c.stream(LONG_PROMPT, 900)
            first = next(stream)
            assert first.token_ids
            workers[0].proc.send_signal(signal.SIGKILL)
            workers[0].proc.wait(10)
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            rpc_err: grpc.Call = err.value
            assert rpc_err.code() == grpc.StatusCode.UNAVAILABLE, rpc_err.details()
            assert re.search(r"worker [01] at tcp://127\.0\.0\.1:\d+", rpc_err.details()), (
                rpc_err.details()
            )
            assert addrs[0] in rpc_err.details() or addrs[1] in rpc_err.details()

            # the scheduler stays up and says why
            assert sched.proc.poll() is None
            assert _health(port) == "SERVING"
            stats = c.stats()
            assert stats.workers_error and not all(w.up for w in stats.workers), stats
            # new requests are refused at once, not left hanging
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                c.generate(PROMPT, 8)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker" in refused.value.details()
            assert time.monotonic() - t0 < 5

            # the daemon holds nothing for the failed run: no lease, reservation or pin
            wait_until(lambda: _daemon_clean(kv), timeout=20)
            ns = [n for n in kv.stats(timeout=5).namespaces if n.model == "tiny-fail"]
            assert ns and ns[0].stored_chunks > 0  # the run did go through kvserver

            # restart the TP group at the same addresses: service resumes
            for w in workers[1:]:
                w.kill()
            workers = start_tp_workers(tmp_path, daemon.zmq_address, listen=addrs, tag="-2")
            wait_until(lambda: c.stats().workers_error == "", timeout=20)
            msgs = c.generate(PROMPT, 8)
            assert output_tokens(msgs) == want
            # the GPU prefix cache was dropped with the workers; kvserver still has the prefix
            assert msgs[0].usage.kvserver_tokens > 0, msgs[0].usage
            wait_until(lambda: _daemon_clean(kv), timeout=20)
        assert sched.terminate() == 0, sched.log()
        for w in workers:
            assert w.terminate() == 0, w.log()
    finally:
        if sched is not None:
            sched.kill()
        for w in workers:
            w.kill()
        daemon.kill()
