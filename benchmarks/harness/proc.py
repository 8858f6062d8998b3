"""A process started on loopback for benchmarks and tests: its handle, and waiting for its
ready file (each process writes one, atomically, once it serves)."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
