"""The scheduler's gRPC front door is safe by default, on a real scheduler process with synthetic
worker processes and real grpc clients: without options it makes a random token, leaves it in a
0600 file its own user's clients read by themselves, and refuses Generate / EngineStats without
it (UNAUTHENTICATED, saying why) while serving everyone else; health and reflection stay open;
``--engine-auth-token-file`` (or its environment variable) sets the token, ``--engine-no-auth``
opts out. (Another user cannot read the 0600 file in the 0700 directory: the file modes are what
is checked here; this machine's other users cannot run its Python.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserver._proto.kvserver.v1 import engine_pb2 as pb
from kvserver.grpc_format import ERROR_CODE_KEY
from kvserver.token_file import make_token_file, read_token_file, token_path
from tests.scheduler.builders import expected_output, tokens
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler
from tests.support.ports import free_port

pytestmark = pytest.mark.multiprocess

WORKERS = ("--synthetic-workers", "1", "--num-gpu-blocks", "64", "--block-size", "16")


@pytest.fixture(scope="module")
def sched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_scheduler(tmp_path_factory.mktemp("sched-auth"), *WORKERS)
    try:
        yield proc
        assert proc.terminate() == 0, proc.log()
    finally:
        proc.kill()
    assert not Path(token_path(proc.info["grpc_port"])).exists()  # removed at shutdown


def refused(port: int, method: str, request: bytes, token: str | None) -> grpc.RpcError:
    """The error of a raw call to ``method`` presenting ``token`` (None: no metadata)."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        name = f"/kvserver.v1.Engine/{method}"
        with pytest.raises(grpc.RpcError) as err:
            if method == "Generate":
                list(channel.unary_stream(name)(request, timeout=10, metadata=metadata))
            else:
                channel.unary_unary(name)(request, timeout=10, metadata=metadata)
    return err.value


def test_without_options_the_front_door_needs_its_own_random_token(sched: Proc) -> None:
    port = sched.info["grpc_port"]
    path = token_path(port)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    token = Path(path).read_text()
    assert len(token) >= 32

    prompt = tokens(40, 700)
    request = pb.GenerateRequest(token_ids=prompt, max_tokens=3).SerializeToString()
    for method, body in (("Generate", request), ("EngineStats", b"")):
        for presented in (None, "", "not-the-token", token[:-1]):
            err = refused(port, method, body, presented)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (method, presented)
            assert "the scheduler's front door needs its token" in (err.details() or "")
            assert path in (err.details() or "")  # where this user's clients find it
            assert dict(err.trailing_metadata() or ())[ERROR_CODE_KEY] == "unauthenticated"

    with EngineClient(port) as client:  # finds the token by itself, and is served
        assert output_tokens(client.generate(prompt, 3)) == expected_output(prompt, 3)
        stats = client.stats()
        assert (stats.running, stats.waiting) == (0, 0)  # the refused Generates queued nothing
    with EngineClient(port, auth_token=token) as client:  # given explicitly
        assert client.stats().total_blocks == 64


def test_health_and_reflection_stay_open(sched: Proc) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{sched.info['grpc_port']}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "kvserver.v1.Engine"):
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        asked = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        answer = next(iter(stub.ServerReflectionInfo(asked, timeout=10)))
        names = {s.name for s in answer.list_services_response.service}
        assert "kvserver.v1.Engine" in names


def test_a_token_file_sets_the_token_by_flag_or_environment(tmp_path: Path) -> None:
    path = make_token_file(str(tmp_path / "keys"), "engine")
    token = read_token_file(path)
    by_env = {**os.environ, "KVSERVER_ENGINE_AUTH_TOKEN_FILE": path}
    for extra, env in (((("--engine-auth-token-file", path)), None), ((), by_env)):
        proc = start_scheduler(tmp_path, *WORKERS, *extra, env=env)
        try:
            port = proc.info["grpc_port"]
            assert Path(token_path(port)).read_text() == token  # for this user's clients too
            with EngineClient(port, auth_token=token) as client:
                assert len(client.generate(tokens(20, 5), 2)) == 2
            err = refused(port, "EngineStats", b"", "a-token-of-another-scheduler")
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            assert proc.terminate() == 0, proc.log()


def scheduler_exit(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "scheduler", *WORKERS, "--grpc-port", "0",
         "--metrics-port", "-1", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_an_unusable_token_file_is_refused_at_start(tmp_path: Path) -> None:
    path = make_token_file(str(tmp_path), "engine")
    os.chmod(path, 0o644)
    proc = scheduler_exit("--engine-auth-token-file", path)
    assert proc.returncode == 2
    assert "engine_auth_token_file" in proc.stderr and "other users" in proc.stderr
    os.chmod(path, 0o600)
    proc = scheduler_exit("--engine-auth-token-file", path, "--engine-no-auth")
    assert proc.returncode == 2 and "excludes engine_no_auth" in proc.stderr


def test_no_auth_opts_out_and_removes_a_stale_token_file(tmp_path: Path) -> None:
    """A scheduler SIGKILLed on a port leaves its token file; a --engine-no-auth scheduler
    that gets the same port removes it, and serves calls without a token."""
    port = free_port()
    killed = start_scheduler(tmp_path, *WORKERS, grpc_port=port)
    killed.kill()
    assert Path(token_path(port)).exists()
    proc = start_scheduler(tmp_path, *WORKERS, "--engine-no-auth", grpc_port=port)
    try:
        assert not Path(token_path(port)).exists()
        with EngineClient(port, auth_token="") as client:
            assert client.stats().total_blocks == 64
    finally:
        assert proc.terminate() == 0, proc.log()
