"""The check for processes a test module leaves running (tests/support/leaks.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from tests.support.daemon import wait_until
from tests.support.leaks import running_children, stop_leftovers

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_a_child_left_running_is_found_stopped_and_named() -> None:
    proc = subprocess.Popen(SLEEPER)
    try:
        assert running_children()[proc.pid].endswith("import time; time.sleep(120)")
        left = stop_leftovers()
        assert proc.pid in left
        assert proc.wait(10) == -9  # SIGKILLed
        assert proc.pid not in running_children() and stop_leftovers() == {}
    finally:
        proc.kill()
        proc.wait(10)


def test_a_child_that_exited_is_no_leftover_even_before_it_is_reaped() -> None:
    """A zombie holds nothing: it is its Popen's to reap, not stopped or named."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_until(lambda: proc.pid not in running_children())
        assert proc.pid not in stop_leftovers()
        assert proc.wait(10) == 0  # still reapable, with its own exit status
    finally:
        proc.kill()
        proc.wait(10)


def test_only_this_processs_children_are_seen() -> None:
    """A grandchild is its parent's: stopping the child is enough to stop the tree here."""
    code = f"import subprocess; subprocess.run({SLEEPER!r})"
    proc = subprocess.Popen([sys.executable, "-c", code])
    grandchildren: list[int] = []
    try:
        grandchildren = wait_until(lambda: list(running_children(proc.pid)))
        assert not set(grandchildren) & set(running_children())
        assert proc.pid in running_children()
    finally:
        proc.kill()
        proc.wait(10)
        for pid in grandchildren:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_multiprocessings_own_helper_is_no_leftover() -> None:
    """Its resource tracker serves this process until it exits (torch's mp.spawn starts it)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    tracker = [pid for pid, cmd in running_children().items() if "resource_tracker" in cmd]
    assert tracker, running_children()
    assert not set(tracker) & set(stop_leftovers())
    assert set(tracker) <= set(running_children())  # not killed either
