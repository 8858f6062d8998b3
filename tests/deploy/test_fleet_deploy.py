"""deploy/docker-compose.fleet.yml and deploy/k8s/: two kvserver hosts in one fleet on Valkey,
checked against the real CLI and configuration (no Docker engine or Kubernetes runs here, so
this is what validates them): every daemon command parses and loads into a valid
DaemonConfig with its cluster settings, the URLs point at the Valkey service, host ids and
advertised addresses are per host, and the k8s DaemonSet shares what co-location needs
(host network and IPC, the node's /dev/shm, one uid) with the vLLM pod, whose connector
config is one the plug-in accepts. Security (tests/deploy/test_fleet_keys.py): the keys the
files make, where they are mounted, and the daemons' and clients' flags work together on a
real daemon."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserver.cli import build_parser
from kvserver.daemon.config import DaemonConfig
from kvserver.token_file import make_token_file, read_token_file

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "deploy" / "docker-compose.fleet.yml"
K8S = ROOT / "deploy" / "k8s"


def daemon_config(argv: list[str], env: dict[str, str] | None = None) -> DaemonConfig:
    """The DaemonConfig ``kvserver <argv>`` would run with (the real parser and loader)."""
    args = build_parser().parse_args(argv)
    assert args.command == "start"
    names = set(DaemonConfig.__dataclass_fields__)
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return DaemonConfig.load(config_file=args.config, env=env or {}, overrides=overrides)


# ----------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(FLEET.read_text())
    return doc


def test_compose_runs_two_hosts_with_an_engine_each_and_valkey(compose: dict[str, Any]) -> None:
    services = compose["services"]
    roles = ("kvserver", "worker", "scheduler")
    assert set(services) == {"keys", "valkey", *(f"{r}-{h}" for r in roles for h in "ab")}
    assert services["valkey"]["image"].startswith("valkey/valkey:")
    for h in "ab":
        assert services[f"worker-{h}"]["command"][0] == "worker"
        assert f"tcp://kvserver-{h}:9471" in services[f"worker-{h}"]["command"]
        assert f"tcp://kvserver-{h}:9471" in services[f"scheduler-{h}"]["command"]
        depends = services[f"kvserver-{h}"]["depends_on"]
        assert depends["valkey"]["condition"] == "service_healthy"


@pytest.mark.parametrize("host", ["a", "b"])
def test_each_compose_daemon_is_a_fleet_member(compose: dict[str, Any], host: str) -> None:
    svc = compose["services"][f"kvserver-{host}"]
    cfg = daemon_config([str(a) for a in svc["command"]])
    cc = cfg.cluster_config()
    assert cc is not None
    ((redis_host, redis_port),) = cc.target().nodes
    assert redis_host == "valkey" and redis_port == 6379
    assert cfg.host_id == f"host-{host}"
    assert cfg.advertised_host == f"kvserver-{host}" == svc["hostname"]
    # the fleet's token: the file the keys service makes, one for every host
    assert svc["environment"] == {"KVSERVER_AUTH_TOKEN_FILE": "/keys/auth.token"}


def test_compose_hosts_publish_distinct_ports(compose: dict[str, Any]) -> None:
    published = [p.split(":")[0] for s in compose["services"].values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)) == 10


# ----------------------------------------------------------------------------- kubernetes


def load_k8s() -> dict[tuple[str, str], dict[str, Any]]:
    """Every document of deploy/k8s/*.yaml by (kind, name)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    return load_k8s()


def test_every_object_is_in_the_kvserver_namespace(k8s: dict[tuple[str, str], Any]) -> None:
    assert set(k8s) == {
        ("Namespace", "kvserver"), ("Deployment", "valkey"), ("Service", "valkey"),
        ("ConfigMap", "kvserver-config"), ("DaemonSet", "kvserver"),
        ("Service", "kvserver-local"), ("Pod", "vllm-llama-8b"),
    }  # fmt: skip
    for (kind, _), doc in k8s.items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == "kvserver"


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def test_the_daemonset_runs_a_fleet_member_per_node(
    k8s: dict[tuple[str, str], Any], tmp_path: Path
) -> None:
    ds = k8s[("DaemonSet", "kvserver")]["spec"]["template"]["spec"]
    (c,) = ds["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    # the fleet's token: a file of the kvserver-auth Secret (deploy/k8s/make-keys.sh makes it)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in ds["volumes"]}
    token_file = env["KVSERVER_AUTH_TOKEN_FILE"]["value"]
    assert token_file == f"{mounts['auth']}/auth.token"
    assert volumes["auth"]["secret"]["secretName"] == "kvserver-auth"
    # the ConfigMap's TOML, mounted where --config reads it
    toml = k8s[("ConfigMap", "kvserver-config")]["data"]["kvserver.toml"]
    assert volumes["config"]["configMap"]["name"] == "kvserver-config"
    (tmp_path / "kvserver.toml").write_text(toml)
    argv = [_expand(a, {"NODE_NAME": "gpu-node-3", "NODE_IP": "10.0.0.3"}) for a in c["args"]]
    assert argv[argv.index("--config") + 1] == f"{mounts['config']}/kvserver.toml"
    argv[argv.index("--config") + 1] = str(tmp_path / "kvserver.toml")
    local_token = make_token_file(str(tmp_path), "auth")
    cfg = daemon_config(argv, env={"KVSERVER_AUTH_TOKEN_FILE": local_token})
    token = read_token_file(local_token)
    assert (cfg.host_id, cfg.advertised_host, cfg.auth_token) == ("gpu-node-3", "10.0.0.3", token)
    cc = cfg.cluster_config()
    assert cc is not None
    ((redis_host, redis_port),) = cc.target().nodes
    valkey = k8s[("Service", "valkey")]["spec"]
    assert redis_host == "valkey.kvserver.svc.cluster.local"
    assert redis_port == valkey["ports"][0]["port"]
    # co-location: node network and IPC, the node's /dev/shm, a fixed uid
    assert ds["hostNetwork"] is True and ds["hostIPC"] is True
    assert ds["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert mounts["shm"] == "/dev/shm" and volumes["shm"]["hostPath"]["path"] == "/dev/shm"
    assert cfg.ssd_dir.startswith(mounts["ssd"] + "/")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["grpc"], ports["zmq"], ports["events"], ports["metrics"]) == (
        cfg.grpc_port, cfg.zmq_port, cfg.pub_port, cfg.metrics_port,
    )  # fmt: skip
    # the peer stream: a fixed port, TLS (tls_cert_file), its certificate's name checked
    assert ports["peer-stream"] == cfg.peer_stream_port > 0 and cfg.tls_cert_file
    assert cfg.peer_tls_server_name == "kvserver"
    assert ds["terminationGracePeriodSeconds"] >= 30
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert "kvserver status" in probe and f"--auth-token-file {token_file}" in probe


def test_the_node_local_service_routes_to_the_own_node(k8s: dict[tuple[str, str], Any]) -> None:
    svc = k8s[("Service", "kvserver-local")]["spec"]
    ds = k8s[("DaemonSet", "kvserver")]["spec"]
    assert svc["internalTrafficPolicy"] == "Local"
    assert svc["selector"].items() <= ds["template"]["metadata"]["labels"].items()
    assert {p["port"] for p in svc["ports"]} == {9470, 9471, 9472, 9473}


def test_the_vllm_pod_shares_what_co_location_needs_and_its_connector_config_is_valid(
    k8s: dict[tuple[str, str], Any],
) -> None:
    pod = k8s[("Pod", "vllm-llama-8b")]["spec"]
    ds = k8s[("DaemonSet", "kvserver")]["spec"]["template"]["spec"]
    for key in ("hostNetwork", "hostIPC", "dnsPolicy", "nodeSelector"):
        assert pod[key] == ds[key], key
    assert pod["securityContext"]["runAsUser"] == ds["securityContext"]["runAsUser"]
    (c,) = pod["containers"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {v["name"]: v for v in pod["volumes"]}["shm"]["hostPath"]["path"] == "/dev/shm"
    # the command as the shell runs it, the secret substituted
    (script,) = c["args"]
    argv = shlex.split(script)
    assert argv[:3] == ["exec", "vllm", "serve"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVServerConnector"
    assert config["kv_connector_module_path"] == "kvserver_vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    from kvserver_vllm import config as plugin_config

    assert set(extra) <= plugin_config._KEYS
    assert extra["address"] == "tcp://127.0.0.1:9471" and "auth_token" not in extra
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert extra["auth_token_file"] == f"{mounts['keys']}/auth.token"  # the engine keys' token
    env = {e["name"]: e for e in c["env"]}
    assert "PYTHONHASHSEED" in env


def test_the_vllm_pods_command_parses_with_vllms_own_parser(
    k8s: dict[tuple[str, str], Any],
) -> None:
    """``vllm serve``'s flags in the pod spec exist in the installed vLLM and take the values
    given (a flag vLLM renamed or removed would stop the pod at start): its own parser, the
    one ``vllm serve`` runs; the connector's settings reach it intact."""
    from tests.vllm_plugin.vllm_env import require_vllm

    require_vllm()
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    (c,) = k8s[("Pod", "vllm-llama-8b")]["spec"]["containers"]
    argv = shlex.split(c["args"][0])
    assert argv[:3] == ["exec", "vllm", "serve"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.model_tag == "meta-llama/Llama-3.1-8B-Instruct" and args.port == 8000
    assert args.prefix_caching_hash_algo == "sha256_cbor"
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role) == ("KVServerConnector", "kv_both")
    assert kv.kv_connector_module_path == "kvserver_vllm.connector"
    assert kv.kv_load_failure_policy == "recompute"
    assert kv.kv_connector_extra_config["address"] == "tcp://127.0.0.1:9471"
