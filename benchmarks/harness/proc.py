"""A process started on loopback for benchmarks and tests: its handle, and waiting for its
ready file (each process writes one, atomically, once it serves)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: a daemon imports, maps its arena and opens its tiers before it is ready: a few seconds on
#: a quiet machine, and 30 s was once not enough for one with an SSD tier on a loaded one
#: (load 10-15 on 2 cores: tests/kvserver/daemon/peers/test_peer_faults.py). Only a process
#: that fails to start waits this long, and it usually exits first.
READY_TIMEOUT_S = 90.0

#: (name, pid, log file) of every process :func:`start_process` started, in order: the tests'
#: conftest shows the tail of each log started during a test that failed (no handles are kept,
#: so a leaked process still warns when its test drops it)
STARTED: list[tuple[str, int, Path]] = []


@dataclass
class Proc:
    """A started process: ``info`` is its ready file's content, its output goes to
    ``log_path``, ``args`` started it."""

    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_for_ready_file(ready: Path, proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Poll for ``ready`` until ``deadline`` (monotonic); RuntimeError if ``proc`` exits first or
    the deadline passes. The caller adds its log and cleans up."""
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError("not ready before the deadline")
        time.sleep(0.02)  # polling for the ready file, bounded by the deadline above


def start_process(
    args: list[str],
    ready: Path,
    log_path: Path,
    *,
    name: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start ``args`` (output to ``log_path``) and wait up to READY_TIMEOUT_S for its ready
    file; returns the process and the ready file's content. RuntimeError, naming ``name`` and
    carrying the log, if it exits first or is not ready in time (it is killed then)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    STARTED.append((name, proc.pid, log_path))
    try:
        wait_for_ready_file(ready, proc, time.monotonic() + READY_TIMEOUT_S)
    except RuntimeError as exc:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        raise RuntimeError(f"{name} {exc}:\n{log_path.read_text()}") from None
    return proc, json.loads(ready.read_text())


def runtime_ms(pid: int) -> float:
    """CPU milliseconds the process ``pid`` has run so far, all its threads (from
    ``/proc/PID/task/*/schedstat``, nanoseconds; Linux): a difference around a step is that
    step's CPU in the process, which a loaded machine disturbs less than its wall time."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e6


def ticks(pid: int, tid: int | None = None) -> tuple[int, int]:
    """(user, system) clock ticks of a process (or one of its threads) so far."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])
