"""The single-host deploy/docker-compose.yml's and deploy/Dockerfile's transport security, for
real (docs/security.md, docs/deploy.md): the compose file's `keys` service makes the keys with
the real ``kvserver keys`` (a second `up` keeps them); the daemon's own command, localized
(tests/deploy/compose.py), starts a real daemon that needs CURVE, TLS and the token; the
workers' and the scheduler's options (parsed by the real CLI) and the healthcheck's are served,
and a client without them is refused. The image's default command makes its keys in /keys on
its first start and keeps them. No Docker engine here: volumes are temporary directories.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from benchmarks.harness.proc import start_process
from kvserver.cli import build_parser
from kvserver.client import KVClient
from kvserver.crypto import ClientSecurity, TlsClient, endpoint_is_local
from kvserver.errors import KVServerError
from kvserver.grpc_client import GrpcClient
from kvserver.token_file import client_auth_token
from scheduler.cli import process_config
from step_protocol.security import check_worker_listen, worker_curve
from tests.deploy.compose import ROOT, flag, listen_ports, load_compose, localize, services
from tests.deploy.test_fleet_deploy import daemon_config
from tests.deploy.test_fleet_keys import SECURITY_FIELDS, _assert_clients_served
from tests.scheduler.procs import EngineClient
from tests.support.daemon import DaemonProc, start_daemon
from tests.support.ports import free_port as _free_port

pytestmark = pytest.mark.multiprocess

CLIENTS = ("worker-0", "worker-1", "scheduler")
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def run_keys(script: str, tmp_path: Path) -> None:
    """The compose file's `keys` script, as the keys container runs it (kvserver on PATH)."""
    bin_dir = tmp_path / "keys-bin"
    if not bin_dir.exists():
        bin_dir.mkdir(parents=True)
        shim = bin_dir / "kvserver"
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m kvserver.cli "$@"\n')
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["/bin/sh", "-c", script], env=env, check=True, timeout=120,
                   capture_output=True)  # fmt: skip


def test_compose_keys_make_a_secure_daemon_that_serves_its_clients(tmp_path: Path) -> None:
    doc = load_compose()
    svcs = services(doc)
    keys_svc = svcs["keys"]
    assert keys_svc.volumes == {"/keys": "keys"} and "keys" in doc["volumes"]
    ports = {(s.name, p): _free_port() for s in svcs.values() for p in listen_ports(s)}
    cmds = localize(doc, ports, tmp_path)
    for volume in doc["volumes"]:
        (tmp_path / volume).mkdir()
    keys_dir = tmp_path / "keys"
    run_keys(cmds["keys"][0], tmp_path)
    made = {p.name: p.read_bytes() for p in keys_dir.rglob("*") if p.is_file()}
    run_keys(cmds["keys"][0], tmp_path)  # a second `up` keeps every key
    assert {p.name: p.read_bytes() for p in keys_dir.rglob("*") if p.is_file()} == made
    assert sorted(os.listdir(keys_dir / "clients")) == ["engine.key"]
    for secret in ("server.key_secret", "engine.key_secret", "server.pem", "auth.token",
                   "engine.token"):  # fmt: skip
        assert (keys_dir / secret).stat().st_mode & 0o077 == 0, secret

    # the daemon: beyond its container, with CURVE + TLS + the token from the volume
    daemon = svcs["kvserver"]
    assert flag(daemon.command, "--host") == "0.0.0.0"
    assert "--insecure-remote" not in daemon.command
    assert daemon.volumes["/keys"] == "keys" and "keys:/keys:ro" in daemon.raw["volumes"]
    assert daemon.raw["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    cfg = daemon_config(cmds["kvserver"])
    assert all(getattr(cfg, f) for f in SECURITY_FIELDS) and not cfg.insecure_remote
    token = (keys_dir / "auth.token").read_text().strip()
    assert cfg.auth_token == token and len(token) >= 32
    # the same settings beyond loopback are accepted without --insecure-remote
    assert daemon_config([*cmds["kvserver"], "--host", "0.0.0.0"]).host == "0.0.0.0"

    # the daemon's own localized command, for real
    argv = [sys.executable, "-m", "kvserver.cli", *cmds["kvserver"]]
    ready = Path(flag(cmds["kvserver"], "--ready-file"))
    proc, info = start_process(argv, ready, tmp_path / "daemon.log", name="daemon")
    served = DaemonProc(proc, info, tmp_path / "daemon.log", argv)
    try:
        parser = build_parser()
        clients: dict[str, ClientSecurity] = {}
        for name in CLIENTS:
            args = parser.parse_args(cmds[name])
            assert args.kvserver == served.zmq_address, name
            assert client_auth_token(args) == token, name
            assert "keys:/keys:ro" in svcs[name].raw["volumes"], name
            # the daemon's ZMQ clients: their --curve-* (the scheduler's --tls-* are its own)
            clients[name] = ClientSecurity(args.curve_server_key_file, args.curve_secret_key_file)
        health = svcs["kvserver"].raw["healthcheck"]["test"]
        assert health[:3] == ["CMD", "kvserver", "status"]
        probe_argv = localize({"services": {"kvserver": {**daemon.raw, "command": health[1:]}}},
                              ports, tmp_path)["kvserver"]  # fmt: skip
        probe = parser.parse_args(probe_argv[1:])
        assert client_auth_token(probe) == token
        _assert_clients_served(served, clients, ClientSecurity.from_mapping(probe), token)
        # without the keys or the token: refused
        with (
            pytest.raises(KVServerError, match="CURVE"),
            KVClient(served.zmq_address, auth_token=token, colocated=False, timeout=5) as kv,
        ):
            kv.hello()
        tls = ClientSecurity.from_mapping(probe).tls()
        with (
            pytest.raises(KVServerError),
            GrpcClient(served.grpc_address, tls=tls, auth_token="x" * 32, timeout=5) as g,
        ):
            g.stats()
        _assert_front_door_needs_its_token(cmds["scheduler"], keys_dir, tmp_path)
    finally:
        assert served.terminate() == 0, served.log()


def _assert_front_door_needs_its_token(command: list[str], keys_dir: Path, tmp: Path) -> None:
    """The scheduler's localized command (a synthetic worker in place of the worker services)
    serves Generate over TLS to a client with engine.token (not the daemon's token) and
    refuses one without it: the published port 9480 needs the token."""
    engine_token = (keys_dir / "engine.token").read_text().strip()
    assert engine_token != (keys_dir / "auth.token").read_text().strip()
    assert process_config(build_parser().parse_args(command)).engine_auth_token == engine_token
    dropped = ("--workers", "--step-curve-server-key-file", "--step-curve-secret-key-file")
    kept = [a for i, a in enumerate(command) if a not in dropped and command[i - 1] not in dropped]
    argv = [sys.executable, "-m", "kvserver.cli", *kept, "--synthetic-workers", "1"]
    ready = Path(flag(command, "--ready-file"))
    proc, info = start_process(argv, ready, tmp / "scheduler.log", name="scheduler")
    try:
        tls = TlsClient(str(keys_dir / "scheduler.crt"))
        with EngineClient(info["grpc_port"], tls, auth_token=engine_token) as client:
            assert len(client.generate([1, 2, 3, 4], 2)) == 2
        for wrong in ("", (keys_dir / "auth.token").read_text().strip()):
            with EngineClient(info["grpc_port"], tls, auth_token=wrong) as client:
                with pytest.raises(grpc.RpcError) as err:
                    client.stats()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.terminate()
        assert proc.wait(20) == 0, (tmp / "scheduler.log").read_text()


def dockerfile_cmd() -> list[str]:
    """deploy/Dockerfile's default command (its exec-form ``CMD``)."""
    (line,) = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("CMD ")]
    cmd: list[str] = json.loads(line.removeprefix("CMD "))
    return cmd


def test_dockerfile_default_command_makes_keeps_and_uses_its_keys(tmp_path: Path) -> None:
    """``docker run`` with no arguments: a daemon beyond loopback with CURVE, TLS and a token
    it made in /keys on its first start (the image's volume mount point), the same ones after
    a restart; a client with the copied files is served, one without them refused."""
    cmd = dockerfile_cmd()
    assert cmd[:3] == ["start", "--host", "0.0.0.0"] and "--insecure-remote" not in cmd
    assert flag(cmd, "--keys-dir") == "/keys"
    assert "mkdir -p /data /models /keys" in DOCKERFILE.read_text()
    keys = tmp_path / "keys"
    local = [str(keys) if a == "/keys" else a for a in cmd[3:]]
    cfg = daemon_config([*cmd[:3], *local])  # beyond loopback: accepted, keys made
    assert cfg.host == "0.0.0.0" and not cfg.insecure_remote
    assert all(getattr(cfg, f) for f in SECURITY_FIELDS)
    made = {p.name: p.read_bytes() for p in keys.rglob("*") if p.is_file()}
    assert sorted(made) == sorted(["server.key", "server.key_secret", "client.key",
                                   "client.key_secret", "server.crt", "server.pem",
                                   "auth.token"])  # fmt: skip
    assert sorted(os.listdir(keys / "clients")) == ["client.key"]
    assert (keys / "auth.token").stat().st_mode & 0o077 == 0
    client = ClientSecurity(str(keys / "server.key"), str(keys / "client.key_secret"),
                            tls_ca_file=str(keys / "server.crt"))  # fmt: skip
    token = (keys / "auth.token").read_text().strip()
    for _ in range(2):  # the second start keeps the identity and the token
        proc = start_daemon(tmp_path / "daemon", *local)
        try:
            _assert_clients_served(proc, {"client": client}, client, token)
            with (
                pytest.raises(KVServerError, match="CURVE"),
                KVClient(proc.zmq_address, auth_token=token, colocated=False, timeout=5) as kv,
            ):
                kv.hello()
        finally:
            assert proc.terminate() == 0, proc.log()
        assert {p.name: p.read_bytes() for p in keys.rglob("*") if p.is_file()} == made
    # the settings it fills in are its own: giving one as well is an error
    with pytest.raises(KVServerError, match="keys_dir excludes auth_token"):
        daemon_config([*cmd, "--auth-token", "x" * 32])


def _drop(cmd: list[str], *flags: str) -> list[str]:
    """``cmd`` without ``--flag VALUE`` for each of ``flags``."""
    out: list[str] = []
    skip = False
    for arg in cmd:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


def test_the_engine_listens_beyond_its_containers_only_with_tls_and_curve(
    tmp_path: Path,
) -> None:
    """The scheduler's front door (TLS) and the workers' step channel (CURVE) as the compose
    file configures them, beyond loopback (their own hosts, the key files the `keys` script
    made): accepted by the real CLI's checks; without the key flags: refused. (Served for real
    by tests/deploy/test_local_cluster.py.)"""
    doc = load_compose()
    svcs = services(doc)
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    (script,) = svcs["keys"].command
    run_keys(script.replace("/keys", str(keys_dir)), tmp_path)

    def paths(cmd: list[str]) -> list[str]:
        return [str(keys_dir / a.removeprefix("/keys/")) if a.startswith("/keys/") else a
                for a in cmd]  # fmt: skip

    parser = build_parser()
    engine_key = (keys_dir / "engine.key").read_bytes()
    sched_cmd = svcs["scheduler"].command
    assert flag(sched_cmd, "--host") == "0.0.0.0" and "--insecure-remote" not in sched_cmd
    config = process_config(parser.parse_args(paths(sched_cmd)))
    assert config.tls is not None and config.step_curve is not None
    assert all(not endpoint_is_local(w) for w in config.workers)  # worker-0, worker-1
    for name in ("worker-0", "worker-1"):
        cmd = svcs[name].command
        assert "--insecure-remote" not in cmd
        args = parser.parse_args(paths(cmd))
        curve = worker_curve(args)
        assert curve is not None and not endpoint_is_local(args.listen)
        check_worker_listen(args.listen, curve, args.insecure_remote)
        # the scheduler's step keys are the workers' pair and a key they admit
        assert config.step_curve.server_key == curve.public_key
        assert (Path(curve.clients_dir) / "engine.key").read_bytes() == engine_key
        with pytest.raises(KVServerError, match="beyond loopback"):
            stripped = _drop(cmd, "--step-curve-secret-key-file", "--step-curve-clients-dir")
            bare = parser.parse_args(paths(stripped))
            check_worker_listen(bare.listen, worker_curve(bare), bare.insecure_remote)
    with pytest.raises(KVServerError, match=r"host 0\.0\.0\.0 is beyond loopback"):
        process_config(parser.parse_args(paths(_drop(sched_cmd, "--tls-cert-file",
                                                      "--tls-key-file"))))  # fmt: skip
    with pytest.raises(KVServerError, match="worker tcp://worker-0:9500 is beyond loopback"):
        process_config(parser.parse_args(paths(_drop(
            sched_cmd, "--step-curve-server-key-file", "--step-curve-secret-key-file"
        ))))  # fmt: skip
