"""Read deploy/docker-compose.yml and turn its commands into local ones (tests only).

Local = the compose commands with every service hostname and 0.0.0.0 -> 127.0.0.1, every
listen port of a service mapped to a local port, volume mount points -> ``<dir>/<volume>`` and
ready files -> ``<dir>/<service>.ready``. A service with an ``entrypoint`` (the ``keys``
service: a shell script, not a ``kvserver`` command) keeps its script with only the mount
points mapped. deploy/run-local.sh follows the same rules (checked).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
RUN_LOCAL = ROOT / "deploy" / "run-local.sh"

#: (service, the flag naming one of its listen ports) for the daemon and the scheduler
PORT_FLAGS = {
    "start": ("--grpc-port", "--zmq-port", "--pub-port", "--metrics-port"),
    "scheduler": ("--grpc-port", "--metrics-port"),
}
_ADDR = re.compile(r"(?:tcp://)?(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)")


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    volumes: dict[str, str]  # mount point -> volume name
    raw: dict[str, Any]


def load_compose(path: Path = COMPOSE) -> dict[str, Any]:
    with open(path) as f:
        doc: dict[str, Any] = yaml.safe_load(f)
    return doc


def services(doc: dict[str, Any]) -> dict[str, Service]:
    out = {}
    for name, svc in doc["services"].items():
        volumes = {}
        for spec in svc.get("volumes", []):
            source, mount = spec.split(":")[:2]
            volumes[mount] = source
        out[name] = Service(name, [str(a) for a in svc["command"]], volumes, svc)
    return out


def flag(cmd: list[str], name: str) -> str:
    """The value of ``--name VALUE`` in ``cmd`` (KeyError when absent)."""
    for i, arg in enumerate(cmd[:-1]):
        if arg == name:
            return cmd[i + 1]
    raise KeyError(name)


def is_script(svc: Service) -> bool:
    """A one-shot shell script (the ``keys`` service), not a ``kvserver`` command."""
    return "entrypoint" in svc.raw


def listen_ports(svc: Service) -> set[int]:
    """The container ports this service binds."""
    if is_script(svc):
        return set()
    cmd = svc.command
    if cmd[0] in PORT_FLAGS:
        return {int(flag(cmd, f)) for f in PORT_FLAGS[cmd[0]] if int(flag(cmd, f)) >= 0}
    if cmd[0] == "worker":
        ports = {int(flag(cmd, "--listen").rsplit(":", 1)[1])}
        host, port = flag(cmd, "--dist-init").removeprefix("tcp://").rsplit(":", 1)
        if host == svc.name:  # rank 0 hosts the torch.distributed rendezvous
            ports.add(int(port))
        return ports
    raise ValueError(f"unknown command {cmd[0]!r}")


def localize(
    doc: dict[str, Any], ports: dict[tuple[str, int], int], directory: Path
) -> dict[str, list[str]]:
    """Every service's command as a local one; ``ports`` maps (service, container port) to a
    local port and must cover every listen port."""
    svcs = services(doc)

    def addr(match: re.Match[str], own: str) -> str:
        host, port = match["host"], int(match["port"])
        owner = own if host == "0.0.0.0" else host
        if owner not in svcs:
            return match[0]
        prefix = "tcp://" if match[0].startswith("tcp://") else ""
        return f"{prefix}127.0.0.1:{ports[(owner, port)]}"

    out: dict[str, list[str]] = {}
    for name, svc in svcs.items():
        if is_script(svc):
            (script,) = svc.command
            for mount, volume in svc.volumes.items():
                script = script.replace(mount, str(directory / volume))
            out[name] = [script]
            continue
        cmd = list(svc.command)
        for i, arg in enumerate(cmd):
            prev = cmd[i - 1] if i else ""
            if prev in PORT_FLAGS.get(cmd[0], ()) and int(arg) >= 0:
                cmd[i] = str(ports[(name, int(arg))])
            elif prev == "--host" and arg == "0.0.0.0":
                cmd[i] = "127.0.0.1"
            elif prev == "--ready-file":
                cmd[i] = str(directory / f"{name}.ready")
            elif arg.startswith("/"):
                for mount, volume in svc.volumes.items():
                    if arg == mount or arg.startswith(mount + "/"):
                        cmd[i] = str(directory / volume) + arg[len(mount) :]
            else:
                cmd[i] = _ADDR.sub(partial(addr, own=name), arg)
        out[name] = cmd
    return out
