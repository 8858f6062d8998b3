"""The backstop behind the suite's bound on a test: a pytest plugin (tests/conftest.py loads it;
``-p tests.support.timeouts`` elsewhere).

Every test is bounded by pytest-timeout (pyproject.toml: ``timeout``, 600 s; a test or module
that needs longer says ``@pytest.mark.timeout(SECONDS)``), method ``signal``: SIGALRM fails the
test where it is, with every thread's stack, and the run goes on. Not the ``thread`` method,
which ends the whole run at the first hung test (no later test runs, no fixture tears down its
daemons, no report). But a signal cannot end everything: a test that swallows the failure
(``except BaseException``), a thread stuck in C code that never returns to Python, a teardown
that hangs after the failure. So each test also arms faulthandler's watchdog (a C thread) at
:data:`HARD_FACTOR` times its bound: it writes every thread's stack to the run's stderr and
ends the run (exit 1), and a hung test cannot hold CI for its 90 minutes.

Covers the whole test (setup, call, teardown), as pytest-timeout does. A bound of 0 (``-p
no:timeout``, ``--timeout 0``) arms nothing. pytest's own ``faulthandler_timeout`` shares the
one watchdog: do not set both.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Generator

import pytest

#: the watchdog fires at this multiple of the test's bound
HARD_FACTOR = 1.5

_STDERR = pytest.StashKey[int]()


def bound_of(item: pytest.Item) -> float:
    """The test's bound in seconds as pytest-timeout reads it: its ``timeout`` marker, else
    ``--timeout``, else the ``timeout`` setting; 0 for none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        return float(value or 0)
    try:
        value = item.config.getoption("timeout")
        if value is None:
            value = item.config.getini("timeout")
    except ValueError:  # pytest-timeout is not loaded (-p no:timeout): nothing is bounded
        return 0.0
    return float(value or 0)


def pytest_configure(config: pytest.Config) -> None:
    # the run's stderr (capturing is suspended now; during a test fd 2 is the capture file,
    # which the exit would lose)
    config.stash[_STDERR] = os.dup(2)


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = config.stash.get(_STDERR, None)
    if fd is not None:
        os.close(fd)
        del config.stash[_STDERR]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    bound = bound_of(item)
    if bound <= 0:
        return (yield)
    faulthandler.dump_traceback_later(
        bound * HARD_FACTOR, exit=True, file=item.config.stash[_STDERR]
    )
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
