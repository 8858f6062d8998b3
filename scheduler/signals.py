"""The stop signals of ``kvserver scheduler`` (SIGTERM, SIGINT, SIGHUP) once its loop runs.

Runs in the scheduler process, on its event loop (``loop.add_signal_handler``), like the
daemon's ``kvserver/daemon/signals.py``: the first stop signal sets the stop event (the
ordered shutdown of ``process.py``, which may take its grace periods: in-flight streams wait
``--shutdown-grace-s``, a step a worker does not answer waits ``--step-timeout-s``); a second
one, at any time after the first, ends the process at once, as a SIGKILL would, with 128 + its
number, after killing the synthetic worker children and removing the files the scheduler
leaves (its gRPC token file, the ready file, the private directory of its ``ipc://`` sockets),
all registered in :class:`Leaving` as ``serve`` makes them. What that skips: streams are cut
(clients get UNAVAILABLE), workers given by ``--workers`` are not told to stop, the
connector's daemon leases are not released (they expire on the daemon), the trace's last
records may be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: the signals that stop the scheduler (HUP: its terminal closed)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class Leaving:
    """What a forced exit still cleans up: ``files`` removed, ``dirs`` removed with their
    contents, ``children`` killed. ``serve`` adds each as it makes it."""

    files: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def clean(self) -> None:
        """Kill the children and remove the files and directories (errors ignored)."""
        for child in self.children:
            with contextlib.suppress(OSError):
                child.kill()
        for path in self.files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


class StopSignals:
    """The loop's handler of the stop signals: the first sets ``stop``; the next cleans up
    :attr:`leaving` and exits at once, 128 + its number. Main thread, event loop only."""

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self.leaving = Leaving()

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle :data:`STOP_SIGNALS` on ``loop`` from now on."""
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self, sig)

    def __call__(self, signum: int) -> None:
        if not self._stop.is_set():
            self._stop.set()
            return
        logger.warning(
            "a second stop signal: exiting now, without the ordered shutdown (streams cut, "
            "daemon leases left to expire); synthetic workers killed, token and ready files "
            "removed"
        )
        self.leaving.clean()
        logging.shutdown()
        os._exit(128 + signum)
