"""The engine's transport security with real processes (docs/security.md, "The engine"): CURVE
on the scheduler → worker step channel (real ``kvserver worker`` ranks: the tokens equal the
clear-text run's; wrong keys on either side fail the scheduler's start at once, saying which
option is wrong, and leave the worker serving), TLS on the scheduler's gRPC front door (a real
grpc client over TLS is served, a clear-text one refused; mutual TLS), and the daemon's rule:
nothing listens or connects beyond loopback in clear text without ``--insecure-remote``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvserver.crypto import CurveClient, TlsClient, TlsServer, make_curve_keys, make_tls_cert
from kvserver.errors import InvalidArgument
from scheduler.config import ProcessConfig
from step_protocol.security import check_worker_listen
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler
from tests.support.cluster import start_tp_workers

pytestmark = pytest.mark.multiprocess

PROMPTS = [list(range(1, 41)), [7] * 20 + list(range(100, 133))]
MAX_TOKENS = 6
REAL = ["--num-gpu-blocks", "64", "--block-size", "16", "--model", "tiny"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The workers' pair, a scheduler pair listed in the workers' clients directory, an
    unlisted pair, another server's pair; the front door's certificate and a client's."""
    d = tmp_path_factory.mktemp("keys")
    out: dict[str, str] = {}
    out["workers.key"], out["workers.key_secret"] = make_curve_keys(str(d), "workers")
    _, out["scheduler.key_secret"] = make_curve_keys(str(d / "clients"), "scheduler")
    _, out["stranger.key_secret"] = make_curve_keys(str(d / "elsewhere"), "stranger")
    out["other.key"], _ = make_curve_keys(str(d / "elsewhere"), "other")
    out["clients"] = str(d / "clients")
    out["scheduler.crt"], out["scheduler.pem"] = make_tls_cert(
        str(d), "scheduler", ["127.0.0.1", "localhost"]
    )
    out["client.crt"], out["client.pem"] = make_tls_cert(str(d), "client", ["router.example"])
    return out


def _generate(port: int, tls: TlsClient | None = None) -> list[list[int]]:
    with EngineClient(port, tls) as client:
        return [output_tokens(client.generate(p, MAX_TOKENS)) for p in PROMPTS]


def _run_scheduler(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvserver scheduler`` expected to fail at start: its exit status and stderr."""
    argv = [sys.executable, "-m", "kvserver.cli", "scheduler", "--grpc-port", "0",
            "--metrics-port", "-1", *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _terminate(*procs: Proc) -> None:
    for p in procs:
        assert p.terminate() == 0, p.log()


def test_the_step_channel_over_curve_gives_the_clear_text_tokens_and_refuses_wrong_keys(
    tmp_path: Path, keys: dict[str, str]
) -> None:
    clear_workers = start_tp_workers(tmp_path, None, world=1, tag="-clear")
    try:
        addr = clear_workers[0].info["endpoint"]
        sched = start_scheduler(tmp_path, "--workers", addr, *REAL)
        try:
            want = _generate(sched.info["grpc_port"])
        finally:
            _terminate(sched)
    finally:
        _terminate(*clear_workers)
    assert all(len(t) == MAX_TOKENS for t in want)

    server = ["--step-curve-secret-key-file", keys["workers.key_secret"],
              "--step-curve-clients-dir", keys["clients"]]  # fmt: skip
    workers = start_tp_workers(tmp_path, None, world=1, tag="-curve", extra=server)
    try:
        addr = workers[0].info["endpoint"]
        client = ["--step-curve-server-key-file", keys["workers.key"],
                  "--step-curve-secret-key-file", keys["scheduler.key_secret"]]  # fmt: skip
        sched = start_scheduler(tmp_path, "--workers", addr, *client, *REAL)
        try:
            assert _generate(sched.info["grpc_port"]) == want
        finally:
            _terminate(sched)

        # wrong keys: the scheduler's start fails at once, naming the step channel's option
        wrong = {
            "requires CURVE": [],
            "step_curve_server_key_file is not the worker's public key": [
                "--step-curve-server-key-file", keys["other.key"],
                "--step-curve-secret-key-file", keys["scheduler.key_secret"],
            ],
            "the worker refused this client's CURVE key": [
                "--step-curve-server-key-file", keys["workers.key"],
                "--step-curve-secret-key-file", keys["stranger.key_secret"],
            ],
        }  # fmt: skip
        for reason, flags in wrong.items():
            done = _run_scheduler("--workers", addr, *flags, *REAL)
            assert done.returncode == 1, (reason, done.stderr)
            assert reason in done.stderr and f"worker 0 at {addr}" in done.stderr, done.stderr

        # the worker was not disturbed: the right keys are served again
        sched = start_scheduler(tmp_path, "--workers", addr, *client, *REAL)
        try:
            assert _generate(sched.info["grpc_port"])[:1] == want[:1]
        finally:
            _terminate(sched)
    finally:
        _terminate(*workers)


def test_the_front_door_over_tls_serves_a_tls_client_and_refuses_clear_text(
    tmp_path: Path, keys: dict[str, str]
) -> None:
    clear = start_scheduler(tmp_path, "--synthetic-workers", "1")
    try:
        want = _generate(clear.info["grpc_port"])
    finally:
        _terminate(clear)
    tls = ["--tls-cert-file", keys["scheduler.crt"], "--tls-key-file", keys["scheduler.pem"]]
    sched = start_scheduler(tmp_path, "--synthetic-workers", "1", *tls)
    try:
        port = sched.info["grpc_port"]
        assert _generate(port, TlsClient(keys["scheduler.crt"])) == want
        with pytest.raises(grpc.RpcError) as info:
            _generate(port)  # clear text to a TLS port
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:  # a CA that did not sign it
            _generate(port, TlsClient(keys["client.crt"]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        _terminate(sched)

    mutual = start_scheduler(tmp_path, "--synthetic-workers", "1", *tls,
                             "--tls-client-ca-file", keys["client.crt"])  # fmt: skip
    try:
        port = mutual.info["grpc_port"]
        ca = keys["scheduler.crt"]
        assert _generate(port, TlsClient(ca, keys["client.crt"], keys["client.pem"])) == want
        with pytest.raises(grpc.RpcError) as info:  # no client certificate
            _generate(port, TlsClient(ca))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        _terminate(mutual)


def test_nothing_listens_or_connects_beyond_loopback_in_clear_without_the_flag(
    tmp_path: Path, keys: dict[str, str]
) -> None:
    tls = TlsServer(keys["scheduler.crt"], keys["scheduler.pem"])
    step = CurveClient.from_files(keys["workers.key"])
    with pytest.raises(InvalidArgument, match=r"host 0\.0\.0\.0 is beyond loopback: set tls"):
        ProcessConfig(host="0.0.0.0", synthetic_workers=1)
    for ok in ({"tls": tls}, {"insecure_remote": True}):
        assert ProcessConfig(host="0.0.0.0", synthetic_workers=1, **ok).host == "0.0.0.0"
    remote = ("tcp://127.0.0.1:9500", "tcp://worker-1:9500")
    with pytest.raises(InvalidArgument, match="worker tcp://worker-1:9500 is beyond loopback"):
        ProcessConfig(workers=remote)
    for ok_step in ({"step_curve": step}, {"insecure_remote": True}):
        assert ProcessConfig(workers=remote, **ok_step).workers == remote
    assert ProcessConfig(workers=("tcp://[::1]:9500", "ipc:///tmp/w.sock")).num_workers == 2

    for endpoint in ("tcp://0.0.0.0:9500", "tcp://*:9500", "tcp://10.0.0.5:9500"):
        with pytest.raises(InvalidArgument, match="beyond loopback: set step_curve_secret"):
            check_worker_listen(endpoint, None, False)
        check_worker_listen(endpoint, None, True)
    for endpoint in ("tcp://127.0.0.1:0", "tcp://localhost:1", "ipc:///tmp/w.sock"):
        check_worker_listen(endpoint, None, False)

    # the commands: a usage error (exit 2) naming what to set
    done = _run_scheduler("--host", "0.0.0.0", "--synthetic-workers", "1")
    assert done.returncode == 2 and "set tls_cert_file and tls_key_file" in done.stderr
    done = _run_scheduler("--synthetic-workers", "1", "--tls-cert-file", keys["scheduler.crt"])
    assert done.returncode == 2 and "tls_cert_file and tls_key_file go together" in done.stderr
    synthetic = subprocess.run(
        [sys.executable, "-m", "scheduler.synthetic", "--bind", "tcp://0.0.0.0:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert synthetic.returncode == 2 and "set step_curve_secret_key_file" in synthetic.stderr
    worker = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "worker", "--rank", "0", "--world-size", "1",
         "--listen", "tcp://0.0.0.0:0", "--dist-init", "tcp://127.0.0.1:1",
         "--model-file", str(tmp_path / "m.safetensors"), "--write-random-model-seed", "7"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode == 2 and "set step_curve_secret_key_file" in worker.stderr
    assert not (tmp_path / "m.safetensors").exists()  # refused before any start-up work
