"""The synthetic worker and the step messages it speaks: StepPlan / StepResult / hello round
trip through the wire unchanged; malformed messages are InvalidArgument; the worker checks
every plan against the block tables it holds."""

from __future__ import annotations

import pytest

from kvserver.errors import InvalidArgument
from scheduler.synthetic import SyntheticWorker, next_token
from step_protocol import (
    KIND_RESULT,
    KIND_STEP,
    CachedRequestData,
    ChunkLoad,
    ConnectorMetadata,
    NewRequestData,
    RequestTransfers,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerInfo,
    decode,
    encode_body,
)
from tests.scheduler.builders import harness, tokens


def round_trip_plan(plan: StepPlan) -> StepPlan:
    kind, body = decode(encode_body(KIND_STEP, plan.to_wire()))
    assert kind == KIND_STEP
    return StepPlan.from_wire(body)


def test_plans_survive_the_wire() -> None:
    """Every plan of a run with chunked prefill and preemption decodes to an equal plan."""
    h = harness(num_gpu_blocks=6, long_prefill_token_threshold=3)
    h.add("A", tokens(5, 10), max_tokens=6)
    h.add("B", tokens(7, 20), max_tokens=6, greedy=False, seed=9)
    h.run()
    assert any(p.preempted_req_ids for p in h.plans)
    for plan in h.plans:
        assert round_trip_plan(plan) == plan


def test_connector_metadata_arrives_as_plain_values() -> None:
    meta = ConnectorMetadata(
        ns_id="ns", loads=[RequestTransfers("A", 7, loads=[ChunkLoad(b"k" * 32, [3, 4], 1)])]
    )
    plan = StepPlan(3, num_scheduled_tokens={}, connector_meta=meta)
    back = round_trip_plan(plan)
    assert isinstance(back.connector_meta, dict)
    assert ConnectorMetadata.from_wire(back.connector_meta) == meta
    result = SyntheticWorker().execute(back)
    assert result.connector_output is not None
    assert [(r.req_id, r.lease_id) for r in result.connector_output.loads] == [("A", 7)]


def test_results_and_hellos_survive_the_wire() -> None:
    result = StepResult(4, 1, {"A": 5, "B": 31_999})
    kind, body = decode(encode_body(KIND_RESULT, result.to_wire()))
    assert kind == KIND_RESULT and StepResult.from_wire(body) == result
    hello = WorkerHello(1, 2, 16, 128, "m")
    assert WorkerHello.from_wire(hello.to_wire()) == hello
    info = WorkerInfo(1, 99, 32_000, {"dtype": "float16"})
    assert WorkerInfo.from_wire(info.to_wire()) == info


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"step": 1},
        {"step": "1", "new": [], "cached": [], "sched": {}, "finished": [], "preempted": []},
        {"step": 1, "new": [["A"]], "cached": [], "sched": {}, "finished": [], "preempted": []},
        {"step": 1, "new": [], "cached": [["A", [1], 0, ["x"]]], "sched": {}, "finished": [],
         "preempted": []},
        {"step": 1, "new": [], "cached": [], "sched": {"A": "1"}, "finished": [],
         "preempted": []},
        {"step": 1, "new": [], "cached": [], "sched": {}, "finished": [3], "preempted": []},
    ],
)  # fmt: skip
def test_malformed_plans_are_invalid_argument(body: object) -> None:
    with pytest.raises(InvalidArgument):
        StepPlan.from_wire(body)


def test_malformed_results_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        StepResult.from_wire({"step": 1, "rank": 0, "sampled": {"A": "x"}})
    with pytest.raises(InvalidArgument):
        StepResult.from_wire({"step": 1, "rank": 0})


def test_worker_samples_deterministically() -> None:
    worker = SyntheticWorker(block_size=4, num_gpu_blocks=16)
    plan = StepPlan(
        1,
        new_reqs=[NewRequestData("A", [5, 6, 7], [1], 0, 4)],
        num_scheduled_tokens={"A": 3},
    )
    assert worker.execute(plan).sampled_token_ids == {"A": next_token(7, 3)}
    plan = StepPlan(
        2, cached_reqs=[CachedRequestData("A", [], 3, [42])], num_scheduled_tokens={"A": 1}
    )
    assert worker.execute(plan).sampled_token_ids == {"A": next_token(42, 4)}
    assert next_token(42, 4) != next_token(42, 4, seed=1)


@pytest.mark.parametrize(
    ("plan", "error"),
    [
        (StepPlan(1, cached_reqs=[CachedRequestData("X", [], 0, [1])]), "unknown request"),
        (StepPlan(1, new_reqs=[NewRequestData("A", [1], [99], 0, 1)]), "bad block id"),
        (StepPlan(1, new_reqs=[NewRequestData("A", [1], [0], 0, 1)]), "bad block id"),
        (
            StepPlan(1, new_reqs=[NewRequestData("A", [1] * 9, [1, 2], 0, 1)],
                     num_scheduled_tokens={"A": 9}),
            "block table too short",
        ),
        (
            StepPlan(1, new_reqs=[NewRequestData("A", [1] * 3, [1], 0, 1)],
                     num_scheduled_tokens={"A": 4}),
            "beyond the known tokens",
        ),
        (StepPlan(1, num_scheduled_tokens={"B": 1}), "without data"),
    ],
)  # fmt: skip
def test_worker_rejects_inconsistent_plans(plan: StepPlan, error: str) -> None:
    with pytest.raises(InvalidArgument, match=error):
        SyntheticWorker(block_size=4, num_gpu_blocks=16).execute(plan)


def test_hello_resets_the_worker() -> None:
    worker = SyntheticWorker(block_size=4, num_gpu_blocks=16)
    worker.execute(
        StepPlan(1, new_reqs=[NewRequestData("A", [1], [1], 0, 1)], num_scheduled_tokens={"A": 1})
    )
    assert worker.num_requests == 1
    info = worker.hello(WorkerHello(3, 4, 8, 32))
    assert worker.num_requests == 0 and info.rank == 3 and info.kv_layout
    assert (worker.block_size, worker.num_gpu_blocks) == (8, 32)


@pytest.mark.multiprocess
def test_a_bind_address_in_use_is_one_line_not_a_traceback() -> None:
    """``python -m scheduler.synthetic --bind`` on a taken port, as ``kvserver worker``."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        bind = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        result = subprocess.run(
            [sys.executable, "-m", "scheduler.synthetic", "--bind", bind, "--step-no-auth"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        f"synthetic worker: cannot listen on {bind}: Address already in use (addr='{bind}')"
    )
