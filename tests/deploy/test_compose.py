"""deploy/docker-compose.yml is consistent with itself, with the real CLI and with
deploy/run-local.sh (no Docker engine runs here, so this is what validates it)."""

from __future__ import annotations

import os
import shlex
import subprocess
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

from kvserver.cli import build_parser
from tests.deploy.compose import (
    PORT_FLAGS,
    ROOT,
    RUN_LOCAL,
    Service,
    flag,
    listen_ports,
    load_compose,
    localize,
    services,
)

WORKERS = ("worker-0", "worker-1")


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def svcs(doc: dict[str, Any]) -> dict[str, Service]:
    return services(doc)


def _host_port(addr: str) -> tuple[str, int]:
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def test_services_exist(svcs: dict[str, Service]) -> None:
    assert set(svcs) == {"keys", "kvserver", "scheduler", *WORKERS}
    assert [svcs[n].command[0] for n in ("kvserver", "scheduler", *WORKERS)] == [
        "start", "scheduler", "worker", "worker",
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["kvserver", "scheduler", *WORKERS])
def test_every_command_parses_with_the_real_cli(svcs: dict[str, Service], name: str) -> None:
    args = build_parser().parse_args(svcs[name].command)
    assert args.command == svcs[name].command[0]
    assert callable(args.func)


def test_image_entrypoint_is_kvserver(doc: dict[str, Any]) -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["kvserver"]' in dockerfile
    assert "USER kvserver" in dockerfile
    assert "torch==2.13.0" in dockerfile
    for name, svc in doc["services"].items():
        assert svc["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        if name != "keys":  # the command is the argument list of `kvserver`
            assert "entrypoint" not in svc, name
    assert doc["services"]["keys"]["entrypoint"] == ["/bin/sh", "-c"]


def test_daemon_binds_all_interfaces_with_ssd_on_a_volume(svcs: dict[str, Service]) -> None:
    d = svcs["kvserver"]
    assert flag(d.command, "--host") == "0.0.0.0"
    ssd_dir = flag(d.command, "--ssd-dir")
    assert any(ssd_dir.startswith(mount + "/") for mount in d.volumes), (ssd_dir, d.volumes)
    assert flag(d.command, "--ssd")


def test_shm_size_exceeds_dram(svcs: dict[str, Service]) -> None:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    shm = str(svcs["kvserver"].raw["shm_size"]).lower()
    shm_bytes = int(shm[:-2]) * units[shm[-2]] if shm.endswith("b") else int(shm)
    dram = flag(svcs["kvserver"].command, "--dram")
    assert dram.endswith("GiB") or dram.endswith("MiB")
    dram_bytes = int(dram[:-3]) * units[dram[-3].lower()]
    assert shm_bytes > dram_bytes


def test_addresses_point_at_listen_ports(svcs: dict[str, Service]) -> None:
    daemon = svcs["kvserver"].command
    zmq = ("kvserver", int(flag(daemon, "--zmq-port")))
    sched = svcs["scheduler"].command
    assert _host_port(flag(sched, "--kvserver")) == zmq
    worker_addrs = [_host_port(a) for a in flag(sched, "--workers").split(",")]
    assert [h for h, _ in worker_addrs] == list(WORKERS)  # rank order
    for (_host, port), name in zip(worker_addrs, WORKERS, strict=True):
        w = svcs[name].command
        assert _host_port(flag(w, "--kvserver")) == zmq
        assert flag(w, "--listen").startswith("tcp://0.0.0.0:")
        assert port in listen_ports(svcs[name])
        assert _host_port(flag(w, "--listen"))[1] == port
    # the rendezvous is served by rank 0, at a port it does not use for anything else
    rendezvous = {_host_port(flag(svcs[n].command, "--dist-init")) for n in WORKERS}
    assert len(rendezvous) == 1
    host, port = rendezvous.pop()
    assert host == "worker-0" and flag(svcs[host].command, "--rank") == "0"
    assert port != _host_port(flag(svcs[host].command, "--listen"))[1]


def test_workers_agree_with_each_other_and_the_scheduler(svcs: dict[str, Service]) -> None:
    cmds = [svcs[n].command for n in WORKERS]
    assert [flag(c, "--rank") for c in cmds] == ["0", "1"]
    assert {flag(c, "--world-size") for c in cmds} == {str(len(WORKERS))}
    sched = svcs["scheduler"].command
    for c in cmds:
        assert flag(c, "--chunk-blocks") == flag(sched, "--chunk-blocks")
        for opt in ("--hash-algo", "--hash-seed"):  # defaults on both sides, or equal
            assert (opt in c) == (opt in sched)


def test_model_file_is_on_one_shared_volume(svcs: dict[str, Service]) -> None:
    volumes = set()
    for name in WORKERS:
        svc = svcs[name]
        model = flag(svc.command, "--model-file")
        mounts = [m for m in svc.volumes if model.startswith(m + "/")]
        assert len(mounts) == 1, (model, svc.volumes)
        volumes.add(svc.volumes[mounts[0]])
        assert "--write-random-model-seed" in svc.command
    assert len(volumes) == 1
    assert {flag(svcs[n].command, "--write-random-model-seed") for n in WORKERS} == {"7"}


def test_volumes_are_declared(doc: dict[str, Any], svcs: dict[str, Service]) -> None:
    used = {v for s in svcs.values() for v in s.volumes.values()}
    assert used <= set(doc["volumes"]), used - set(doc["volumes"])


def test_published_ports_are_listen_ports(svcs: dict[str, Service]) -> None:
    for svc in svcs.values():
        for spec in svc.raw.get("ports", []):
            host, container = str(spec).split(":")
            assert host == container
            assert int(container) in listen_ports(svc), (svc.name, spec)
    published = {int(str(p).split(":")[1]) for p in svcs["scheduler"].raw["ports"]}
    assert published == {int(flag(svcs["scheduler"].command, f)) for f in PORT_FLAGS["scheduler"]}


def test_start_order(svcs: dict[str, Service]) -> None:
    def deps(name: str) -> dict[str, str]:
        return {k: v["condition"] for k, v in svcs[name].raw.get("depends_on", {}).items()}

    assert deps("keys") == {}
    assert deps("kvserver") == {"keys": "service_completed_successfully"}
    for name in WORKERS:
        assert deps(name) == {"kvserver": "service_healthy"}
    assert deps("scheduler") == dict.fromkeys(("kvserver", *WORKERS), "service_healthy")
    health = svcs["kvserver"].raw["healthcheck"]["test"]
    assert health[:3] == ["CMD", "kvserver", "status"]
    assert build_parser().parse_args(health[2:]).command == "status"
    grpc = int(flag(svcs["kvserver"].command, "--grpc-port"))
    assert _host_port(flag(health, "--server")) == ("127.0.0.1", grpc)
    for name in (*WORKERS, "scheduler"):
        ready = flag(svcs[name].command, "--ready-file")
        assert svcs[name].raw["healthcheck"]["test"] == ["CMD", "test", "-f", ready]


def print_commands(env: dict[str, str]) -> dict[str, list[str]]:
    out = subprocess.run(
        ["bash", str(RUN_LOCAL), "--print-commands"],
        env={**os.environ, **env}, capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    got = {}
    for line in out.splitlines():
        name, cmd = line.split(": ", 1)
        got[name] = [cmd] if name == "keys" else shlex.split(cmd)  # keys: a shell script
    return got


#: run-local.sh's default local ports: (service, container port) -> local port
LOCAL_PORTS = {
    ("kvserver", 9470): 9470, ("kvserver", 9471): 9471, ("kvserver", 9472): 9472,
    ("kvserver", 9473): 9473, ("worker-0", 9500): 9500, ("worker-1", 9500): 9501,
    ("worker-0", 29500): 29500, ("scheduler", 9480): 9480, ("scheduler", 9481): 9481,
}  # fmt: skip
#: the variable that overrides each local port
PORT_VARS = {
    ("kvserver", 9470): "KVSERVER_GRPC", ("kvserver", 9471): "KVSERVER_ZMQ",
    ("kvserver", 9472): "KVSERVER_PUB", ("kvserver", 9473): "KVSERVER_METRICS",
    ("worker-0", 9500): "WORKER0_LISTEN", ("worker-1", 9500): "WORKER1_LISTEN",
    ("worker-0", 29500): "DIST_INIT", ("scheduler", 9480): "SCHEDULER_GRPC",
    ("scheduler", 9481): "SCHEDULER_METRICS",
}  # fmt: skip


def test_run_local_runs_the_same_commands(doc: dict[str, Any], tmp_path: Path) -> None:
    """deploy/run-local.sh = the compose commands, localized by the same rules as the
    integration test, with its default local ports."""
    got = print_commands({"KVSERVER_LOCAL_DIR": str(tmp_path)})
    assert got == localize(doc, LOCAL_PORTS, tmp_path)
    assert not (tmp_path / "kvdata").exists()  # --print-commands starts nothing


def test_run_local_ports_are_overridable(doc: dict[str, Any], tmp_path: Path) -> None:
    assert PORT_VARS.keys() == LOCAL_PORTS.keys()
    ports = {key: 20000 + i for i, key in enumerate(PORT_VARS)}
    env = {PORT_VARS[key]: str(port) for key, port in ports.items()}
    got = print_commands({**env, "KVSERVER_LOCAL_DIR": str(tmp_path)})
    assert got == localize(doc, ports, tmp_path)


def test_run_local_print_commands_leaves_no_temporary_directory(tmp_path: Path) -> None:
    """--print-commands without KVSERVER_LOCAL_DIR used to leak a new temporary directory."""
    env = {k: v for k, v in os.environ.items() if k != "KVSERVER_LOCAL_DIR"}
    got = print_commands({**env, "TMPDIR": str(tmp_path)})
    assert set(got) == {"keys", "kvserver", "worker-0", "worker-1", "scheduler"}
    assert list(tmp_path.iterdir()) == []


def test_compose_file_works_with_compose_v1_and_v2(doc: dict[str, Any]) -> None:
    """docker-compose v1 refuses a top-level `name:`; v1.27+ and v2 read the Compose
    Specification without `version:`. The file says which Compose it needs."""
    assert set(doc) <= {"services", "volumes", "x-image"}, set(doc)
    assert "docker-compose v1.27+" in (ROOT / "deploy" / "docker-compose.yml").read_text()


def test_the_image_holds_every_installed_package() -> None:
    """Every top-level package pyproject.toml installs is copied into the image (the image
    used to leave kvserver_vllm and step_protocol out) and not excluded from the context."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").is_file() and any(fnmatch(p.name, pat) for pat in patterns)
    }
    assert {"kvserver", "kvserver_vllm", "scheduler", "worker"} <= packages
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    ignored = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    for name in packages:
        assert f"COPY {name} ./{name}" in dockerfile, name
        assert name not in ignored, name
