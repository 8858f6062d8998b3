"""An SSD directory's own files beside its data files: the lock (one daemon per directory), the
FORMAT file, the O_DIRECT probe and the saved namespace specs.

Runs on the daemon's I/O threads, owned by a :class:`~kvserver.ssd.store.SlotStore` (which
holds the data files). :meth:`SsdDirectory.open` and :meth:`SsdDirectory.close` run alone;
the namespaces file is read at start-up and replaced by one save at a time (the tier's
``tier_namespaces.py``). Every system call goes through :class:`~kvserver.ssd.fileio.FileIO`.

O_DIRECT: :meth:`SsdDirectory.open` probes the directory when asked (open with O_DIRECT, write
and read back one aligned block). If the filesystem refuses (EINVAL: some tmpfs, overlay and
network filesystems) the store falls back to buffered I/O through the page cache and logs it;
the format and the crash argument are the same.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any

from kvserver.errors import StorageError
from kvserver.ssd.fileio import FileIO, aligned_buffer, storage_error
from kvserver.ssd.format import (
    BLOCK,
    FORMAT_FILE,
    LOCK_FILE,
    NAMESPACES_FILE,
    PROBE_FILE,
    check_format_file,
    decode_namespaces,
    encode_format_file,
    encode_namespaces,
)

logger = logging.getLogger(__name__)


class SsdDirectory:
    """One SSD directory, locked while open. Invariant: ``locked`` iff the LOCK file's
    descriptor is held (and with it the ``flock``)."""

    def __init__(self, path: str, io: FileIO) -> None:
        self.path = path
        self.io = io
        self._lock_fd = -1

    @property
    def locked(self) -> bool:
        return self._lock_fd >= 0

    def open(self, want_direct: bool) -> bool:
        """Create and lock the directory, check its format; returns whether O_DIRECT works
        there (probed only when ``want_direct``). Raises StorageError (with path and errno) if
        the directory cannot be used; then nothing stays open."""
        io, d = self.io, self.path
        try:
            io.makedirs(d)
            self._lock_fd = io.open(os.path.join(d, LOCK_FILE), os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise storage_error("cannot open the SSD directory", exc, d) from None
        try:
            io.lock(self._lock_fd)
        except BlockingIOError:  # EWOULDBLOCK: another open file holds the lock
            holder = self._lock_holder()
            self.close()
            raise StorageError(
                f"SSD directory is in use by another daemon{holder}: stop it, or give this one "
                "another --ssd-dir",
                path=d,
            ) from None
        except OSError as exc:  # ENOLCK (a network filesystem without locks) ...: not "in use"
            self.close()
            raise storage_error("cannot lock the SSD directory", exc, d) from None
        try:
            # who holds it, for the next daemon refused here (the lock, not this, decides)
            io.truncate(self._lock_fd, 0)
            io.pwrite(self._lock_fd, memoryview(f"{os.getpid()}\n".encode()), 0)
        except OSError:
            pass
        try:
            self._check_format()
            return want_direct and self._probe_direct()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the lock. Idempotent."""
        if self._lock_fd >= 0:
            self.io.close(self._lock_fd)
            self._lock_fd = -1

    def lost(self) -> str:
        """Why the path no longer leads to the directory this one opened (removed, renamed or
        replaced by another while open: its LOCK file is not the one locked), or "" when it
        does (or when not open). The open files stay usable, but what is written to them is
        gone at the next start. Raises StorageError (path, errno) if the check itself fails."""
        if self._lock_fd < 0:
            return ""
        path = os.path.join(self.path, LOCK_FILE)
        try:
            if self.io.same_file(self._lock_fd, path):
                return ""
        except OSError as exc:
            raise storage_error("cannot check the SSD directory", exc, self.path) from None
        return (
            f"the SSD directory {self.path} (or its LOCK file) was removed, renamed or replaced "
            "while in use: "
            "write-downs stopped (they would be lost at the next start); the chunks already on "
            "SSD are served until a restart, which starts with what is then at that path"
        )

    def load_namespaces(self) -> list[dict[str, Any]]:
        """The namespace specs saved with the data ([] if none were saved yet). Raises
        StorageError (with the path) if the file cannot be read or is damaged: the tier then
        stays unavailable, keeping the chunks that need it."""
        path = os.path.join(self.path, NAMESPACES_FILE)
        try:
            return decode_namespaces(self.io.read_file(path))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise storage_error("cannot read the namespaces file", exc, path) from None
        except StorageError:
            raise StorageError(
                "damaged namespaces file (not the JSON this version writes): the SSD tier "
                "stays unavailable so its chunks are kept; move the file away to start the "
                "tier without them (they are then discarded)",
                path=path,
            ) from None

    def save_namespaces(self, specs: list[dict[str, Any]]) -> None:
        """Replace the namespaces file atomically (temp + fsync + rename + fsync dir)."""
        path = os.path.join(self.path, NAMESPACES_FILE)
        try:
            self.io.write_file_atomic(path, encode_namespaces(specs))
        except OSError as exc:
            raise storage_error("cannot write the namespaces file", exc, path) from None

    def _lock_holder(self) -> str:
        """`` (pid N)`` of the daemon that wrote the LOCK file (its pid on its host), or "" when
        it says nothing readable."""
        try:
            text = self.io.read_file(os.path.join(self.path, LOCK_FILE))
        except OSError:
            return ""
        pid = text.decode("ascii", "replace").strip()
        return f" (pid {pid})" if pid.isdigit() else ""

    def _check_format(self) -> None:
        path = os.path.join(self.path, FORMAT_FILE)
        try:
            check_format_file(self.io.read_file(path))
            return
        except StorageError as exc:  # name the file
            raise StorageError(exc.message, path=path, **exc.context) from None
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error("cannot read the FORMAT file", exc, path) from None
        try:
            self.io.write_file_atomic(path, encode_format_file())
        except OSError as exc:
            raise storage_error("cannot write the FORMAT file", exc, path) from None

    def _probe_direct(self) -> bool:
        """True if O_DIRECT works here (aligned write + read back of one block). On a full
        disk (ENOSPC, EDQUOT: the probe cannot be written) an aligned O_DIRECT read of the
        LOCK file decides instead, so a restart on a full disk still serves its chunks."""
        io, path = self.io, os.path.join(self.path, PROBE_FILE)
        if not io.O_DIRECT:
            return False
        try:
            fd = io.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | io.O_DIRECT)
        except OSError as exc:
            if exc.errno in _FULL:
                return self._probe_direct_read()
            if exc.errno != errno.EINVAL:
                raise storage_error("cannot create a file in the SSD directory", exc, path) from exc
            logger.info("O_DIRECT refused by the filesystem of %s: buffered I/O", self.path)
            return False
        try:
            buf = aligned_buffer(BLOCK)
            buf[:8] = b"kvprobe!"
            io.pwrite(fd, buf, 0)
            back = aligned_buffer(BLOCK)
            io.pread_into(fd, back, 0)
            ok = bytes(back[:8]) == b"kvprobe!"
        except OSError as exc:
            if exc.errno in _FULL:
                ok = self._probe_direct_read()
            elif exc.errno != errno.EINVAL:
                raise storage_error("cannot write to the SSD directory", exc, path) from None
            else:
                logger.info("O_DIRECT I/O fails on %s (EINVAL): buffered I/O", self.path)
                ok = False
        finally:
            io.close(fd)
            with contextlib.suppress(OSError):
                io.unlink(path)
        return ok

    def _probe_direct_read(self) -> bool:
        """The probe on a full disk: an aligned O_DIRECT read of the LOCK file."""
        io, path = self.io, os.path.join(self.path, LOCK_FILE)
        logger.warning("SSD directory %s: the disk is full; O_DIRECT probed by a read", self.path)
        try:
            fd = io.open(path, os.O_RDONLY | io.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise storage_error("cannot open the LOCK file", exc, path) from None
            return False
        try:
            io.pread_into(fd, aligned_buffer(BLOCK), 0)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise storage_error("cannot read the LOCK file", exc, path) from None
            return False
        finally:
            io.close(fd)


#: errnos of a full disk (no room to write the probe)
_FULL = (errno.ENOSPC, errno.EDQUOT)
