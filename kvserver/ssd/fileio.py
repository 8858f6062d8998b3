"""The operating-system interface of the SSD tier, and page-aligned buffers.

Every system call the tier makes goes through one :class:`FileIO` object, so tests subclass it
to inject faults (ENOSPC on the nth write, EIO on reads, a torn write that stops halfway) and
recovery paths run without a broken disk. Methods raise :class:`OSError` exactly like ``os``;
the store wraps them in :class:`~kvserver.errors.StorageError` with the path and errno
(:func:`storage_error`).

Thread-safety: stateless; safe from any thread (pread/pwrite on shared descriptors are
positional). Buffers from :func:`aligned_buffer` are anonymous mmaps, hence page aligned as
O_DIRECT requires; they are freed when the last reference goes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from typing import Any

from kvserver.errors import StorageError

_libc: Any = None
#: fallocate(2) mode bits (linux/falloc.h)
_KEEP_SIZE = 0x01
_PUNCH_HOLE = 0x02


def _fallocate() -> Any:
    """libc's fallocate(2), or None where there is none."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
    fn = getattr(_libc, "fallocate", None) if _libc else None
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        fn.restype = ctypes.c_int
    return fn


def storage_error(what: str, exc: OSError, path: str) -> StorageError:
    """``exc`` as a StorageError carrying the path, errno and its symbolic name."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, str(code))
    return StorageError(f"{what}: {exc.strerror or exc} ({name})", path=path, errno=code)


def aligned_buffer(nbytes: int) -> memoryview:
    """A zeroed, page-aligned, writable buffer of ``nbytes`` (an anonymous mmap)."""
    return memoryview(mmap.mmap(-1, nbytes))


class FileIO:
    """Thin wrappers over ``os``; see the module docstring. Subclass to inject faults."""

    #: O_DIRECT where the platform has it (0 elsewhere: buffered only).
    O_DIRECT: int = getattr(os, "O_DIRECT", 0)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset`` into ``buf``; returns the count."""
        return os.preadv(fd, [buf], offset)

    def preadv_into(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        """Read into ``bufs`` back to back from ``offset`` in one system call; the count."""
        return os.preadv(fd, bufs, offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.pwrite(fd, buf, offset)

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        """Write ``bufs`` back to back at ``offset`` in one system call; returns the count."""
        return os.pwritev(fd, bufs, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def seek_data(self, fd: int, offset: int) -> int | None:
        """The next offset >= ``offset`` holding data (skips holes), None at the end."""
        try:
            return os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return None
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return offset if offset < self.size(fd) else None
            raise

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def allocate(self, fd: int, offset: int, length: int) -> bool:
        """Reserve disk blocks for ``[offset, offset+length)`` (fallocate mode 0: the file
        grows; reads return zeros). False if the filesystem cannot (the caller goes on
        without); OSError (ENOSPC, EFBIG ...) if there is no room."""
        fn = _fallocate()
        if fn is None:
            return False
        if fn(fd, 0, offset, length) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(err, os.strerror(err))

    def punch(self, fd: int, offset: int, length: int) -> bool:
        """Return the disk blocks of ``[offset, offset+length)`` to the filesystem, the file's
        size unchanged (fallocate ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``): the range
        then reads as zeros. False if the filesystem (or platform) cannot; OSError otherwise."""
        fn = _fallocate()
        if fn is None:
            return False
        if fn(fd, _PUNCH_HOLE | _KEEP_SIZE, offset, length) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(err, os.strerror(err))

    def same_file(self, fd: int, path: str) -> bool:
        """Whether ``path`` names the file open as ``fd`` (same device and inode); False when
        ``path`` no longer exists (removed, or its directory renamed)."""
        try:
            there = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        here = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)

    def lock(self, fd: int) -> None:
        """Exclusive advisory lock, non-blocking (BlockingIOError if another process holds it).

        Released by the kernel when the process dies, so a SIGKILLed daemon leaves none."""
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_file_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` all-or-nothing: temp file, fsync, rename, fsync dir."""
        directory = os.path.dirname(path) or "."
        tmp = f"{path}.tmp"
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(data)
            while view:
                view = view[self.pwrite(fd, view, len(data) - len(view)) :]
            self.fsync(fd)
        finally:
            self.close(fd)
        os.replace(tmp, path)
        dfd = self.open(directory, os.O_RDONLY)
        try:
            self.fsync(dfd)
        finally:
            self.close(dfd)

    def unlink(self, path: str) -> None:
        os.unlink(path)
