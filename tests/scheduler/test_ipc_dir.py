"""The scheduler's private temp directory (``scheduler/ipc_dir.py``): a scheduler killed with
SIGKILL leaves it, the next scheduler's start removes it, and a live scheduler's is left alone.
Before: ``tempfile.mkdtemp(prefix="kvserver-sched-")``, removed only in ``serve``'s
``finally``, so every SIGKILLed scheduler left one for ever (329 of them in this machine's
/tmp after a few test runs), and a scheduler without synthetic workers made one for nothing.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.ipc_dir import PREFIX, IpcDir, reap_stale_ipc_dirs
from tests.scheduler.procs import Proc, start_scheduler
from tests.support.daemon import wait_until


def test_the_directory_is_private_named_by_its_pid_and_removed_on_close(tmp_path: Path) -> None:
    with IpcDir(str(tmp_path)) as ipc:
        path = Path(ipc.path)
        assert path.parent == tmp_path and path.name.startswith(f"{PREFIX}{os.getpid()}-")
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        (path / "worker-0.sock").write_bytes(b"")
        assert list(tmp_path.iterdir()) == [path]  # no staging name left
    assert list(tmp_path.iterdir()) == []
    ipc.close()  # idempotent


def test_only_this_users_unlocked_directories_of_its_name_are_reaped(tmp_path: Path) -> None:
    """A dead owner's directory (no lock: made by hand, or its pid reused by a live process
    such as this one) goes with its contents; a live owner's, other names, a file or a
    symlink of its name (its target untouched) stay."""
    dead = tmp_path / f"{PREFIX}{os.getpid()}-abc123"  # a live pid: the lock decides
    dead.mkdir()
    (dead / "worker-0.sock").write_bytes(b"")
    other = tmp_path / f"{PREFIX}notapid-x"
    other.mkdir()
    staging = tmp_path / f".{PREFIX}1-x"  # another scheduler between mkdtemp and its lock
    staging.mkdir()
    file = tmp_path / f"{PREFIX}1-file"
    file.write_bytes(b"")
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / f"{PREFIX}1-link").symlink_to(target)
    with IpcDir(str(tmp_path)) as live:
        assert reap_stale_ipc_dirs(str(tmp_path)) == [str(dead)]
        assert Path(live.path).is_dir() and not dead.exists()
        assert other.is_dir() and staging.is_dir() and file.exists() and target.is_dir()
        assert reap_stale_ipc_dirs(str(tmp_path)) == []
    assert reap_stale_ipc_dirs(str(tmp_path / "missing")) == []


def ipc_dir_of(sched: Proc) -> Path:
    return Path(sched.info["workers"][0].removeprefix("ipc://")).parent


@pytest.mark.multiprocess
def test_a_sigkilled_schedulers_directory_is_removed_by_the_next_and_a_live_ones_kept(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Three real schedulers with synthetic workers, one after the other: the first killed
    (SIGKILL), the second removes its directory at start, the third leaves the second's."""
    # the schedulers' tempfile directory, short (an ipc:// path has at most 107 bytes, which
    # tmp_path/NAME/kvserver-sched-PID-RANDOM/w0.sock may pass)
    own_tmp = tmp_path_factory.mktemp("k")
    env = {**os.environ, "TMPDIR": str(own_tmp)}
    synthetic = ("--synthetic-workers", "1", "--num-gpu-blocks", "64", "--block-size", "16")
    killed = start_scheduler(tmp_path, *synthetic, env=env)
    left = ipc_dir_of(killed)
    assert left.parent == own_tmp and left.name.startswith(f"{PREFIX}{killed.proc.pid}-")
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(60)
    assert left.is_dir()  # SIGKILL runs no finally
    live = start_scheduler(tmp_path, *synthetic, env=env)
    try:
        mine = ipc_dir_of(live)
        assert not left.exists() and mine.is_dir()
        assert "removed 1 temporary directories left by schedulers" in live.log()
        third = start_scheduler(tmp_path, *synthetic, env=env)
        try:
            assert mine.is_dir()  # a live scheduler's is kept
        finally:
            assert third.terminate() == 0, third.log()
    finally:
        assert live.terminate() == 0, live.log()
    wait_until(lambda: list(own_tmp.iterdir()) == [], timeout=30)


@pytest.mark.multiprocess
def test_a_temp_dir_too_long_for_a_unix_socket_is_one_error_line_at_once(tmp_path: Path) -> None:
    """Was: the synthetic workers could not bind, and the scheduler waited out its 30 s
    --hello-timeout-s for them before failing."""
    long_tmp = tmp_path / ("x" * 100)
    long_tmp.mkdir()
    args = [
        sys.executable, "-m", "kvserver.cli", "scheduler", "--host", "127.0.0.1",
        "--grpc-port", "0", "--metrics-port", "-1", "--synthetic-workers", "1",
        "--hello-timeout-s", "600",
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TMPDIR": str(long_tmp)})  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "kvserver scheduler: error: the synthetic workers' socket path" in result.stderr
    assert "point TMPDIR at a shorter directory" in result.stderr
    assert list(long_tmp.iterdir()) == []
