"""kvserver/daemon/malloc.py: the glibc allocator settings, in the daemon and on their own.

The settings take effect (a fresh process: a 1 MiB allocation is an mmap with glibc's defaults
and a heap block once tuned, as ``mallinfo2`` counts them); the daemon applies them at start-up
unless told not to (flag, environment), and says so in its ready file; the config parses the
switch.

Child process: ``python -m tests.kvserver.daemon.test_malloc mmapped {tuned|default}``.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.malloc import is_glibc
from kvserver.errors import InvalidArgument
from tests.support.daemon import start_daemon

REPO = Path(__file__).resolve().parents[3]
glibc_only = pytest.mark.skipif(not is_glibc(), reason="mallopt settings exist in glibc only")


_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2.split()]


def child_mmapped(mode: str) -> None:
    """Print how many mmapped blocks one 1 MiB malloc added (after tuning when ``tuned``)."""
    from kvserver.daemon.malloc import tune_malloc

    if mode == "tuned":
        assert tune_malloc()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    before = libc.mallinfo2().hblks
    block = libc.malloc(1 << 20)
    after = libc.mallinfo2().hblks
    libc.free(block)
    print(after - before)


def mmapped_blocks(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "tests.kvserver.daemon.test_malloc", "mmapped", mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@glibc_only
def test_settings_keep_large_blocks_on_the_heap() -> None:
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert mmapped_blocks("default") == 1
    assert mmapped_blocks("tuned") == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "extra, env, tuned",
    [
        ((), {}, is_glibc()),
        (("--no-tune-malloc",), {}, False),
        ((), {"KVSERVER_TUNE_MALLOC": "off"}, False),
    ],
    ids=["default", "flag-off", "env-off"],
)
def test_daemon_applies_the_settings_unless_told_not_to(
    tmp_path: Path, extra: tuple[str, ...], env: dict[str, str], tuned: bool
) -> None:
    d = start_daemon(tmp_path, "--dram", "4MiB", *extra, env=env)
    try:
        assert d.info["malloc_tuned"] is tuned
    finally:
        assert d.terminate() == 0, d.log()


def test_config_switches() -> None:
    assert DaemonConfig().tune_malloc is True
    for text, value in (("0", False), ("off", False), ("YES", True), ("true", True)):
        assert DaemonConfig.load(env={"KVSERVER_TUNE_MALLOC": text}).tune_malloc is value
    with pytest.raises(InvalidArgument, match="true or false"):
        DaemonConfig.load(env={"KVSERVER_TUNE_MALLOC": "maybe"})
    assert DaemonConfig.load(env={"KVSERVER_SSD_PROMOTIONS": "2"}).ssd_promotions == 2
    with pytest.raises(InvalidArgument, match="ssd_promotions"):
        DaemonConfig.load(env={}, overrides={"ssd_promotions": 0})


if __name__ == "__main__":
    if sys.argv[1] == "mmapped":
        child_mmapped(sys.argv[2])
    else:
        raise SystemExit(f"unknown child {sys.argv[1]}")
