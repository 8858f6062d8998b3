"""The stop signals of a kvserver process once its event loop serves: the daemon's
(``kvserver start``, ``daemon/process.py``) and the scheduler's (``kvserver scheduler``,
``scheduler/process.py``).

Runs in that process, main thread, on its event loop (``loop.add_signal_handler``); not
thread-safe. Call order: ``StopSignals(stop)`` → :meth:`~StopSignals.install` → the process's
ordered shutdown waits on ``stop`` → :meth:`~StopSignals.arm` with what a forced exit cleans
up (:class:`Leaving`), from when a second signal may end the process: the scheduler arms at
once, the daemon when its shutdown begins (before that, there is nothing a second signal
could hurry).

- The first stop signal sets ``stop``: the ordered shutdown, which may take its grace periods
  (the scheduler's in-flight streams and unanswered steps, the daemon's SSD drain).
- A repeat within :data:`REPEAT_WINDOW_S` of the first is the same request, and changes
  nothing: one stop often arrives as two signals milliseconds apart (``timeout`` forwarding
  its signal while a supervisor's ``pkill`` sends its own, a terminal's SIGHUP with a shell's
  SIGTERM), and those used to force an immediate exit instead of the graceful stop asked for.
- A later one, once armed, ends the process at once as a SIGKILL would, with 128 + its number,
  after :meth:`Leaving.clean` (children killed, files and directories removed): a second
  Ctrl-C, a shutdown held up by a hung disk or a stream that does not end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the daemon imports this before its heavy imports (kvserver start)
    import asyncio
    import subprocess

logger = logging.getLogger(__name__)

#: the signals that stop a kvserver process (HUP: its terminal closed)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: a stop signal this soon (seconds) after the first is the same request
REPEAT_WINDOW_S = 1.0


@dataclass
class Leaving:
    """What a forced exit still cleans up: ``children`` killed, ``files`` removed, ``dirs``
    removed with their contents. The process adds each as it makes it."""

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
    """The loop's handler of :data:`STOP_SIGNALS`; see the module docstring. ``clock``: the
    monotonic clock the repeat window is measured on."""

    def __init__(self, stop: asyncio.Event, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._stop = stop
        self._clock = clock
        self._first: float | None = None  # when the first stop signal came
        self._leaving: Leaving | None = None  # None: not armed
        self._note = ""

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle :data:`STOP_SIGNALS` on ``loop`` from now on."""
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self, sig)

    def arm(self, leaving: Leaving, note: str) -> None:
        """From now on a stop signal past the repeat window cleans up ``leaving`` and exits;
        ``note`` (what that skips and cleans) completes its warning."""
        self._leaving = leaving
        self._note = note

    def __call__(self, signum: int) -> None:
        now = self._clock()
        if not self._stop.is_set():
            self._first = now
            self._stop.set()
            return
        if self._first is not None and now - self._first <= REPEAT_WINDOW_S:
            logger.info(
                "a repeated stop signal %.3f s after the first: the same request, the ordered "
                "shutdown goes on", now - self._first,
            )  # fmt: skip
            return
        if self._leaving is None:
            return
        logger.warning(
            "a second stop signal: exiting now, without the ordered shutdown %s", self._note
        )
        self._leaving.clean()
        logging.shutdown()
        os._exit(128 + signum)
