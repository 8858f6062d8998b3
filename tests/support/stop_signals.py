"""Sending a process its stop signals the way the tests of ``kvserver/stop_signals.py`` need,
without sleeping as synchronisation: a burst (the repeat sent as soon as the first is
delivered, so the kernel does not merge the two), and a second signal past the repeat window
(waited for on the monotonic clock, from a moment after the process took the first)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from kvserver.stop_signals import REPEAT_WINDOW_S
from tests.support.daemon import wait_until


def pending(pid: int, sig: int) -> bool:
    """True while ``sig`` is sent to ``pid`` but not yet delivered (``/proc``'s pending
    masks: a second signal sent meanwhile would be merged with it)."""
    bit = 1 << (sig - 1)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit:
            return True
    return False


def send_burst(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    """``sig`` twice, the second as soon as the first is delivered (milliseconds apart: a
    ``timeout`` forwarding its signal while a supervisor's ``pkill`` sends its own)."""
    proc.send_signal(sig)
    wait_until(lambda: not pending(proc.pid, sig), interval=0.001)
    proc.send_signal(sig)


def wait_past_repeat_window(since: float) -> None:
    """Return once more than ``REPEAT_WINDOW_S`` has passed since ``since`` (``time.monotonic``,
    taken after the process logged that it took the first signal)."""
    wait_until(lambda: time.monotonic() - since > REPEAT_WINDOW_S, timeout=REPEAT_WINDOW_S + 30)


def assert_stopped_in_order(log: str, stopped: str) -> None:
    """``log`` shows a burst taken as one request: the repeat noted, no forced exit, and the
    ordered shutdown's last line ``stopped``."""
    assert "a repeated stop signal" in log and "the same request" in log, log
    assert "exiting now" not in log, log
    assert stopped in log, log
