"""``kvserver start`` as a newcomer meets it: config errors (an unknown policy too) exit 2
before any start-up work, misspelt KVSERVER_* variables are warned about, the arena's
pre-fault is announced with progress on a terminal, and SIGHUP gets the ordered shutdown."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from kvserver.daemon.config import unknown_env
from kvserver.policies import policy_names
from tests.support.daemon import start_daemon, wait_for_ready_file

pytestmark = pytest.mark.multiprocess


def test_an_unknown_policy_exits_2_before_start_up(tmp_path: Path) -> None:
    env = {**os.environ, "KVSERVER_DRAMM": "1GiB", "KVSERVER_SERVER": "x"}
    cmd = [
        sys.executable, "-m", "kvserver.cli", "start", "--policy", "fifo",
        "--shm-dir", str(tmp_path), "--metrics-port", "-1",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    names = ", ".join(policy_names())  # every registered policy, in order
    assert f"unknown eviction policy 'fifo'; choose one of: {names}" in result.stderr
    assert "arc" in names and "lru" in names
    assert "unknown environment variable KVSERVER_DRAMM (did you mean KVSERVER_DRAM?)" in (
        result.stderr
    )
    assert "KVSERVER_SERVER" not in result.stderr  # the CLI's own variable
    assert list(tmp_path.iterdir()) == []  # no arena was created


def test_unknown_env_names_every_typo_and_nothing_else() -> None:
    env = {"KVSERVER_DRAM": "1GiB", "KVSERVER_POLICYY": "lru", "KVSERVER_XYZZY": "1", "HOME": "/"}
    assert unknown_env(env) == [
        "ignoring unknown environment variable KVSERVER_POLICYY (did you mean KVSERVER_POLICY?)",
        "ignoring unknown environment variable KVSERVER_XYZZY",
    ]


def test_prefault_is_announced_with_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24x100
    cmd = [
        sys.executable, "-m", "kvserver.cli", "start", "--dram", "768MiB", "--grpc-port", "0",
        "--zmq-port", "0", "--pub-port", "-1", "--metrics-port", "-1",
        "--ready-file", str(ready),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # the terminal must be read or the daemon blocks writing to it
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        wait_for_ready_file(ready, proc, time.monotonic() + 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
        os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert "pre-faulting the DRAM arena: 768 MiB" in out
    assert "pre-faulting the DRAM arena: 100%" in out, out  # tqdm's bar reached the end


def test_sighup_gets_the_ordered_shutdown(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--ssd-dir", str(tmp_path / "ssd"))
    arena = Path(d.arena_path)
    assert arena.exists()
    d.proc.send_signal(signal.SIGHUP)
    assert d.proc.wait(30) == 0, d.log()
    assert "stopped; shared-memory arena removed" in d.log()
    assert not arena.exists()
