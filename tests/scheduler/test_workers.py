"""WorkerGroup: fan-out of step plans over ZMQ and gather of the results with a deadline; a
worker that dies, errs or times out fails the step clearly, and the group comes back.

In-process tests drive the group against ROUTER sockets served by this test (same loop);
the multi-process test kills a real synthetic worker under a running scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq
import zmq.asyncio

from scheduler.synthetic import SyntheticWorker
from scheduler.workers import WorkerFailure, WorkerGroup
from step_protocol import (
    KIND_ERROR,
    KIND_HELLO,
    KIND_RESULT,
    KIND_STEP,
    StepPlan,
    StepResult,
    WorkerHello,
    decode,
    encode_body,
    step_auth,
)
from tests.scheduler.builders import expected_output, tokens
from tests.scheduler.procs import EngineClient, output_tokens, start_scheduler, start_worker
from tests.support.connector import patient_config
from tests.support.daemon import wait_until
from tests.support.ipv6 import needs_ipv6

HELLO = WorkerHello(0, 1, 4, 64)
Behaviour = Callable[[str, dict[str, object]], list[bytes] | None]


def synthetic(worker: SyntheticWorker) -> Behaviour:
    """Answer like a synthetic worker process would."""

    def answer(kind: str, body: dict[str, object]) -> list[bytes] | None:
        if kind == KIND_HELLO:
            info = worker.hello(WorkerHello.from_wire(body)).to_wire()
            return [encode_body(KIND_HELLO, {**info, "seq": body["seq"]})]
        plan = StepPlan.from_wire(body)
        return [encode_body(KIND_RESULT, worker.execute(plan).to_wire())]

    return answer


@contextlib.asynccontextmanager
async def served(ctx: zmq.asyncio.Context, behaviour: Behaviour) -> AsyncIterator[str]:
    """A ROUTER on an ephemeral loopback port answering with ``behaviour`` (None = silence);
    it takes no token, and like a worker with ``--step-no-auth`` removes a token file a killed
    process may have left for its port."""
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind("tcp://127.0.0.1:*")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    step_auth.unpublish_stale(address)

    async def loop() -> None:
        while True:
            ident, data = await sock.recv_multipart()
            kind, body = decode(data)
            for reply in behaviour(kind, body) or ():
                await sock.send_multipart([ident, reply])

    task = asyncio.create_task(loop())
    try:
        yield address
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """The test's context; at teardown every socket it tracks is closed (LINGER 0) before
    ``term()``, which waits for every socket of the context."""
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def groups(ctx: zmq.asyncio.Context) -> AsyncIterator[Callable[..., WorkerGroup]]:
    """``groups(addresses, **options)``: a WorkerGroup on ``ctx``, closed at teardown, also
    when the test failed before its own ``close()`` (its DEALERs' monitor sockets live on a
    shadow of the context that ``destroy`` does not see: left open, ``term()`` would hang
    instead of the failure being reported)."""
    made: list[WorkerGroup] = []

    def make(addresses: list[str], **options: Any) -> WorkerGroup:
        made.append(WorkerGroup(addresses, context=ctx, **options))
        return made[-1]

    yield make
    for group in made:
        await group.close()


async def test_step_fans_out_and_gathers_in_rank_order(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    w0, w1 = SyntheticWorker(), SyntheticWorker()
    async with served(ctx, synthetic(w0)) as a0, served(ctx, synthetic(w1)) as a1:
        group = groups([a0, a1], step_timeout_s=5)
        infos = await group.start(HELLO, timeout_s=5)
        assert [i.rank for i in infos] == [0, 1] and group.failure is None
        from scheduler.scheduler import Scheduler
        from tests.scheduler.builders import config

        s = Scheduler(config())
        s.add_request(s.make_request("A", tokens(6), max_tokens=3))
        while s.has_work():
            plan = s.schedule()
            results = await group.step(plan)
            assert [r.rank for r in results] == [0, 1]
            s.update_from_output(plan, results)
        assert w0.num_requests == 0 and w1.num_requests == 0
        await group.close()


async def test_silent_worker_times_out_then_recovers(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    worker = SyntheticWorker()
    answer = synthetic(worker)
    silent = {"on": False}

    def behaviour(kind: str, body: dict[str, object]) -> list[bytes] | None:
        return None if silent["on"] and kind != KIND_HELLO else answer(kind, body)

    async with served(ctx, behaviour) as address:
        group = groups([address], step_timeout_s=0.2)
        await group.start(HELLO, timeout_s=5)
        silent["on"] = True
        with pytest.raises(WorkerFailure) as info:
            await group.step(StepPlan(1))
        assert "worker 0" in str(info.value) and "no reply to step 1" in str(info.value)
        assert info.value.rank == 0 and group.failure is info.value
        with pytest.raises(WorkerFailure):  # down: refused at once
            await group.step(StepPlan(2))
        silent["on"] = False
        assert await group.recover(5)
        assert group.failure is None
        (result,) = await group.step(StepPlan(3))
        assert result.step == 3
        await group.close()


async def test_error_reply_fails_the_step(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    def behaviour(kind: str, body: dict[str, object]) -> list[bytes] | None:
        if kind == KIND_HELLO:
            return synthetic(SyntheticWorker())(kind, body)
        return [encode_body(KIND_ERROR, {"step": body["step"], "message": "out of memory"})]

    async with served(ctx, behaviour) as address:
        group = groups([address], step_timeout_s=5)
        await group.start(HELLO, timeout_s=5)
        with pytest.raises(WorkerFailure, match="out of memory"):
            await group.step(StepPlan(1))
        await group.close()


async def test_malformed_result_fails_the_step_as_the_workers_fault(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    """A result whose fields have the wrong types: a WorkerFailure naming the worker (the
    scheduler recovers it by a hello), not an InvalidArgument out of the scheduler's step
    (which it took for a bug of its own: "internal scheduler error")."""

    def behaviour(kind: str, body: dict[str, object]) -> list[bytes] | None:
        if kind == KIND_HELLO:
            return synthetic(SyntheticWorker())(kind, body)
        bad = {"step": body["step"], "rank": 0, "sampled": {"A": "not a token"}}
        return [encode_body(KIND_RESULT, bad)]

    async with served(ctx, behaviour) as address:
        group = groups([address], step_timeout_s=5)
        await group.start(HELLO, timeout_s=5)
        with pytest.raises(WorkerFailure, match="malformed result of step 1"):
            await group.step(StepPlan(1))
        assert group.failure is not None
        await group.close()


async def test_stale_replies_are_dropped(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    """A slow worker's answer to an older step must not pass for the current one."""

    def behaviour(kind: str, body: dict[str, object]) -> list[bytes] | None:
        if kind == KIND_HELLO:
            return synthetic(SyntheticWorker())(kind, body)
        step = int(body["step"])  # type: ignore[call-overload]
        stale = StepResult(step - 1, 0, {"old": 1}).to_wire()
        return [
            encode_body(KIND_RESULT, stale),
            encode_body(KIND_RESULT, StepResult(step, 0).to_wire()),
        ]

    async with served(ctx, behaviour) as address:
        group = groups([address], step_timeout_s=5)
        await group.start(HELLO, timeout_s=5)
        (result,) = await group.step(StepPlan(7))
        assert result.step == 7 and result.sampled_token_ids == {}
        await group.close()


async def test_unreachable_worker_fails_hello(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    group = groups(["tcp://127.0.0.1:1"])
    with pytest.raises(WorkerFailure, match=r"did not answer hello.*nothing accepts connections"):
        await group.start(HELLO, timeout_s=0.2)
    assert not await group.recover(0.1)
    await group.close()


@needs_ipv6
@pytest.mark.multiprocess
async def test_a_worker_on_ipv6_loopback_answers_hello(
    tmp_path: Path, groups: Callable[..., WorkerGroup]
) -> None:
    """Scenario: ``kvserver worker --listen tcp://[::1]:P`` and the scheduler's ``--workers
    tcp://[::1]:P``. Was: the worker's bind failed ("No such device") and the scheduler's
    DEALER could not connect (ZMQ sockets take IPv6 only with ZMQ_IPV6 set)."""
    worker = start_worker(tmp_path, "w6", "tcp://[::1]:0")
    try:
        endpoint = str(worker.info["endpoint"])
        assert endpoint.startswith("tcp://[::1]:")
        group = groups([endpoint])
        (info,) = await group.start(HELLO, timeout_s=60)
        assert info.rank == 0
        (result,) = await group.step(StepPlan(1))
        assert result.step == 1
    finally:
        worker.kill()


async def test_a_worker_gone_fails_the_step_at_once_and_its_stop_leaves_no_lost_error(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    """Scenario: a worker's connection closed between two steps. ZMQ refuses the step's send
    at once (EAGAIN: IMMEDIATE, no connection), and that is the step's failure. Was:
    zmq.asyncio returned the refusal in a future nobody read, so the step waited out its
    timeout ("no reply to step 2 within 60s"), and asyncio logged "Future exception was never
    retrieved" with a traceback, as at every SIGTERM of a scheduler whose synthetic workers
    had already exited (the stop it sends them at close)."""
    lost: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, c: lost.append(c["message"]))
    async with served(ctx, synthetic(SyntheticWorker())) as address:
        group = groups([address], step_timeout_s=60.0)
        await group.start(HELLO, timeout_s=5)
    dealer = group._workers[0].sock
    assert dealer is not None
    plain = zmq.Socket.shadow(dealer.underlying)
    wait_until(lambda: not plain.getsockopt(zmq.EVENTS) & zmq.POLLOUT, timeout=60.0)
    with pytest.raises(WorkerFailure, match=r"not connected \(step 2\)"):
        await group.step(StepPlan(2))
    await group.close(stop_workers=True)
    gc.collect()
    assert lost == []


@pytest.mark.multiprocess
def test_killed_worker_fails_its_requests_and_the_scheduler_stays_up(tmp_path: Path) -> None:
    """kill -9 of worker 1 mid-generation: the stream ends UNAVAILABLE naming the worker; the
    scheduler keeps serving (stats, immediate UNAVAILABLE while down) and, once the worker is
    back on its address, generates again."""
    w0 = start_worker(tmp_path, "w0")
    w1 = start_worker(tmp_path, "w1")
    sched = start_scheduler(
        tmp_path,
        "--workers", f"{w0.info['endpoint']},{w1.info['endpoint']}",
        "--num-gpu-blocks", "4096", "--step-timeout-s", "1", "--probe-interval-s", "0.2",
    )  # fmt: skip
    try:
        with EngineClient(sched.info["grpc_port"]) as client:
            stream = client.stream(tokens(32), 60_000)
            first = next(stream)
            assert first.token_ids
            w1.kill()
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker 1" in info.value.details()
            stats = client.stats()
            assert not stats.workers[1].up and "worker 1" in stats.workers_error
            assert stats.running == 0 and stats.free_blocks == stats.total_blocks - 1
            with pytest.raises(grpc.RpcError) as info:
                client.generate(tokens(8), 2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            w1 = start_worker(tmp_path, "w1b", bind=w1.info["endpoint"])
            prompt = tokens(20, 7)
            # the scheduler probes every 0.2 s: poll its stats, bounded by wait_until's deadline
            wait_until(lambda: client.stats().workers[1].up, timeout=20)
            msgs = client.generate(prompt, 5)
            assert output_tokens(msgs) == expected_output(prompt, 5)
        assert sched.terminate() == 0
    finally:
        sched.kill()
        w0.kill()
        w1.kill()


async def test_an_internal_scheduler_error_makes_the_workers_forget_before_the_next_step(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup]
) -> None:
    """A bug raises out of a step: the scheduler fails what was in flight (``fail_all``: its
    connector forgets every transfer and releases their leases). The workers must be told
    (a hello, which makes them drop the transfers they still hold) before the next step, or
    they copy the forgotten stores into released pages and loads into blocks given to new
    requests (was: the next step went to them as if nothing had happened)."""
    from scheduler.engine_core import EngineCore
    from scheduler.engine_service import GenerateParams
    from scheduler.scheduler import Scheduler
    from tests.scheduler.builders import config

    worker = SyntheticWorker()
    answer = synthetic(worker)
    seen: list[str] = []

    def behaviour(kind: str, body: dict[str, object]) -> list[bytes] | None:
        seen.append(kind)
        return answer(kind, body)

    async with served(ctx, behaviour) as address:
        group = groups([address], step_timeout_s=5)
        await group.start(HELLO, timeout_s=5)
        scheduler = Scheduler(config())
        real = scheduler.update_from_output
        broken = {"on": True}

        def update_from_output(plan: StepPlan, results: Any) -> Any:
            if broken.pop("on", False):  # a bug, once (the real parts cannot be made to)
                raise RuntimeError("a bug")
            return real(plan, results)

        scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
        core = EngineCore(scheduler, group, probe_interval_s=0.05)
        loop = asyncio.create_task(core.run())
        try:
            first = [o async for o in core.submit(GenerateParams(tokens(6), 2))]
            assert first[-1].finished and "internal scheduler error" in (first[-1].error or "")
            async with asyncio.timeout(5):  # new requests are refused until the hello is done
                while group.failure is not None:
                    await asyncio.sleep(0.01)  # polling the loop's recovery, bounded
            second = [o async for o in core.submit(GenerateParams(tokens(6), 2))]
            assert second[-1].finished and not second[-1].error
        finally:
            core.stop()
            await loop
        failed = seen.index(KIND_STEP)  # the step whose update_from_output raised
        assert seen[failed + 1] == KIND_HELLO, seen


@pytest.mark.multiprocess
async def test_leases_of_a_failed_step_are_released_only_once_the_workers_answered_hello(
    ctx: zmq.asyncio.Context, groups: Callable[..., WorkerGroup], tmp_path: Path
) -> None:
    """A worker misses a step's deadline: the scheduler fails what held KV and its connector
    forgets every transfer, but a worker that is only slow may still be copying a store into
    the reservation's pages. The leases are released once every worker answered the
    recovery's hello (which waits for its copies in flight), not before (was: released at
    once by ``reset``, the pages free for other chunks while the copies went on). A worker
    that never answers is tests/test_e2e_failures.py's: released after that hello's
    timeout."""
    from kvserver.client import KVClient
    from kvserver.namespace import NamespaceSpec
    from scheduler.engine_core import EngineCore
    from scheduler.engine_service import GenerateParams
    from scheduler.kv_connector import KVServerSchedulerConnector
    from scheduler.scheduler import Scheduler
    from tests.scheduler.builders import config
    from tests.support.daemon import start_daemon

    daemon = start_daemon(tmp_path)
    cfg = config()
    spec = NamespaceSpec(
        model="test/failed-step", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8,
        block_size=cfg.block_size, chunk_blocks=1, hash_algo=cfg.hash_algo,
        hash_seed=cfg.hash_seed,
    )  # fmt: skip
    answer = synthetic(SyntheticWorker())
    leases_at_hello: list[int] = []
    steps = {"n": 0}

    def num_leases() -> int:
        with KVClient(daemon.zmq_address, colocated=False) as kv:
            return int(kv.stats()["num_leases"])

    def behaviour(kind: str, body: dict[str, object]) -> list[bytes] | None:
        if kind == KIND_HELLO:
            leases_at_hello.append(num_leases())
            return answer(kind, body)
        steps["n"] += 1  # slow in step 2, which ships the stores reserved in step 1
        return None if steps["n"] == 2 else answer(kind, body)

    connector = KVServerSchedulerConnector(patient_config(daemon.zmq_address, spec))
    try:
        async with served(ctx, behaviour) as address:
            group = groups([address], step_timeout_s=0.5)
            await group.start(HELLO, timeout_s=5)
            core = EngineCore(Scheduler(cfg, connector=connector), group, probe_interval_s=0.05)
            loop = asyncio.create_task(core.run())
            try:
                outs = [o async for o in core.submit(GenerateParams(tokens(12), 8))]
                assert outs[-1].finished and "no reply to step 2" in (outs[-1].error or "")
                async with asyncio.timeout(5):
                    while group.failure is not None:
                        await asyncio.sleep(0.01)  # polling the loop's recovery, bounded
            finally:
                core.stop()
                await loop
        assert leases_at_hello[-1] >= 1, leases_at_hello  # still held while workers copy
        assert num_leases() == 0  # released once they answered
    finally:
        connector.close()
        daemon.terminate()
