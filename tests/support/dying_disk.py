"""``python -m tests.support.dying_disk start ...``: ``kvserver start`` that SIGKILLs itself in
the middle of its Nth change to an SSD data file (a crash at an instant a test cannot hit from
outside; the daemon and the kill are otherwise the real ones).

``DYING_DISK_AT=N`` (1-based): the Nth ``pwrite``/``pwritev``/``ftruncate``/punch on a
``slots-*.dat`` descriptor (``kvserver.ssd.fileio.FileIO``, its fault-injection seam) writes
part of its bytes and then kills the process: a torn write. ``DYING_DISK_TORN=B`` (default
100): the first B bytes (``DYING_DISK_TEAR=head``, the default) or all but them (``tail``: the
kernel gives no order among the bytes of one write). Use buffered I/O (``KVSERVER_SSD_DIRECT=
off``) so a tear may fall inside a block. Unset ``DYING_DISK_AT``: no kill. Changes to other
files (LOCK, FORMAT, namespaces.json) are not counted.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvserver.ssd.fileio import FileIO

_lock = threading.Lock()
_data_fds: set[int] = set()
_count = [0]
_AT = int(os.environ.get("DYING_DISK_AT", "0"))
_TORN = int(os.environ.get("DYING_DISK_TORN", "100"))
_TAIL = os.environ.get("DYING_DISK_TEAR", "head") == "tail"


def _die_now(fd: int) -> bool:
    """Whether this change (to ``fd``) is the one to die in."""
    with _lock:
        if fd not in _data_fds or not _AT:
            return False
        _count[0] += 1
        return _count[0] == _AT


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _torn(bufs: Sequence[memoryview], offset: int) -> tuple[list[memoryview], int]:
    """The part of a write of ``bufs`` at ``offset`` that lands before the kill."""
    flat = b"".join(bytes(b) for b in bufs)
    if _TAIL:
        return [memoryview(flat[_TORN:])], offset + _TORN
    return [memoryview(flat[:_TORN])], offset


def main() -> int:
    real_open, real_close = FileIO.open, FileIO.close
    real_pwrite, real_pwritev = FileIO.pwrite, FileIO.pwritev
    real_truncate, real_punch = FileIO.truncate, FileIO.punch

    def opened(self: FileIO, path: str, flags: int, mode: int = 0o600) -> int:
        fd = real_open(self, path, flags, mode)
        if os.path.basename(path).startswith("slots-"):
            with _lock:
                _data_fds.add(fd)
        return fd

    def closed(self: FileIO, fd: int) -> None:
        with _lock:
            _data_fds.discard(fd)
        real_close(self, fd)

    def pwrite(self: FileIO, fd: int, buf: memoryview, offset: int) -> int:
        if _die_now(fd):
            part, at = _torn([buf], offset)
            real_pwritev(self, fd, part, at)
            _die()
        return real_pwrite(self, fd, buf, offset)

    def pwritev(self: FileIO, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        if _die_now(fd):
            part, at = _torn(bufs, offset)
            real_pwritev(self, fd, part, at)
            _die()
        return real_pwritev(self, fd, bufs, offset)

    def truncate(self: FileIO, fd: int, size: int) -> None:
        if _die_now(fd):
            _die()
        real_truncate(self, fd, size)

    def punch(self: FileIO, fd: int, offset: int, length: int) -> bool:
        if _die_now(fd):
            _die()
        return real_punch(self, fd, offset, length)

    patches: dict[str, Any] = {
        "open": opened, "close": closed, "pwrite": pwrite, "pwritev": pwritev,
        "truncate": truncate, "punch": punch,
    }  # fmt: skip
    for name, fn in patches.items():
        setattr(FileIO, name, fn)
    from kvserver.cli import main as kvserver_main

    return kvserver_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
