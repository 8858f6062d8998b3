"""The gRPC front door on a real scheduler process with synthetic worker processes: Generate
streams tokens, reports where the prompt's KV came from (GPU prefix cache, kvserver,
computed), maps errors to status codes, aborts cancelled requests, shuts down in order."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserver._proto.kvserver.v1 import engine_pb2 as epb
from kvserver.grpc_format import ERROR_CODE_KEY
from tests.scheduler.builders import expected_output, tokens
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler
from tests.support.connector import PATIENT_ARGS
from tests.support.daemon import start_daemon, wait_until
from tests.support.ports import free_port

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def sched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_scheduler(
        tmp_path_factory.mktemp("sched"),
        "--synthetic-workers", "2", "--num-gpu-blocks", "512", "--block-size", "16",
        "--max-model-len", "1024",
    )  # fmt: skip
    try:
        yield proc
        assert proc.terminate() == 0, proc.log()
    finally:
        proc.kill()


@pytest.fixture
def client(sched: Proc) -> Iterator[EngineClient]:
    with EngineClient(sched.info["grpc_port"]) as c:
        yield c


def test_generate_streams_tokens_then_hits_the_gpu_prefix_cache(client: EngineClient) -> None:
    prompt = tokens(100, 5000)
    msgs = client.generate(prompt, 6, request_id="first")
    assert len(msgs) == 6 and all(len(m.token_ids) == 1 for m in msgs)
    assert output_tokens(msgs) == expected_output(prompt, 6)
    assert msgs[0].request_id == "first" and msgs[-1].finished
    assert not any(m.finished for m in msgs[:-1])
    assert msgs[-1].finish_reason == 2  # LENGTH
    usage = msgs[0].usage
    assert (usage.prompt_tokens, usage.gpu_cached_tokens, usage.computed_tokens) == (100, 0, 100)
    assert msgs[-1].HasField("usage") and not msgs[1].HasField("usage")
    again = client.generate(prompt, 6)
    assert output_tokens(again) == output_tokens(msgs)
    usage = again[0].usage
    assert (usage.gpu_cached_tokens, usage.kvserver_tokens, usage.computed_tokens) == (96, 0, 4)


def test_cache_salt_separates_prefix_caches(client: EngineClient) -> None:
    prompt = tokens(64, 9000)
    client.generate(prompt, 1, cache_salt="tenant-a")
    other = client.generate(prompt, 1, cache_salt="tenant-b")
    assert other[0].usage.gpu_cached_tokens == 0
    same = client.generate(prompt, 1, cache_salt="tenant-a")
    assert same[0].usage.gpu_cached_tokens == 48


def test_stop_token(client: EngineClient) -> None:
    prompt = tokens(10, 100)
    want = expected_output(prompt, 3)
    msgs = client.generate(prompt, 50, stop_token_ids=[want[2]])
    assert output_tokens(msgs) == want and msgs[-1].finish_reason == 1  # STOP


def test_concurrent_requests(client: EngineClient) -> None:
    prompts = [tokens(20 + i, 300 * i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: output_tokens(client.generate(p, 12)), prompts))
    assert results == [expected_output(p, 12) for p in prompts]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "status", "code"),
    [
        ([], 4, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
        ([1, 2], 0, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
        (list(range(1024)), 4, grpc.StatusCode.RESOURCE_EXHAUSTED, "capacity"),
    ],
)
def test_bad_requests(
    client: EngineClient, prompt: list[int], max_tokens: int, status: grpc.StatusCode, code: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt, max_tokens)
    assert info.value.code() == status
    assert (ERROR_CODE_KEY, code) in info.value.trailing_metadata()


def test_undecodable_request_is_invalid_argument(client: EngineClient) -> None:
    call = client.channel.unary_stream("/kvserver.v1.Engine/Generate")
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\xff\xff\xff", timeout=10, metadata=client.metadata()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cancelled_stream_aborts_its_request(client: EngineClient) -> None:
    stream = client.stream(tokens(16, 77), 900, request_id="to-cancel")
    assert next(stream).token_ids
    stream.cancel()  # type: ignore[attr-defined]
    wait_until(lambda: client.stats().running == 0, timeout=20)
    stats = client.stats()
    assert stats.free_blocks == stats.total_blocks - 1


def test_health_and_stats(client: EngineClient) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="kvserver.v1.Engine"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stats = client.stats()
    assert [w.up for w in stats.workers] == [True, True] and not stats.kvserver_connector
    assert stats.total_blocks == 512 and stats.workers_error == ""


def test_the_start_up_line_names_the_metrics_url(sched: Proc, tmp_path: Path) -> None:
    """The scheduler's ``serving`` line says where /metrics is, or ``off`` (before: it named
    only the gRPC port, and an operator with ``--metrics-port 0`` could not find it)."""
    port = sched.info["metrics_port"]
    assert f"127.0.0.1:{sched.info['grpc_port']}, metrics http://127.0.0.1:{port}/metrics:" in (
        sched.log()
    )
    off = start_scheduler(tmp_path, "--synthetic-workers", "1", "--metrics-port", "-1")
    try:
        assert off.info["metrics_port"] == -1
        assert f"127.0.0.1:{off.info['grpc_port']}, metrics off:" in off.log()
        assert off.terminate() == 0, off.log()
    finally:
        off.kill()


def test_sigterm_ends_in_flight_streams_and_exits_0(tmp_path: Path) -> None:
    proc = start_scheduler(
        tmp_path,
        "--synthetic-workers", "1", "--num-gpu-blocks", "4096", "--shutdown-grace-s", "0.3",
    )  # fmt: skip
    try:
        with EngineClient(proc.info["grpc_port"]) as c:
            stream = c.stream(tokens(8), 60_000)
            assert next(stream).token_ids
            assert proc.terminate() == 0
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert "stopped" in proc.log()
        assert not Path(proc.args[proc.args.index("--ready-file") + 1]).exists()
    finally:
        proc.kill()


def test_prompt_kv_comes_back_from_kvserver(tmp_path: Path) -> None:
    """With --kvserver, a prompt whose GPU blocks were evicted is loaded from the daemon."""
    daemon = start_daemon(tmp_path / "daemon", "--dram", "16MiB")
    proc = start_scheduler(
        tmp_path,
        "--synthetic-workers", "2", "--num-gpu-blocks", "17", "--block-size", "16",
        "--kvserver", daemon.zmq_address, *PATIENT_ARGS, "--chunk-blocks", "1",
    )  # fmt: skip
    try:
        with EngineClient(proc.info["grpc_port"]) as c:
            p, q = tokens(128, 100), tokens(240, 5000)
            first = c.generate(p, 1)
            assert first[0].usage.computed_tokens == 128
            c.generate(q, 1)  # evicts most of p's GPU blocks
            again = c.generate(p, 3)
            usage = again[0].usage
            assert usage.kvserver_tokens > 0, usage
            assert usage.gpu_cached_tokens + usage.kvserver_tokens + usage.computed_tokens == 128
            assert output_tokens(again) == expected_output(p, 3)
            assert c.stats().kvserver_connector
        assert proc.terminate() == 0, proc.log()
    finally:
        proc.kill()
        daemon.kill()


def test_an_unreachable_daemon_is_said_at_start_and_prompts_are_computed(
    tmp_path: Path,
) -> None:
    """The scheduler used to start without a word when its --kvserver did not answer."""
    port = free_port()  # a port nobody listens on (outside the ephemeral range)
    proc = start_scheduler(
        tmp_path,
        "--synthetic-workers", "1", "--num-gpu-blocks", "17", "--block-size", "16",
        "--kvserver", f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    try:
        assert f"kvserver daemon at tcp://127.0.0.1:{port} is unreachable" in proc.log()
        with EngineClient(proc.info["grpc_port"]) as c:
            p = tokens(48, 3)
            out = c.generate(p, 2)
            assert out[0].usage.computed_tokens == 48
            assert output_tokens(out) == expected_output(p, 2)
        assert proc.terminate() == 0, proc.log()
    finally:
        proc.kill()


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_oversized_prompts_and_stop_lists_are_refused_before_they_cost(
    sched: Proc, client: EngineClient
) -> None:
    """A 3,000,000-token prompt (3 MB, max_model_len 1,024) was made into a list, checked
    against the vocabulary and hashed block by block (15M tokens: +1 GB and 12.7 s of the
    scheduler's loop, every other generation stalled) before add_request refused its length;
    now RESOURCE_EXHAUSTED before it is hashed. 100,000 stop_token_ids (held as a frozenset
    for the request's life: 3M were +308 MB) are INVALID_ARGUMENT at their count. Another
    client's generation runs on."""
    channel = grpc.insecure_channel(
        f"127.0.0.1:{sched.info['grpc_port']}",
        options=[("grpc.max_send_message_length", 64 << 20)],
    )
    call = channel.unary_stream(
        "/kvserver.v1.Engine/Generate",
        request_serializer=epb.GenerateRequest.SerializeToString,
        response_deserializer=epb.GenerateResponse.FromString,
    )
    try:
        Path(f"/proc/{sched.proc.pid}/clear_refs").write_text("5")  # the peak := RSS now
        before = _peak_rss(sched.proc.pid)
        with pytest.raises(grpc.RpcError) as info:
            list(call(epb.GenerateRequest(token_ids=[1] * 3_000_000, max_tokens=1),
                      metadata=client.metadata(), timeout=60))  # fmt: skip
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "prompt too long" in (info.value.details() or "")
        peak = _peak_rss(sched.proc.pid) - before
        assert peak < 48 << 20, peak
        with pytest.raises(grpc.RpcError) as info:
            stops = list(range(1000, 101_000))
            list(call(epb.GenerateRequest(token_ids=[1, 2, 3], max_tokens=4,
                                          stop_token_ids=stops),
                      metadata=client.metadata(), timeout=60))  # fmt: skip
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop_token_ids" in (info.value.details() or "")
    finally:
        channel.close()
    prompt = tokens(40, start=900)
    assert output_tokens(list(client.stream(prompt, 4))) == expected_output(prompt, 4)
