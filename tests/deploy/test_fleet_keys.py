"""The fleet deployments' transport security, for real (docs/security.md, docs/deploy.md):
the compose file's `keys` service and deploy/k8s/make-keys.sh make the keys with the real
``kvserver keys``; the files land where the daemons' and the clients' flags say (compose: the
`keys` volume; Kubernetes: the Secrets and ConfigMap the script creates, mounted where the
manifests mount them); a real daemon started with the daemon's security settings (on
loopback, with the settings a daemon beyond loopback must have: no ``insecure_remote``) serves
the scheduler's, the worker's and the vLLM connector's CURVE options and the health probe's
TLS options. No Docker engine or kubectl here: the paths are mapped onto a temporary
directory, and kubectl is a recorder of the script's calls.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserver.cli import build_parser
from kvserver.client import KVClient
from kvserver.crypto import ClientSecurity
from kvserver.daemon.config import DaemonConfig
from kvserver.grpc_client import GrpcClient
from kvserver.token_file import client_auth_token, read_token_file
from scheduler.cli import process_config
from step_protocol.security import check_worker_listen, worker_curve
from tests.deploy.test_fleet_deploy import FLEET, K8S, daemon_config, load_k8s
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

TOKEN = "fleet-keys-test-token-0123456789"
SECURITY_FIELDS = ("curve_secret_key_file", "curve_clients_dir", "tls_cert_file", "tls_key_file")


def _bin(tmp_path: Path) -> Path:
    """A directory with ``kvserver`` (this tree's CLI) and a recording ``kubectl``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kvserver").write_text(f'#!/bin/sh\nexec {sys.executable} -m kvserver.cli "$@"\n')
    (bin_dir / "kubectl").write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(tmp_path / 'kubectl.log')!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def _env(bin_dir: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _serve(tmp_path: Path, cfg: DaemonConfig, token: str = TOKEN) -> DaemonProc:
    """A real daemon on loopback with ``cfg``'s security settings and ``token``."""
    flags = [a for f in SECURITY_FIELDS for a in ("--" + f.replace("_", "-"), getattr(cfg, f))]
    return start_daemon(tmp_path / "daemon", "--auth-token", token, *flags)


def _assert_clients_served(daemon: DaemonProc, zmq_clients: dict[str, ClientSecurity],
                           probe: ClientSecurity, token: str = TOKEN) -> None:  # fmt: skip
    """Every ZMQ client's options get a hello (CURVE, its key admitted); the probe's gRPC
    options get the daemon's stats (TLS); every request with ``token``."""
    for name, security in zmq_clients.items():
        curve = security.curve()
        assert curve is not None, name
        with KVClient(daemon.zmq_address, curve=curve, auth_token=token, colocated=False,
                      timeout=5) as kv:  # fmt: skip
            assert kv.hello()["sid"], name
    tls = probe.tls()
    assert tls is not None
    with GrpcClient(daemon.grpc_address, tls=tls, auth_token=token) as g:
        assert g.stats().server_version


# ----------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(FLEET.read_text())
    return doc


def test_compose_daemons_use_curve_and_tls_and_clients_their_keys(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    services = compose["services"]
    keys_svc = services["keys"]
    (script,) = keys_svc["command"]
    assert keys_svc["volumes"] == ["keys:/keys"] and "keys" in compose["volumes"]
    # the keys service, run for real with /keys mapped onto a temporary directory
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    remap = script.replace("/keys", str(keys_dir))
    bin_dir = _bin(tmp_path)
    for _ in range(2):  # a second `up` keeps the keys
        subprocess.run(["/bin/sh", "-c", remap], env=_env(bin_dir), check=True, timeout=120)

    def local(path: str) -> str:
        assert path.startswith("/keys/"), path
        return str(keys_dir / path.removeprefix("/keys/"))

    parser = build_parser()
    token = (keys_dir / "auth.token").read_text().strip()  # one for the fleet
    assert (keys_dir / "auth.token").stat().st_mode & 0o077 == 0
    for host in "ab":
        daemon = services[f"kvserver-{host}"]
        assert "--insecure-remote" not in daemon["command"]
        token_file = local(daemon["environment"]["KVSERVER_AUTH_TOKEN_FILE"])
        token_env = {"KVSERVER_AUTH_TOKEN_FILE": token_file}
        cfg = daemon_config([str(a) for a in daemon["command"]], env=token_env)
        assert not cfg.insecure_remote and all(getattr(cfg, f) for f in SECURITY_FIELDS)
        assert cfg.auth_token == token
        assert daemon["depends_on"]["keys"]["condition"] == "service_completed_successfully"
        for role in ("kvserver", "worker", "scheduler"):
            assert "keys:/keys:ro" in services[f"{role}-{host}"]["volumes"], role
        # the clients' options, parsed by the real CLI, with the token file from the environment
        clients: dict[str, ClientSecurity] = {}
        for role in ("worker", "scheduler"):
            svc = services[f"{role}-{host}"]
            assert svc["environment"] == daemon["environment"], role
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("KVSERVER_AUTH_TOKEN_FILE", token_file)
                args = build_parser().parse_args([str(a) for a in svc["command"]])
            assert client_auth_token(args) == token, role
            assert args.kvserver == f"tcp://kvserver-{host}:9471"
            clients[role] = ClientSecurity(
                local(args.curve_server_key_file), local(args.curve_secret_key_file)
            )

        # the engine listens beyond its containers with TLS (front door) and CURVE (steps)
        def argv(service: str) -> list[str]:
            return [local(a) if a.startswith("/keys/") else str(a)
                    for a in services[service]["command"]]  # fmt: skip

        sched = process_config(parser.parse_args(argv(f"scheduler-{host}")))
        assert sched.host == "0.0.0.0" and sched.tls is not None and sched.step_curve
        # the front door's token: the keys service's engine.token, not the daemons' token
        assert sched.engine_auth_token == (keys_dir / "engine.token").read_text().strip()
        assert sched.engine_auth_token != token
        assert (keys_dir / "engine.token").stat().st_mode & 0o077 == 0
        worker_args = parser.parse_args(argv(f"worker-{host}"))
        step = worker_curve(worker_args)
        assert step is not None and step.public_key == sched.step_curve.server_key
        check_worker_listen(worker_args.listen, step, worker_args.insecure_remote)
        assert sorted(os.listdir(step.clients_dir)) == ["engine.key"]
        health = daemon["healthcheck"]["test"]
        assert health[:3] == ["CMD", "kvserver", "status"]
        probe = parser.parse_args(health[2:])
        assert probe.auth_token_file == "/keys/auth.token"
        served = DaemonConfig(**{f: local(getattr(cfg, f)) for f in SECURITY_FIELDS})
        proc = _serve(tmp_path / host, served, token)
        try:
            ca = ClientSecurity(tls_ca_file=local(probe.tls_ca_file))
            _assert_clients_served(proc, clients, ca, token)
        finally:
            assert proc.terminate() == 0, proc.log()


# ----------------------------------------------------------------------------- kubernetes


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    return load_k8s()


@pytest.fixture(scope="module")
def made(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[tuple[str, str], dict[str, str]]]:
    """deploy/k8s/make-keys.sh run for real: {(kind, name): {key: local file}} it stored."""
    tmp = tmp_path_factory.mktemp("k8s-keys")
    subprocess.run([str(K8S / "make-keys.sh"), str(tmp / "keys")], env=_env(_bin(tmp)),
                   check=True, timeout=120)  # fmt: skip
    stored: dict[tuple[str, str], dict[str, str]] = {}
    for line in (tmp / "kubectl.log").read_text().splitlines():
        argv = json.loads(line)
        assert argv[:3] == ["-n", "kvserver", "create"], argv
        kind = {"secret": "Secret", "configmap": "ConfigMap"}[argv[3]]
        name = argv[5] if kind == "Secret" else argv[4]
        files = [a.removeprefix("--from-file=") for a in argv if a.startswith("--from-file=")]
        stored[(kind, name)] = {Path(f).name: f for f in files}
    yield stored


def _mounted(spec: dict[str, Any], made: dict[tuple[str, str], dict[str, str]],
             tmp_path: Path) -> dict[str, str]:  # fmt: skip
    """{path in the container: local file} for every Secret / ConfigMap the script made and
    ``spec``'s (only) container mounts; each mounted directory also gets a local copy."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    (container,) = spec["containers"]
    out: dict[str, str] = {}
    for mount in container["volumeMounts"]:
        vol = volumes[mount["name"]]
        if "secret" in vol:
            source = ("Secret", vol["secret"]["secretName"])
        elif "configMap" in vol and ("ConfigMap", vol["configMap"]["name"]) in made:
            source = ("ConfigMap", vol["configMap"]["name"])
        else:
            continue
        assert mount.get("readOnly") is True, mount
        copy = tmp_path / mount["name"]
        copy.mkdir(parents=True)
        mode = vol.get("secret", {}).get("defaultMode", 0o644)  # a ConfigMap's default
        for key, path in made[source].items():
            (copy / key).write_bytes(Path(path).read_bytes())
            (copy / key).chmod(mode)
            out[f"{mount['mountPath']}/{key}"] = str(copy / key)
        out[mount["mountPath"]] = str(copy)
    return out


def test_k8s_keys_are_made_mounted_and_work(
    k8s: dict[tuple[str, str], Any], made: dict[tuple[str, str], dict[str, str]], tmp_path: Path
) -> None:
    ds = k8s[("DaemonSet", "kvserver")]["spec"]["template"]["spec"]
    daemon_files = _mounted(ds, made, tmp_path / "daemonset")
    toml = k8s[("ConfigMap", "kvserver-config")]["data"]["kvserver.toml"]
    (tmp_path / "kvserver.toml").write_text(toml)
    (c,) = ds["containers"]
    # the fleet's token: made by the script (0600), stored in the kvserver-auth Secret, read
    # by the daemon from the mounted file (0440, the daemon's group)
    made_token = made[("Secret", "kvserver-auth")]["auth.token"]
    assert Path(made_token).stat().st_mode & 0o077 == 0
    token = read_token_file(made_token)
    env = {e["name"]: e.get("value") for e in c["env"]}
    token_env = {"KVSERVER_AUTH_TOKEN_FILE": daemon_files[env["KVSERVER_AUTH_TOKEN_FILE"]]}
    cfg = daemon_config(["start", "--config", str(tmp_path / "kvserver.toml")], env=token_env)
    assert not cfg.insecure_remote and cfg.host == "0.0.0.0" and cfg.auth_token == token
    local = {f: daemon_files[getattr(cfg, f)] for f in SECURITY_FIELDS}  # each one mounted
    # the clients dir admits the peers (the fleet's own pair) and the engines
    assert sorted(os.listdir(local["curve_clients_dir"])) == ["server.key", "vllm.key"]

    pod = k8s[("Pod", "vllm-llama-8b")]["spec"]
    pod_files = _mounted(pod, made, tmp_path / "pod")
    assert pod["securityContext"]["fsGroup"] == ds["securityContext"]["fsGroup"]
    (script,) = pod["containers"][0]["args"]
    argv = shlex.split(script)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    engine = ClientSecurity(pod_files[extra["curve_server_key_file"]],
                            pod_files[extra["curve_secret_key_file"]])  # fmt: skip
    assert read_token_file(pod_files[extra["auth_token_file"]]) == token  # as the plug-in reads it

    probe_argv = shlex.split(c["readinessProbe"]["exec"]["command"][2])
    probe = build_parser().parse_args(probe_argv[1:])
    assert probe.server == "127.0.0.1:9470"
    assert read_token_file(daemon_files[probe.auth_token_file]) == token
    proc = _serve(tmp_path, DaemonConfig(**local), token)
    try:
        _assert_clients_served(
            proc,
            {"vllm": engine},
            ClientSecurity(tls_ca_file=daemon_files[probe.tls_ca_file]),
            token,
        )
        # a router on another node dials a node IP and checks the certificate's name; it
        # reads the token from the engine keys like the pods
        ca_file = made[("Secret", "kvserver-engine-keys")]["server.crt"]
        assert read_token_file(made[("Secret", "kvserver-engine-keys")]["auth.token"]) == token
        router = ClientSecurity(tls_ca_file=ca_file, tls_server_name="kvserver").tls()
        with GrpcClient(proc.grpc_address, tls=router, auth_token=token) as g:
            assert g.stats().server_version
    finally:
        assert proc.terminate() == 0, proc.log()
