"""The step channel's message size limits (``step_protocol/limits.py``), with real processes:
a worker refuses a plan over its ``--step-max-message-mib`` unread, says so and serves on; a
scheduler does not send a plan over the limit its worker told, fails that step only and serves
on. (A reply over the scheduler's limit: ``test_hostile_worker.py``, the "oversized" lie.)
The bounds themselves against real encoded plans and replies."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from scheduler.config import ProcessConfig, SchedulerConfig
from step_protocol import (
    KIND_HELLO,
    KIND_STEP,
    CachedRequestData,
    ConnectorWorkerOutput,
    NewRequestData,
    StepPlan,
    StepResult,
    TransferResult,
    encode_body,
)
from step_protocol.limits import (
    DEFAULT_WORKER_LIMIT_BYTES,
    FLOOR_BYTES,
    MIB,
    derived_limit,
    plan_bytes_bound,
    reply_bytes_bound,
)
from tests.scheduler.builders import expected_output, tokens
from tests.scheduler.procs import EngineClient, output_tokens, start_scheduler, start_worker
from tests.scheduler.test_step_hostile import HELLO, Peer, assert_served, peak_rss_mib
from tests.support.daemon import wait_until


@pytest.mark.multiprocess
def test_a_worker_tells_its_limit_in_its_hello(tmp_path: Path) -> None:
    worker = start_worker(tmp_path, "w")
    peer = Peer(worker)
    try:
        kind, body = peer.call(encode_body(KIND_HELLO, HELLO))
        assert kind == KIND_HELLO and body["max_message_bytes"] == DEFAULT_WORKER_LIMIT_BYTES
    finally:
        peer.close()
        worker.kill()


@pytest.mark.multiprocess
def test_a_plan_over_the_workers_limit_is_refused_unread_and_the_worker_serves_on(
    tmp_path: Path,
) -> None:
    """A 96 MiB message to a worker taking 16 MiB: ZMQ drops the connection at its length
    prefix, before anything is allocated for it (the worker's peak RSS grows by less than
    half the message), the worker logs the limit, and the sender's next hello and step, on
    the connection its DEALER makes again by itself, are answered exactly. Before the limit the
    worker received it whole (peak RSS +96 MiB) and answered "undecodable"."""
    worker = start_worker(tmp_path, "w", "tcp://127.0.0.1:0", "--step-max-message-mib", "16")
    peer = Peer(worker)
    try:
        kind, body = peer.call(encode_body(KIND_HELLO, HELLO))
        assert kind == KIND_HELLO and body["max_message_bytes"] == 16 * MIB
        before = peak_rss_mib(worker.proc.pid)
        peer.sock.send(encode_body(KIND_STEP, {"step": 1, "junk": bytes(96 * MIB)}))
        said = "over this worker's limit of 16 MiB (--step-max-message-mib)"
        wait_until(lambda: said in worker.log(), timeout=60)
        assert not peer.sock.poll(0), "the oversized plan was answered"
        assert peak_rss_mib(worker.proc.pid) - before < 48
        assert_served(worker, peer)
        assert "Traceback" not in worker.log()
    finally:
        peer.close()
        worker.kill()


@pytest.mark.multiprocess
def test_a_plan_over_the_limit_its_worker_told_fails_its_step_only(tmp_path: Path) -> None:
    """A worker taking plans up to 0.01 MiB (10,485 bytes) and a prompt of 6,000 tokens
    (~18 KB in its first step's plan): the scheduler warns at hello that its settings allow
    larger plans, does not send that plan, fails its request UNAVAILABLE naming the worker,
    the plan's size and the limit, says hello again, and serves the next request exactly."""
    worker = start_worker(tmp_path, "w", "tcp://127.0.0.1:0", "--step-max-message-mib", "0.01")
    sched = start_scheduler(
        tmp_path, "--workers", worker.info["endpoint"], "--num-gpu-blocks", "1024",
        "--probe-interval-s", "0.2",
    )  # fmt: skip
    try:
        assert "raise the worker's --step-max-message-mib" in sched.log()
        with EngineClient(sched.info["grpc_port"]) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate(tokens(6000, 200), 4)
            details = str(info.value.details())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, details
            assert "worker 0" in details and "over the worker's limit of 10485 bytes" in details
            assert "not sent" in details
            wait_until(lambda: client.stats().workers[0].up, timeout=30)
            prompt = tokens(20, 7)
            assert output_tokens(client.generate(prompt, 5)) == expected_output(prompt, 5)
        assert "Traceback" not in worker.log()
        assert sched.terminate() == 0
        assert "Traceback" not in sched.log()
    finally:
        sched.kill()
        worker.kill()


def test_the_bounds_hold_the_largest_plan_and_reply_of_their_settings() -> None:
    """A plan of max_num_seqs new requests each of model_len tokens with the widest token ids
    and request ids of 256 characters, every block id, and a reply of every request: each
    encoded is under its bound, and the limits are a multiple of it, at least 64 MiB."""
    seqs, model_len, blocks = 8, 512, 300
    rid = "r" * 252
    widest = [2**63 - 1] * model_len
    block_ids = list(range(2**31, 2**31 + 30))
    new = [NewRequestData(f"{rid}{i:04}", widest, block_ids, 0, 4) for i in range(seqs)]
    cached = [CachedRequestData(f"{rid}{i:04}", [2**31] * 3, 5, [2**63 - 1]) for i in range(seqs)]
    ids = [r.req_id for r in new]
    plan = StepPlan(1, new, cached, {r: 64 for r in ids}, ids, ids)
    bound = plan_bytes_bound(max_num_seqs=seqs, max_num_batched_tokens=seqs * 64,
                             model_len=model_len, num_gpu_blocks=blocks)  # fmt: skip
    assert len(encode_body(KIND_STEP, plan.to_wire())) < bound
    out = ConnectorWorkerOutput(0, [TransferResult(r, 2**63 - 1, [bytes(32)] * 10) for r in ids])
    result = StepResult(1, 0, {r: 2**63 - 1 for r in ids}, out)
    assert len(encode_body("result", result.to_wire())) < reply_bytes_bound(
        max_num_seqs=seqs, num_gpu_blocks=blocks
    )
    assert derived_limit(bound) == FLOOR_BYTES
    assert derived_limit(100 * MIB) == 400 * MIB
    big = ProcessConfig(
        SchedulerConfig(num_gpu_blocks=200_000, max_num_seqs=1024, max_model_len=131072),
        synthetic_workers=1,
    )
    assert big.plan_bytes_bound > 1024 * 131072 * 9
    assert ProcessConfig(synthetic_workers=1).reply_limit_bytes == FLOOR_BYTES
    assert ProcessConfig(synthetic_workers=1, step_max_message_mib=2).reply_limit_bytes == 2 * MIB
