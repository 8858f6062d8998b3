"""The stop signals of ``kvserver start`` (SIGTERM, SIGINT, SIGHUP) from its first moment.

Runs in the daemon process, main thread only. Before the event loop's handlers exist (imports,
the config, the arena's pre-fault: a second or more), a stop signal used to be lost (a SIGINT
that a shell's background job ignores) or to end the process with a KeyboardInterrupt
traceback, an arena half made. Now:

Call order: ``kvserver start`` enters :func:`recording` before its heavy imports (a handler
that records the first stop signal) → :func:`forward` hands each recorded signal to the
daemon's stop event (at once when one came already) → start-up checks that event at each
step and stops cleanly (``process.py``) → once serving, the loop's own handlers replace these
(``kvserver/stop_signals.py``: the first signal stops, a later one during the shutdown exits
at once) → :func:`recording` exits: the handlers it found are back.

:func:`pause_point` is a test's hook: under ``KVSERVER_TEST_PAUSE_AT=STEP`` start-up waits at
STEP until a stop signal has been recorded, so that a test sends it at a known step instead of
racing a sleep.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from kvserver.stop_signals import STOP_SIGNALS

#: the test hook's variable: the start-up step to wait at
PAUSE_ENV = "KVSERVER_TEST_PAUSE_AT"
#: the longest a pause point waits for its signal
PAUSE_LIMIT_S = 120.0


class _Recorder:
    """The first stop signal received (``received``) and whom to tell (``listener``)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.listener: Callable[[], None] | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self.listener is not None:
            self.listener()


_active: _Recorder | None = None


@contextmanager
def recording() -> Iterator[None]:
    """Record stop signals from now on (a no-op outside the main thread, or when already
    recording); the previous handlers are back on exit."""
    global _active
    if _active is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    recorder = _Recorder()
    previous = {sig: signal.signal(sig, recorder.handle) for sig in STOP_SIGNALS}
    _active = recorder
    try:
        yield
    finally:
        _active = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def forward(listener: Callable[[], None]) -> Iterator[None]:
    """Call ``listener`` (in the signal handler: it must be safe there, e.g. setting a flag)
    for each stop signal recorded, now if one came already, until exit."""
    recorder = _active
    if recorder is None:
        yield
        return
    recorder.listener = listener
    try:
        if recorder.received is not None:
            listener()
        yield
    finally:
        recorder.listener = None


def pause_point(step: str) -> None:
    """Under ``KVSERVER_TEST_PAUSE_AT=step`` (tests only), while recording: say so on stderr
    and wait until a stop signal has been recorded (at most :data:`PAUSE_LIMIT_S`)."""
    recorder = _active
    if recorder is None or os.environ.get(PAUSE_ENV) != step:
        return
    print(f"kvserver start: paused at {step} until a stop signal ({PAUSE_ENV})",
          file=sys.stderr, flush=True)  # fmt: skip
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while recorder.received is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the signal's handler runs within this
