"""The compose cluster's very commands, run as local processes: the `keys` script (CURVE, TLS
and the token, which every other command uses), the daemon with its SSD tier, two
tensor-parallel CPU workers (step channel over CURVE) and the scheduler (front door over
TLS); one Generate through the scheduler's gRPC Engine; the same prompt after a scheduler
restart is served from kvserver (docs/deploy.md, "Seeing kvserver at work"); every process
exits 0 on SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserver.crypto import TlsClient
from tests.deploy.compose import flag, listen_ports, load_compose, localize, services
from tests.deploy.test_compose_keys import run_keys
from tests.scheduler.procs import EngineClient, Proc, output_tokens
from tests.support.daemon import wait_for_ready_file, wait_until
from tests.support.metrics import scrape
from tests.support.ports import free_port as _free_port

pytestmark = pytest.mark.multiprocess

READY_TIMEOUT_S = 60.0
MAX_TOKENS = 8


def _start(name: str, cmd: list[str], tmp_path: Path) -> Proc:
    """Start one service's command; ``info`` is filled by :func:`_wait_ready`."""
    args = [sys.executable, "-m", "kvserver.cli", *cmd]
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return Proc(proc, {}, log_path, args)


def _wait_ready(name: str, p: Proc, tmp_path: Path) -> Proc:
    ready = tmp_path / f"{name}.ready"
    try:
        wait_for_ready_file(ready, p.proc, time.monotonic() + READY_TIMEOUT_S)
    except RuntimeError as exc:
        raise RuntimeError(f"{name} did not start ({exc}):\n{p.log()}") from None
    p.info = json.loads(ready.read_text())
    return p


def test_compose_commands_as_local_processes_serve_generate(tmp_path: Path) -> None:
    doc = load_compose()
    svcs = services(doc)
    ports = {(s.name, p): _free_port() for s in svcs.values() for p in listen_ports(s)}
    cmds = localize(doc, ports, tmp_path)
    for volume in doc["volumes"]:
        (tmp_path / volume).mkdir()
    run_keys(cmds.pop("keys")[0], tmp_path)

    started: list[Proc] = []
    try:
        for group in (["kvserver"], ["worker-0", "worker-1"], ["scheduler"]):
            batch = [(n, _start(n, cmds[n], tmp_path)) for n in group]
            started += [p for _, p in batch]
            for name, p in batch:
                _wait_ready(name, p, tmp_path)
        daemon, worker0, worker1, scheduler = started
        assert (tmp_path / "kvdata" / "ssd").is_dir()  # the SSD tier lives on the volume
        assert daemon.info["zmq_port"] == ports[("kvserver", 9471)]
        assert scheduler.info["grpc_port"] == ports[("scheduler", 9480)]
        assert daemon.info["metrics_port"] == ports[("kvserver", 9473)]
        assert scheduler.info["metrics_port"] == ports[("scheduler", 9481)]
        assert [worker0.info["rank"], worker1.info["rank"]] == [0, 1]

        prompt = list(range(1, 41))
        # the front door is TLS: its certificate (self-signed) is the CA
        tls = TlsClient(flag(cmds["scheduler"], "--tls-cert-file"))
        with EngineClient(scheduler.info["grpc_port"], tls) as client:
            out = output_tokens(client.generate(prompt, MAX_TOKENS))
        assert len(out) == MAX_TOKENS

        # The same prompt again would hit the scheduler's own prefix cache (kvserver sees no
        # hit). A restarted scheduler has an empty GPU cache: its prompt comes from kvserver.
        metrics = f"http://127.0.0.1:{daemon.info['metrics_port']}/metrics"
        wait_until(lambda: scrape(metrics).value("kvserver_tier_entries", tier="dram") >= 2)
        assert scheduler.terminate() == 0, scheduler.log()
        scheduler = started[3] = _wait_ready(
            "scheduler", _start("scheduler", cmds["scheduler"], tmp_path), tmp_path
        )
        with EngineClient(scheduler.info["grpc_port"], tls) as client:
            again = client.generate(prompt, MAX_TOKENS)
        assert again[0].usage.kvserver_tokens == 32  # two full 16-token blocks
        assert output_tokens(again) == out
        assert scrape(metrics).value("kvserver_hits_total", tier="dram") >= 2

        for p in reversed(started):  # scheduler, workers, daemon: the compose stop order
            assert p.terminate() == 0, p.log()
    finally:
        for p in started:
            p.kill()
