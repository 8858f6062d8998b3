"""Callgrind for the instruction-count benchmarks (lookup_, store_, transfer_, policy_instructions
.py): :func:`run_measured` runs a benchmark's measured part under valgrind, which calls each
kind of call N times between two :func:`dump` calls named by :func:`dump_name`
(``kind<I>x<N>``); :func:`per_call` reads the totals back."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_TRIGGER = re.compile(r"^desc: Trigger: .*kind(\d+)x(\d+)\s*$", re.M)
_SUMMARY = re.compile(r"^summary: (\d+)$", re.M)


def dump_name(index: int, n: int) -> str:
    """The dump name that marks ``n`` calls of kind ``kinds[index]``."""
    return f"kind{index}x{n}"


def per_call(out: Path, pattern: str, kinds: Sequence[str]) -> dict[str, float]:
    """Instructions per call of each of ``kinds`` (in their order) in the dumps of ``out``
    matching ``pattern`` (e.g. ``daemon.*.*``); dumps without a kind (the warm-up one, the
    final one) are skipped. SystemExit naming the kinds no dump counted."""
    counts: dict[str, float] = {}
    for path in out.glob(pattern):
        text = path.read_text(errors="replace")[:4096]
        trigger, total = _TRIGGER.search(text), _SUMMARY.search(text)
        if trigger is None or total is None:
            continue
        counts[kinds[int(trigger.group(1))]] = int(total.group(1)) / int(trigger.group(2))
    missing = [kind for kind in kinds if kind not in counts]
    if missing:
        raise SystemExit(f"no callgrind dump of {missing} ({pattern}) in {out}")
    return {kind: counts[kind] for kind in kinds}


def run_measured(out: Path, prefix: str, module: str, args: Sequence[str]) -> None:
    """Run ``python -m module *args`` under callgrind, its files ``out/prefix.<pid>[.<n>]``
    (``out`` emptied first). SystemExit if valgrind is missing or the process failed (with
    the last lines of its stderr, valgrind's own ``==`` lines left out)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/{prefix}.%p",
        sys.executable, "-m", module, *args,
    ]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if not line.startswith("==")]
        raise SystemExit("the measured process failed:\n" + "\n".join(lines[-20:]))


def dump(out: Path | None, name: str) -> None:
    """Have callgrind write this process's counters as dump ``name`` (no-op when ``out`` is
    None: not under callgrind). A loaded machine sometimes makes ``callgrind_control`` miss
    the process's answer: asked again, at most 5 times."""
    if out is None:
        return
    for _ in range(5):
        done = subprocess.run(["callgrind_control", "--dump", name, str(os.getpid())],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode == 0:
            return
    raise SystemExit(f"callgrind_control --dump failed: {done.stdout}{done.stderr}")


def daemon_ready(daemon: subprocess.Popen[bytes], ready: Path, timeout_s: float) -> Any:
    """The ready file of ``daemon`` started under valgrind (its JSON), polled until it appears;
    SystemExit once the daemon has exited or ``timeout_s`` has passed (valgrind's start-up is
    slow: minutes on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the daemon did not start under valgrind")
        time.sleep(0.2)  # polling for the ready file, bounded by the deadline
    return json.loads(ready.read_text())
