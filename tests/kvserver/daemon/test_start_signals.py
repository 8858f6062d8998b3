"""A stop signal during ``kvserver start``'s start-up stops it cleanly: exit 0, no arena and
no token file left. Each test makes the daemon wait at a start-up step
(``KVSERVER_TEST_PAUSE_AT``, kvserver/daemon/signals.py) and sends the signal then: no race
with a sleep."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvserver.daemon.signals import PAUSE_ENV
from kvserver.token_file import token_dir

pytestmark = pytest.mark.multiprocess

#: ``sys.executable`` with SIGINT ignored, as a shell's background job (``cmd &``) starts it
IGNORING_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _start_paused(
    tmp_path: Path, step: str, *, sigint_ignored: bool = False
) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """``kvserver start`` waiting at ``step``; returns it, its stderr lines so far and the
    thread that reads on until it exits."""
    cmd = [
        "-m", "kvserver.cli", "start", "--grpc-port", "0", "--zmq-port", "0",
        "--pub-port", "-1", "--metrics-port", "-1", "--dram", "4MiB", "--shm-dir", str(tmp_path),
    ]  # fmt: skip
    prefix = [sys.executable, "-c", IGNORING_SIGINT] if sigint_ignored else [sys.executable]
    env = {**os.environ, PAUSE_ENV: step}
    proc = subprocess.Popen([*prefix, *cmd], stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    seen: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            seen.put(line)
        seen.put("")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    paused = f"kvserver start: paused at {step} until a stop signal"
    while True:
        try:
            line = seen.get(timeout=60)
        except queue.Empty:
            proc.kill()
            proc.wait()
            pytest.fail(f"never paused at {step}: {''.join(lines)}")
        if paused in line:
            return proc, lines, reader
        if not line:
            pytest.fail(f"exited {proc.wait()} before pausing at {step}: {''.join(lines)}")


def _left(shm_dir: Path) -> list[str]:
    """The arena files and token files in ``shm_dir``."""
    tokens = token_dir(str(shm_dir))
    found = [p.name for p in shm_dir.iterdir() if p.is_file() and p.name.startswith("kvserver-")]
    if os.path.isdir(tokens):
        found += [f"tokens/{name}" for name in os.listdir(tokens)]
    return found


@pytest.mark.parametrize(
    ("step", "sig", "sigint_ignored"),
    [
        ("start", signal.SIGINT, False),  # was: a KeyboardInterrupt traceback, exit -2
        ("start", signal.SIGINT, True),  # was: lost, the daemon started and served
        ("start", signal.SIGTERM, False),  # was: killed, exit -15
        ("prefault", signal.SIGINT, True),  # was: lost
        ("listen", signal.SIGHUP, False),  # was: killed with its arena and token file left
    ],
)
def test_a_stop_signal_during_start_up_stops_it_cleanly(
    tmp_path: Path, step: str, sig: signal.Signals, sigint_ignored: bool
) -> None:
    proc, lines, reader = _start_paused(tmp_path, step, sigint_ignored=sigint_ignored)
    with proc:
        if step != "start":  # the arena exists by then
            assert any(name.startswith(f"kvserver-{proc.pid}-") for name in _left(tmp_path))
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, "".join(lines)
        reader.join(timeout=60)
    log = "".join(lines)
    assert "Traceback" not in log
    assert "stopped during start-up (a stop signal before step " in log, log
    assert "kvserver listening" not in log
    assert _left(tmp_path) == [], log
