"""End to end over CURVE + TLS: a daemon listening beyond loopback (``--host 0.0.0.0``, which
it refuses without CURVE and TLS) with a CURVE clients list, gRPC TLS and a token; a real
scheduler and a real worker process given the keys by their flags (docs/security.md, "Client
options") load and store prompt KV through it; an engine with a wrong key gets a clear error
in its log, keeps computing prompts itself, and the daemon keeps serving everyone else;
``kvserver status`` reaches it over TLS only with the CA.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.crypto import CurveClient, TlsClient
from kvserver.grpc_client import GrpcClient
from tests.kvserver.daemon.test_transport_security import keys
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler
from tests.support.cluster import start_tp_workers
from tests.support.connector import PATIENT_ARGS
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

TOKEN = "e2e-secure-token-0123456789"
PROMPT = [(7 * i + 3) % 500 for i in range(64)]  # 4 blocks of 16


@dataclass(frozen=True)
class Keys:
    server_key: str  # the daemon's CURVE public key: every client gets it
    engine_secret: str  # a client pair listed in the daemon's clients directory
    stranger_secret: str  # a client pair that is not
    wrong_server_key: str  # some other daemon's public key
    ca: str  # the daemon's TLS certificate (self-signed: its own CA)


@dataclass(frozen=True)
class Secured:
    daemon: DaemonProc
    keys: Keys


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    tmp = tmp_path_factory.mktemp("secure")
    server_key, server_secret = keys(tmp / "server", "curve", "server")
    clients = tmp / "clients"
    _, engine_secret = keys(clients, "curve", "engine")
    _, stranger_secret = keys(tmp / "elsewhere", "curve", "stranger")
    wrong_server_key, _ = keys(tmp / "other", "curve", "server")
    cert, key = keys(tmp / "tls", "tls", "server", "--host", "127.0.0.1")
    # the peer tier's own client pair must be listed too: the daemon's public key
    (clients / "server.key").write_text(Path(server_key).read_text())
    daemon = start_daemon(
        tmp / "daemon",
        "--host", "0.0.0.0", "--dram", "16MiB", "--auth-token", TOKEN,
        "--curve-secret-key-file", server_secret, "--curve-clients-dir", str(clients),
        "--tls-cert-file", cert, "--tls-key-file", key,
    )  # fmt: skip
    try:
        yield Secured(daemon, Keys(server_key, engine_secret, stranger_secret,
                                   wrong_server_key, cert))  # fmt: skip
    finally:
        assert daemon.terminate() == 0, daemon.log()


def _engine(
    tmp_path: Path, daemon: DaemonProc, flags: list[str], tag: str
) -> tuple[Proc, list[Proc]]:
    """A scheduler and one worker, both using the daemon with ``flags``."""
    workers = start_tp_workers(tmp_path, daemon.zmq_address, world=1, tag=tag, extra=flags)
    try:
        sched = start_scheduler(
            tmp_path, "--workers", workers[0].info["endpoint"], "--model", "tiny-secure",
            "--num-gpu-blocks", "16", "--block-size", "16", "--no-prefix-caching",
            "--kvserver", daemon.zmq_address, *PATIENT_ARGS, "--chunk-blocks", "1", *flags,
        )  # fmt: skip
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return sched, workers


def _stop(sched: Proc, workers: list[Proc]) -> str:
    """Stop the engine; the scheduler's and the workers' logs."""
    sched.terminate()
    for w in workers:
        w.terminate()
    return sched.log() + "".join(w.log() for w in workers)


def _good_flags(k: Keys) -> list[str]:
    return ["--auth-token", TOKEN, "--curve-server-key-file", k.server_key,
            "--curve-secret-key-file", k.engine_secret]  # fmt: skip


def _daemon_serves(s: Secured) -> bool:
    """A listed CURVE client with the token is served (a hello and a stats call)."""
    curve = CurveClient.from_files(s.keys.server_key, s.keys.engine_secret)
    with KVClient(s.daemon.zmq_address, curve=curve, auth_token=TOKEN, colocated=False) as kv:
        kv.hello()
        return isinstance(kv.stats(), dict)


def test_an_engine_with_the_keys_stores_and_loads_over_curve(
    secured: Secured, tmp_path: Path
) -> None:
    sched, workers = _engine(tmp_path, secured.daemon, _good_flags(secured.keys), "good")
    try:
        with EngineClient(sched.info["grpc_port"]) as c:
            first = c.generate(PROMPT, 4)
            assert first[0].usage.kvserver_tokens == 0
            again = c.generate(PROMPT, 4)  # no GPU prefix cache: it comes from kvserver
        assert again[0].usage.kvserver_tokens == 48  # 3 full blocks stored before the last
        assert output_tokens(again) == output_tokens(first)
    finally:
        log = _stop(sched, workers)
    assert "CURVE" not in log and "unreachable" not in log, log
    with GrpcClient(secured.daemon.grpc_address, tls=TlsClient(secured.keys.ca),
                    auth_token=TOKEN) as g:  # fmt: skip
        ns = [n for n in g.list_namespaces() if n.spec.model == "tiny-secure"]
        assert ns and ns[0].namespace_id


@pytest.mark.parametrize(
    "case, needle",
    [
        ("unlisted client key", "refused this client's CURVE key"),
        ("wrong daemon key", "curve_server_key_file is not the daemon's public key"),
        ("no CURVE", "requires CURVE"),
    ],
)
def test_an_engine_with_a_wrong_key_says_why_computes_and_others_are_served(
    secured: Secured, tmp_path: Path, case: str, needle: str
) -> None:
    k = secured.keys
    flags = {
        "unlisted client key": ["--curve-server-key-file", k.server_key,
                                "--curve-secret-key-file", k.stranger_secret],
        "wrong daemon key": ["--curve-server-key-file", k.wrong_server_key],
        "no CURVE": [],
    }[case]  # fmt: skip
    sched, workers = _engine(tmp_path, secured.daemon, ["--auth-token", TOKEN, *flags], "bad")
    try:
        with EngineClient(sched.info["grpc_port"]) as c:
            msgs = c.generate(PROMPT, 4)
            again = c.generate(PROMPT, 4)
        assert len(output_tokens(msgs)) == 4 and output_tokens(again) == output_tokens(msgs)
        assert again[0].usage.kvserver_tokens == 0  # computed: nothing reached the daemon
        assert _daemon_serves(secured)  # meanwhile, everyone else is served
    finally:
        log = _stop(sched, workers)
    assert needle in log, log
    assert _daemon_serves(secured)


def _status(daemon: DaemonProc, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "status", "--server", daemon.grpc_address,
         "--auth-token", TOKEN, "--timeout", "5", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_kvserver_status_needs_the_ca_over_tls(secured: Secured, tmp_path: Path) -> None:
    ok = _status(secured.daemon, "--tls-ca-file", secured.keys.ca)
    assert ok.returncode == 0 and "kvserver" in ok.stdout, ok.stderr
    plain = _status(secured.daemon)
    assert plain.returncode == 1 and "TLS" in plain.stderr, plain.stderr
    other_ca, _ = keys(tmp_path, "tls", "other", "--host", "127.0.0.1")
    wrong = _status(secured.daemon, "--tls-ca-file", other_ca)
    assert wrong.returncode == 1 and "TLS" in wrong.stderr, wrong.stderr
    missing = _status(secured.daemon, "--tls-ca-file", str(tmp_path / "absent.crt"))
    assert missing.returncode == 2 and "absent.crt" in missing.stderr, missing.stderr
