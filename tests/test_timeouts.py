"""The suite's bound on one test (pyproject.toml: pytest-timeout, 600 s, method ``signal``) and
the watchdog behind it (tests/support/timeouts.py), each checked on a pytest run of its own over
a test file written here, with short bounds given by markers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest (this checkout's configuration, the watchdog's plugin) on ``source``."""
    test_file = tmp_path / "test_bounded.py"
    test_file.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
         "-p", "tests.support.timeouts", "-p", "no:cacheprovider", str(test_file), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_every_test_is_bounded_at_600_s_by_the_signal_method(tmp_path: Path) -> None:
    run = run_pytest(tmp_path, "def test_nothing() -> None:\n    pass\n")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "timeout: 600.0s" in run.stdout and "timeout method: signal" in run.stdout


def test_a_hung_test_fails_with_every_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    """Hung in a child process's wait (the suite's usual hang) with a thread of its own
    waiting too: the test fails at its bound (a marker's, 2 s), the stacks say where each
    thread was, the child is gone, and the next test runs."""
    run = run_pytest(
        tmp_path,
        """
        import subprocess
        import threading

        import pytest

        @pytest.mark.timeout(2)
        def test_hung_on_a_child() -> None:
            never = threading.Event()
            threading.Thread(target=never.wait, name="idle-helper", daemon=True).start()
            subprocess.run(["sleep", "600"])

        def test_after() -> None:
            pass
        """,
    )
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "Timeout (>2.0s) from pytest-timeout" in out
    assert "Stack of idle-helper" in out  # the other thread's stack
    assert 'subprocess.run(["sleep", "600"])' in out  # where the test was: its traceback
    assert "1 failed, 1 passed" in out


def test_a_test_that_outlives_its_failure_ends_the_run_with_every_stack(tmp_path: Path) -> None:
    """A test that swallows the timeout's failure (a catch-all) and goes on waiting: the
    watchdog ends the run at 1.5 x its bound (2 s: 3 s) with every thread's stack on stderr,
    instead of the run hanging."""
    run = run_pytest(
        tmp_path,
        """
        import time

        import pytest

        @pytest.mark.timeout(2)
        def test_swallows_its_timeout() -> None:
            try:
                time.sleep(600)
            except BaseException:
                time.sleep(600)

        def test_never_reached() -> None:
            pass
        """,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Timeout (0:00:03)!" in run.stderr, run.stderr
    assert "in test_swallows_its_timeout" in run.stderr
    assert "passed" not in run.stdout
