"""Start a real kvserver daemon process on loopback with ephemeral ports (tests and benchmarks)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from benchmarks.harness.proc import READY_TIMEOUT_S as READY_TIMEOUT_S
from benchmarks.harness.proc import Proc as Proc
from benchmarks.harness.proc import start_process
from benchmarks.harness.proc import wait_for_ready_file as wait_for_ready_file

#: the DRAM policy the benchmarks' recorded figures were measured with (the daemon's default
#: until issue 15 session 9 made it ``chain``): benchmarks pass it so that they stay comparable
RECORDED_POLICY = ("--policy", "prefix")


class DaemonProc(Proc):
    """A started daemon: its addresses from its ready file (``info``)."""

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.info['grpc_port']}"

    @property
    def zmq_address(self) -> str:
        return f"tcp://127.0.0.1:{self.info['zmq_port']}"

    @property
    def pub_address(self) -> str:
        return f"tcp://127.0.0.1:{self.info['pub_port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.info['metrics_port']}/metrics"

    @property
    def arena_path(self) -> str:
        return str(self.info["arena_path"])

    @property
    def token(self) -> str:
        """The token the daemon left for this user (kvserver/token_file.py); "" if none."""
        from kvserver.token_file import TokenFile

        return TokenFile(self.zmq_address).token()


def raw_dealer(
    address: str, token: str | None = None, ctx: zmq.Context[Any] | None = None
) -> zmq.Socket[bytes]:
    """A bare DEALER (LINGER 0) connected to the daemon at ``address``, presenting ``token`` at
    the ZMQ handshake (PLAIN, ``docs/wire.md``): by default the token the daemon left for this
    user (none when there is none), "" for none at all (an unauthenticated peer)."""
    from kvserver.crypto import apply_token
    from kvserver.token_file import TokenFile

    sock: zmq.Socket[bytes] = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.linger = 0
    token = TokenFile(address).token() if token is None else token
    if token:
        apply_token(sock, token)
    sock.connect(address)
    return sock


def start_daemon(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None, module: str = "kvserver.cli"
) -> DaemonProc:
    """Start ``kvserver start`` with ephemeral ports; returns once every listener is up.
    ``module``: run as ``python -m module start ...`` (a test's wrapper that injects a fault
    first, then runs ``kvserver.cli``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    ready = tmp_path / f"ready-{time.monotonic_ns()}.json"
    log_path = tmp_path / f"daemon-{time.monotonic_ns()}.log"
    args = [
        sys.executable,
        "-m",
        module,
        "start",
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--zmq-port",
        "0",
        "--pub-port",
        "0",
        "--metrics-port",
        "0",
        "--ready-file",
        str(ready),
        *extra,
    ]
    full_env = {**os.environ, **(env or {})}
    proc, info = start_process(args, ready, log_path, name="daemon", env=full_env)
    return DaemonProc(proc, info, log_path, args)


def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.02) -> Any:
    """Poll ``predicate()`` until it returns a truthy value; raise AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)
