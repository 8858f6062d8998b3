"""Processes a test module left running: found, stopped, reported.

A daemon, Redis server or worker a test starts and never stops keeps its CPU, memory and ports
for the rest of the session, and on the loaded CI machine (2 cores) it slows or disturbs the
tests after it, which then fail for no fault of their own. tests/conftest.py calls
:func:`stop_leftovers` after each module's last teardown (its module-scoped fixtures are
finished by then): every child of the pytest process still running is SIGKILLed, and the
module's last test errors, naming them.

Only direct children are seen (``/proc/*/stat``'s parent pid; Linux, elsewhere nothing is
found): every harness starts its processes with ``subprocess.Popen`` from the pytest process.
An exited child not yet waited for (a zombie) holds nothing and is left to its ``Popen``.
multiprocessing's own helpers (its resource tracker, its fork server) serve this process
until it exits, by design: they are not leftovers (torch's ``mp.spawn`` in
tests/worker/test_model.py starts the tracker).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

#: how long a SIGKILLed leftover gets to be gone before it is named as unkillable too
_GONE_S = 10.0
#: command lines of the helpers multiprocessing starts for this process's lifetime
HELPERS = (
    "from multiprocessing.resource_tracker import main",
    "from multiprocessing.forkserver import main",
)


def running_children(pid: int | None = None) -> dict[int, str]:
    """The running (not zombie) children of ``pid`` (default: this process): pid -> its
    command line (the first 200 characters)."""
    parent = os.getpid() if pid is None else pid
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the command name may hold spaces and parentheses: the fields follow the last ")"
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent or fields[0] in ("Z", "X"):
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not Linux's format
            continue
        found[int(entry.name)] = cmd.strip()[:200]
    return found


def stop_leftovers() -> dict[int, str]:
    """SIGKILL every running child of this process but multiprocessing's helpers and wait
    (at most 10 s) until each has ended (a zombie until its ``Popen`` reaps it); returns what
    was running (pid -> command line), {} when nothing was."""
    left = {
        pid: cmd
        for pid, cmd in running_children().items()
        if not any(helper in cmd for helper in HELPERS)
    }
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _GONE_S
    while set(left) & set(running_children()) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling until the kernel has ended them, bounded by the deadline
    return left
