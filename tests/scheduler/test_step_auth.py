"""The step channel on loopback is safe by default, on real worker processes (synthetic ones,
``python -m scheduler.synthetic``), a real scheduler and raw ZMQ peers: a ``tcp://`` worker
without CURVE requires a random token at the handshake and leaves it in a 0600 file that its
own user's scheduler reads by itself; a peer without it (or with a wrong one) is refused before
any message of it is read, and the worker keeps serving its scheduler; ``--step-no-auth`` opts
out (and removes a token file a killed worker left for its port); a scheduler that cannot read
the token says so. (Another user cannot read the 0600 file: the file modes are checked here.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvserver.client.links import ConnectionWatch
from kvserver.crypto import apply_token
from kvserver.token_file import token_path
from step_protocol import KIND_HELLO, WorkerHello, decode, encode_body
from tests.scheduler.builders import expected_output, tokens
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler, start_worker
from tests.support.daemon import wait_until

pytestmark = pytest.mark.multiprocess

HELLO = encode_body(KIND_HELLO, {**WorkerHello(0, 1, 16, 64, "synthetic").to_wire(), "seq": -1})


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


class Peer:
    """A raw DEALER to a worker presenting ``token`` at the handshake (None: no token)."""

    def __init__(self, endpoint: str, token: str | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        mechanism = "null"
        if token is not None:
            apply_token(self.sock, token)
            mechanism = "plain"
        self.watch = ConnectionWatch(self.sock, mechanism=mechanism, peer="worker",
                                     option_prefix="step_")  # fmt: skip
        self.sock.connect(endpoint)

    def hello(self) -> dict[str, object]:
        self.sock.send(HELLO)
        assert self.sock.poll(20_000), self.watch.failure()
        kind, body = decode(self.sock.recv())
        assert kind == KIND_HELLO
        return body

    def refused(self) -> str:
        """Why the handshake failed (waits for the monitor's event); nothing was answered."""
        self.sock.send(HELLO)
        why = wait_until(self.watch.failure)
        assert not self.sock.poll(0)
        return str(why)

    def close(self) -> None:
        self.watch.close()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Proc]:
    proc = start_worker(tmp_path, "w")
    try:
        yield proc
    finally:
        proc.kill()


def test_a_loopback_worker_admits_only_its_users_token(worker: Proc, tmp_path: Path) -> None:
    endpoint = worker.info["endpoint"]
    path = token_path(port_of(endpoint))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token = Path(path).read_text()
    assert len(token) >= 32

    for presented in (None, "not-the-step-token", token[:-1]):
        peer = Peer(endpoint, presented)
        try:
            why = peer.refused()
        finally:
            peer.close()
        assert "worker" in why, why
    peer = Peer(endpoint, token)
    try:
        assert peer.hello()["seq"] == -1
    finally:
        peer.close()

    # the scheduler reads the token by itself; the worker served on after the refusals
    sched = start_scheduler(tmp_path, "--workers", endpoint, "--num-gpu-blocks", "64")
    try:
        prompt = tokens(30, 11)
        with EngineClient(sched.info["grpc_port"]) as client:
            assert output_tokens(client.generate(prompt, 4)) == expected_output(prompt, 4)
    finally:
        assert sched.terminate() == 0, sched.log()
    assert worker.terminate() == 0, worker.log()
    assert not Path(path).exists()  # removed at exit


def test_no_auth_opts_out_and_removes_a_stale_token_file(tmp_path: Path) -> None:
    killed = start_worker(tmp_path, "killed")
    endpoint = killed.info["endpoint"]
    killed.kill()
    assert Path(token_path(port_of(endpoint))).exists()
    proc = start_worker(tmp_path, "open", endpoint, "--step-no-auth")
    try:
        assert not Path(token_path(port_of(endpoint))).exists()
        peer = Peer(endpoint, None)
        try:
            assert peer.hello()["seq"] == -1
        finally:
            peer.close()
    finally:
        assert proc.terminate() == 0, proc.log()


def test_a_scheduler_without_the_token_says_why(worker: Proc) -> None:
    """As for a scheduler of another user: the worker's token file cannot be read."""
    endpoint = worker.info["endpoint"]
    path = token_path(port_of(endpoint))
    os.unlink(path)
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "scheduler", "--workers", endpoint,
         "--grpc-port", "0", "--metrics-port", "-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"its step token, which this scheduler could not read from {path}" in proc.stderr
    peer = Peer(endpoint, None)  # and the worker is undisturbed: still refusing others
    try:
        assert "worker" in peer.refused()
    finally:
        peer.close()
