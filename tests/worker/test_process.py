"""The worker process (worker/process.py, worker/cli.py): the step protocol over a real model,
in-process (ModelWorker) and as ``kvserver worker`` behind its ZMQ ROUTER."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from kvserver.client import KVClient
from kvserver.crypto import apply_token
from kvserver.errors import InvalidArgument
from kvserver.namespace import NamespaceSpec
from kvserver.token_file import token_path
from scheduler.kv_connector import KVServerSchedulerConnector
from step_protocol import (
    KIND_ERROR,
    KIND_HELLO,
    KIND_RESULT,
    KIND_STEP,
    CachedRequestData,
    NewRequestData,
    StepPlan,
    WorkerHello,
    decode,
    encode_body,
)
from tests.support.connector import patient_config
from tests.support.daemon import start_daemon
from worker.model import ModelConfig, generate, load_model, write_random_model
from worker.process import KVServerSettings, ModelWorker

PROMPT = list(range(40, 70))
BS = 4


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    write_random_model(path, ModelConfig(), seed=11)
    return path


def _plans(prompt: list[int], steps: int, sampled: list[int]) -> list[StepPlan]:
    """Chunked prefill of 16 tokens, then decode steps fed with ``sampled``."""
    blocks = list(range(20, 0, -1))
    plans = [
        StepPlan(0, new_reqs=[NewRequestData("r", prompt, blocks, 0, steps)],
                 num_scheduled_tokens={"r": 16}),
        StepPlan(1, cached_reqs=[CachedRequestData("r", [], 16, prompt[16:])],
                 num_scheduled_tokens={"r": len(prompt) - 16}),
    ]  # fmt: skip
    for i, token in enumerate(sampled[:-1]):
        pos = len(prompt) + i
        plans.append(
            StepPlan(2 + i, cached_reqs=[CachedRequestData("r", [], pos, [token])],
                     num_scheduled_tokens={"r": 1})
        )  # fmt: skip
    return plans


def test_model_worker_runs_plans_like_offline_generation(model_file: Path) -> None:
    want = generate(load_model(model_file), PROMPT, 6, block_size=BS)
    worker = ModelWorker(load_model(model_file))
    info = worker.hello(WorkerHello(0, 1, BS, 32, "tiny"))
    assert info.vocab_size == 512
    assert info.kv_layout == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
                              "dtype": "float32"}  # fmt: skip
    got: list[int] = []
    for plan in _plans(PROMPT, 6, want):
        result = worker.execute(StepPlan.from_wire(plan.to_wire()))
        assert result.step == plan.step and result.connector_output is None
        if plan.step == 0:
            assert result.sampled_token_ids == {"r": result.sampled_token_ids["r"]}
        else:
            got.append(result.sampled_token_ids["r"])
    assert got == want


def test_model_worker_refuses_inconsistent_plans(model_file: Path) -> None:
    worker = ModelWorker(load_model(model_file))
    with pytest.raises(InvalidArgument, match="before hello"):
        worker.execute(StepPlan(0))
    with pytest.raises(InvalidArgument, match="another rank"):
        worker.hello(WorkerHello(1, 2, BS, 32))
    worker.hello(WorkerHello(0, 1, BS, 32))
    with pytest.raises(InvalidArgument, match="unknown request"):
        worker.execute(StepPlan(0, cached_reqs=[CachedRequestData("x", [], 0, [1])],
                                num_scheduled_tokens={"x": 1}))  # fmt: skip
    with pytest.raises(InvalidArgument, match="block table too short"):
        worker.execute(StepPlan(1, new_reqs=[NewRequestData("y", PROMPT, [1], 0, 1)],
                                num_scheduled_tokens={"y": len(PROMPT)}))  # fmt: skip
    with pytest.raises(InvalidArgument, match="bad block id"):
        worker.execute(StepPlan(2, new_reqs=[NewRequestData("z", [1, 2], [32], 0, 1)],
                                num_scheduled_tokens={"z": 2}))  # fmt: skip


@pytest.mark.multiprocess
def test_worker_process_serves_the_step_protocol_and_exits_0_on_sigterm(
    model_file: Path, tmp_path: Path
) -> None:
    ready = tmp_path / "w.ready"
    args = [
        sys.executable, "-m", "kvserver.cli", "worker", "--rank", "0", "--world-size", "1",
        "--listen", "tcp://127.0.0.1:0", "--dist-init", "tcp://127.0.0.1:1",
        "--model-file", str(model_file), "--ready-file", str(ready),
    ]  # fmt: skip
    log = tmp_path / "w.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)  # polling for the ready file, bounded by the deadline
        endpoint = json.loads(ready.read_text())["endpoint"]
        # the step token the worker left for this user (step_protocol/step_auth.py)
        apply_token(sock, Path(token_path(int(endpoint.rsplit(":", 1)[1]))).read_text())
        sock.connect(endpoint)
        sock.rcvtimeo = 20_000

        def call(kind: str, body: dict[str, object]) -> tuple[str, dict[str, object]]:
            sock.send(encode_body(kind, body))
            return decode(sock.recv())

        kind, body = call(KIND_HELLO, {**WorkerHello(0, 1, BS, 32, "tiny").to_wire(), "seq": 7})
        assert kind == KIND_HELLO and body["seq"] == 7 and body["vocab_size"] == 512
        plan = StepPlan(0, new_reqs=[NewRequestData("r", PROMPT, list(range(1, 9)), 0, 1)],
                        num_scheduled_tokens={"r": len(PROMPT)})  # fmt: skip
        kind, body = call(KIND_STEP, plan.to_wire())
        want = generate(load_model(model_file), PROMPT, 1, block_size=BS)
        assert kind == KIND_RESULT and body["sampled"] == {"r": want[0]}
        kind, body = call(KIND_STEP, StepPlan(1, num_scheduled_tokens={"nope": 1}).to_wire())
        assert kind == KIND_ERROR and body["step"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
        assert not ready.exists()
    finally:
        sock.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.multiprocess
@pytest.mark.parametrize("then", ["hello", "close"])
def test_a_worker_copies_none_of_the_stores_its_scheduler_forgot(
    model_file: Path, tmp_path: Path, then: str
) -> None:
    """A step fails (another rank died), or the scheduler stops: it forgets every transfer
    and releases its leases on the daemon (``reset``, ``close``), whose pages then hold
    another client's chunks. The worker still holds the last step's stores (deferred to the
    next step's start): the recovery's hello, or the worker's own shutdown, must drop them,
    not copy them into the released pages (was: both drained them, overwriting the other
    client's chunks in the arena)."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "64KiB")  # 16 pages
    worker = ModelWorker(load_model(model_file), KVServerSettings(d.zmq_address))
    conn: KVServerSchedulerConnector | None = None
    try:
        worker.hello(WorkerHello(0, 1, BS, 32, "tiny"))
        assert worker.connector is not None and worker.connector.is_colocated
        spec = worker.connector.spec  # chunk_blocks 1: a 4 KiB part, one page per chunk
        conn = KVServerSchedulerConnector(patient_config(d.zmq_address, spec))
        req = _Req("r", PROMPT, spec)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        blocks = list(range(1, 9))
        conn.update_state_after_alloc(req, blocks, 0)
        plan = StepPlan(1, new_reqs=[NewRequestData("r", PROMPT, blocks, 0, 4)],
                        num_scheduled_tokens={"r": len(PROMPT)})  # fmt: skip
        plan.connector_meta = conn.build_connector_meta(plan)
        out = worker.execute(plan).connector_output
        conn.update_connector_output([out] if out is not None else [])
        plan = StepPlan(2, finished_req_ids=[])
        plan.connector_meta = conn.build_connector_meta(plan)  # ships 7 reserved stores
        assert plan.connector_meta.stores and worker.execute(plan) is not None
        assert worker.connector.num_pending == 1  # deferred to the next step's start
        conn.reset()  # the next step failed: everything forgotten, its leases released
        other = [hashlib.sha256(b"other%d" % i).digest() for i in range(16)]
        parts = [bytes([i + 1]) * spec.part_bytes for i in range(16)]
        with KVClient(d.zmq_address, colocated=False) as kv:
            kv.register_namespace(spec)
            assert kv.put(spec.ns_id, other, parts).stored == other  # every page
            if then == "hello":
                worker.hello(WorkerHello(0, 1, BS, 32, "tiny"))  # the recovery
                assert worker.connector.num_pending == 0
            else:
                worker.close()
            got = [bytes(row[0]) for row in kv.get(spec.ns_id, other, ranks=[0])]
        assert got == parts
    finally:
        if conn is not None:
            conn.close()
        worker.close()
        d.terminate()


class _Req:
    """A request as the scheduler connector reads it (RequestLike)."""

    def __init__(self, req_id: str, token_ids: list[int], spec: NamespaceSpec) -> None:
        self.request_id, self.all_token_ids, self.cache_salt = req_id, token_ids, None
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        assert spec.block_size == BS
