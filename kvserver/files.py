"""Small file helpers shared by the processes (no project state, no I/O beyond the call).

``write_atomic`` replaces a file all at once: readers see the old content or the new, never a
part (ready files, announcement files). It does not fsync: for data that must survive a power
loss use the SSD tier's ``FileIO.write_file_atomic`` (through its fault-injection seam).

``check_writable`` probes, at start-up, that ``write_atomic`` will be able to write a ready
file (its directory exists and is writable, it is not a directory).

``read_limited`` reads a file an operator names (a config file) with a bound on its bytes and,
for what is not a regular file (a FIFO, a device, a pipe), on the wait: ``--config /dev/zero``
read without end, and a FIFO nobody writes blocked the start for ever.

``remove_if_unheld`` removes a file or directory a process of this user made and locked for
its lifetime once no process holds that lock any more (it died without cleaning up: SIGKILL,
OOM): the token files, the scheduler's socket directory, a dead daemon's arena file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import stat
import time
from collections.abc import Callable

from kvserver.errors import KVServerError

#: how long ``read_limited`` waits for the end of what is not a regular file, by default.
READ_WAIT_S = 10.0


class TooLarge(OSError):
    """``read_limited``: the file holds more than the limit."""


def read_limited(path: str, max_bytes: int, wait_s: float = READ_WAIT_S) -> bytes:
    """The bytes of ``path``, at most ``max_bytes`` of them. A regular file is read at once; a
    FIFO, pipe or device must reach its end within ``wait_s`` (``open`` does not wait for a
    FIFO's writer). Raises TooLarge past ``max_bytes``, TimeoutError past ``wait_s``, OSError
    (with the path) when it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            os.set_blocking(fd, True)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + wait_s
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            if not regular:  # a FIFO with no writer yet polls as nothing (not as its end)
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                    raise TimeoutError(
                        f"no end of file within {wait_s:g} s (a FIFO or device nobody writes?)"
                    )
            try:
                chunk = os.read(fd, min(1 << 16, max_bytes + 1 - size))
            except BlockingIOError:
                continue
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise TooLarge(f"{path} is larger than {max_bytes} bytes")
    finally:
        os.close(fd)


def check_writable(path: str, flag: str) -> None:
    """Raise KVServerError naming ``flag`` unless a file can be made beside ``path`` (as
    ``kvserver.files.write_atomic`` will); the probe file is removed."""
    if os.path.isdir(path):  # the probe beside it would pass; the rename over it would not
        raise KVServerError(f"cannot write {flag} {path}: it is a directory; name a file")
    probe = f"{path}.tmp{os.getpid()}"
    try:
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise KVServerError(
            f"cannot write {flag} {path}: {exc.strerror or exc} (its directory must exist and "
            "be writable by this user)"
        ) from None


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (unique to this process), then rename
    it over ``path``. Raises OSError; the temporary file is removed on failure."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_if_unheld(
    path: str, flags: int, remove: Callable[[str], None], is_kind: Callable[[int], bool]
) -> bool:
    """Remove ``path`` with ``remove`` if it is this user's, of the kind ``is_kind`` accepts
    (its ``st_mode``), and no process holds its ``flock`` (opened with ``os.O_RDONLY``,
    ``O_NOFOLLOW`` and ``O_CLOEXEC`` besides ``flags``: a symlink is never followed); the lock
    is taken while it is removed, and nothing is removed if ``path`` was replaced meanwhile
    (another inode). Returns whether it was removed; any OSError leaves it alone (False)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags)
    except OSError:  # gone meanwhile, a symlink, not of the kind opened
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not is_kind(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner is running
        if os.lstat(path).st_ino != st.st_ino:
            return False  # replaced meanwhile
        remove(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
