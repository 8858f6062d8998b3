"""Fault injection for the SSD tier through its OS seam (kvserver.ssd.fileio.FileIO)."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from kvserver.ssd.fileio import FileIO


class Crash(Exception):
    """Stands for the process dying at this point (nothing after it runs)."""


class FaultyIO(FileIO):
    """Counts I/O and injects faults on demand."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.reads = 0  # read system calls (pread_into + preadv_into)
        self.writes = 0  # write system calls (pwrite + pwritev)
        #: raise this errno on the next pwrite (one-shot unless ``sticky``)
        self.write_errno: int | None = None
        self.sticky = False
        #: crash (raise Crash) on write number N (1-based), after writing ``torn`` bytes
        self.crash_on_write: int | None = None
        self.torn = 0
        self.read_errno: int | None = None
        self.no_direct = False
        #: fail opening paths under this directory (an unwritable / missing directory)
        self.deny_dir: str | None = None
        #: raise this errno from every allocation (a full filesystem)
        self.allocate_errno: int | None = None
        self.allocations = 0

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self.no_direct and flags & self.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        if self.deny_dir is not None and path.startswith(self.deny_dir):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return super().open(path, flags, mode)

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        self._before_read()
        n = super().pread_into(fd, buf, offset)
        self.bytes_read += n
        return n

    def preadv_into(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        self._before_read()
        n = super().preadv_into(fd, bufs, offset)
        self.bytes_read += n
        return n

    def _before_read(self) -> None:
        self.reads += 1
        if self.read_errno is not None:
            raise OSError(self.read_errno, os.strerror(self.read_errno))

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        self._before_write(fd, [buf], offset)
        return super().pwrite(fd, buf, offset)

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        """Counts as one write (one system call), like :meth:`pwrite`."""
        self._before_write(fd, bufs, offset)
        return super().pwritev(fd, bufs, offset)

    def _before_write(self, fd: int, bufs: Sequence[memoryview], offset: int) -> None:
        self.writes += 1
        if self.write_errno is not None:
            code = self.write_errno
            if not self.sticky:
                self.write_errno = None
            raise OSError(code, os.strerror(code))
        if self.crash_on_write == self.writes:
            if self.torn:  # only the first bytes reach the file (any length: not O_DIRECT)
                plain = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
                try:
                    os.pwrite(plain, b"".join(bytes(b) for b in bufs)[: self.torn], offset)
                finally:
                    os.close(plain)
            raise Crash

    def allocate(self, fd: int, offset: int, length: int) -> bool:
        self.allocations += 1
        if self.allocate_errno is not None:
            raise OSError(self.allocate_errno, os.strerror(self.allocate_errno))
        return super().allocate(fd, offset, length)
