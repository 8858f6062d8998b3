"""The shared-memory DRAM arena.

One file in a tmpfs directory (``/dev/shm`` by default) mapped by the daemon and by co-located
clients, who move payload bytes themselves (reserve → write → commit; pin → read → release), so
the daemon never copies payload on that path.

Security: the file is created with ``O_EXCL`` and mode 0600, so only the daemon's user can map
it; it is unlinked on :meth:`SharedArena.close` (and the daemon closes it on every orderly
shutdown path). The daemon holds an exclusive ``flock`` on it while it lives, so that
:func:`reap_stale_arenas` removes only the arenas of daemons that died.

Thread-safety: mapping and unmapping are not thread-safe; reads and writes of disjoint extents
from several threads are (they are plain memcpy).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from types import TracebackType

from kvserver.allocator import Extents
from kvserver.errors import InvalidArgument, StorageError
from kvserver.files import remove_if_unheld

DEFAULT_SHM_DIR = "/dev/shm"


class ArenaView:
    """A mapping of an arena file: byte access by extents. Base of the owner and client sides."""

    def __init__(self, path: str, size: int, fd: int, *, populate: bool = True) -> None:
        self.path = path
        self.size = size
        self._fd = fd
        # MAP_POPULATE pre-faults the whole mapping: the first copy into a fresh mapping
        # otherwise pays a page fault per 4 KiB page (measured ~6x slower than memcpy); for the
        # daemon it also commits the tier's DRAM up front instead of on first use (the daemon
        # does that itself, chunk by chunk with progress: SharedArena).
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags)
        self.buf: memoryview = memoryview(self._mmap)

    @classmethod
    def attach(cls, path: str) -> ArenaView:
        """Map an existing arena (client side). The file is never unlinked by a view."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise StorageError(
                f"cannot open arena: {exc.strerror}", path=path, errno=exc.errno
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < 1:
                raise StorageError("cannot map arena: the file is empty", path=path)
            return cls(path, size, fd)
        except OSError as exc:
            os.close(fd)
            raise StorageError(
                f"cannot map arena: {exc.strerror}", path=path, errno=exc.errno
            ) from None
        except BaseException:
            os.close(fd)
            raise

    # ---------------------------------------------------------------- payload access

    def write(self, extents: Extents, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` into ``extents``. REQUIRES: len(data) == total extent length (else
        InvalidArgument, nothing written).

        One extent of a byte buffer (every part of an unfragmented arena: a remote ``put``'s
        frames) is one slice assignment, which checks the size before it copies; anything else
        (several extents, another format or shape) goes the general way, cast to bytes."""
        if len(extents) == 1:
            off, length = extents[0]
            try:
                self.buf[off : off + length] = data
            except (ValueError, TypeError):  # another size, format or shape: nothing written
                pass
            else:
                return
        src = memoryview(data).cast("B")
        if src.nbytes != sum(length for _, length in extents):
            raise InvalidArgument("payload size does not match the slot", size=src.nbytes)
        buf = self.buf
        pos = 0
        for off, length in extents:
            buf[off : off + length] = src[pos : pos + length]
            pos += length

    def read(self, extents: Extents) -> bytes:
        """A copy of the bytes in ``extents``."""
        buf = self.buf
        if len(extents) == 1:
            off, length = extents[0]
            return bytes(buf[off : off + length])
        return b"".join(buf[off : off + length] for off, length in extents)

    def readinto(self, extents: Extents, out: bytearray | memoryview) -> None:
        """Copy the bytes in ``extents`` into ``out`` (exactly their total length).

        Extents start on page boundaries: ``out`` at a 64-byte-aligned address (a tensor's
        block) copies fastest: on the machine measured (AMD EPYC, glibc 2.36; docs/benchmarks.md,
        session 14) memcpy runs ~25 % slower when the destination lies 1-63 bytes past its
        source modulo 4 KiB, as a large ``bytearray`` does (it starts 16 bytes past a page)."""
        dst = memoryview(out).cast("B")
        buf = self.buf
        pos = 0
        for off, length in extents:
            dst[pos : pos + length] = buf[off : off + length]
            pos += length

    def views(self, extents: Extents) -> list[memoryview]:
        """Zero-copy views of ``extents`` (valid while the part is pinned and the arena open)."""
        buf = self.buf
        return [buf[off : off + length] for off, length in extents]

    def views_of(self, parts: Iterable[Extents]) -> list[list[memoryview]]:
        """:meth:`views` of each of ``parts``, in order (a batch: one call, no call per part)."""
        buf = self.buf
        return [[buf[off : off + length] for off, length in extents] for extents in parts]

    # ---------------------------------------------------------------- lifetime

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap. Idempotent. Outstanding memoryviews from :meth:`views` must be released."""
        if self._mmap is None:
            return
        self.buf.release()
        # BufferError: a caller still holds a view; the mapping is freed when it is collected.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None
        os.close(self._fd)

    def __enter__(self) -> ArenaView:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


#: pre-fault step of the daemon's arena (one progress report each)
PREFAULT_STEP = 256 << 20
#: Linux madvise(2) advice "populate (prefault) page tables writable" (5.14+; not in Python 3.11)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class SharedArena(ArenaView):
    """The daemon's arena: creates the file (0600, O_EXCL) and removes it on close.

    The file is locked (``flock``, exclusive) for as long as the daemon lives: the kernel
    drops the lock when the process dies, however it dies, which is how
    :func:`reap_stale_arenas` tells a live daemon's arena from one left behind. It appears
    under its name already locked (created under a temporary name, locked, then linked).

    The whole arena is pre-faulted before the constructor returns (DRAM committed up front, no
    page fault on a first copy), :data:`PREFAULT_STEP` bytes at a time; ``progress(done,
    total)`` is called after each step (the daemon shows it: 8 GiB take tens of seconds).
    """

    def __init__(
        self,
        size: int,
        *,
        directory: str = DEFAULT_SHM_DIR,
        name: str = "",
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if size < 1:
            raise InvalidArgument("arena size must be positive", size=size)
        check_room(size, directory)
        name = name or f"kvserver-{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(directory, name)
        fd = _create_locked(path)
        try:
            os.fchmod(fd, 0o600)  # independent of the umask
            os.ftruncate(fd, size)
            super().__init__(path, size, fd, populate=False)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        try:
            self._prefault(progress)
        except BaseException:
            self.close()
            raise

    def _prefault(self, progress: Callable[[int, int], None] | None) -> None:
        """Commit the memory of each step (``posix_fallocate``: a filesystem without room
        fails it with ENOSPC, where touching a page of the mapping would kill the process with
        SIGBUS), then populate its page tables."""
        assert self._mmap is not None
        use_madvise = True
        for offset in range(0, self.size, PREFAULT_STEP):
            length = min(PREFAULT_STEP, self.size - offset)
            self._commit(offset, length)
            if use_madvise:
                try:
                    self._mmap.madvise(_MADV_POPULATE_WRITE, offset, length)
                except OSError:  # an older kernel: touch one byte per page (the file is zeros)
                    use_madvise = False
            if not use_madvise:
                page = mmap.PAGESIZE
                view = self.buf[offset : offset + length]
                view[::page] = bytes(len(range(0, length, page)))
                view.release()
            if progress is not None:
                progress(offset + length, self.size)

    def _commit(self, offset: int, length: int) -> None:
        if not hasattr(os, "posix_fallocate"):  # not on every platform (macOS): touched only
            return
        try:
            os.posix_fallocate(self._fd, offset, length)
        except OSError as exc:
            directory = os.path.dirname(self.path) or "."
            free = _free_bytes(directory) or 0
            raise _no_room(
                exc.strerror or str(exc), self.size, free, directory, path=self.path,
                errno=exc.errno,
            ) from None  # fmt: skip

    def close(self) -> None:
        """Unmap and unlink the file. Idempotent."""
        was_open = not self.closed
        super().close()
        if was_open:
            _unlink(self.path)


def check_room(size: int, directory: str = DEFAULT_SHM_DIR) -> None:
    """Raise StorageError, naming the fixes, when ``directory``'s filesystem has less than
    ``size`` bytes free: an arena that cannot fit is refused before a byte is committed (the
    pre-fault would otherwise fill the filesystem, a host's RAM when it is /dev/shm, before it
    failed), and so is a directory that does not exist. A filesystem that cannot be asked
    passes (the pre-fault's own check remains)."""
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            what, code = "is not a directory: give", errno.ENOTDIR
        else:
            what, code = "does not exist: create it (a tmpfs), or give", errno.ENOENT
        message = f"the arena's directory {directory} {what} another --shm-dir"
        raise StorageError(message, errno=code)
    free = _free_bytes(directory)
    if free is not None and free < size:
        raise _no_room("it does not fit", size, free, directory)


#: filesystems whose files are memory: an arena anywhere else is a disk file under page cache
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def not_in_memory(directory: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """What to say when ``directory`` is not on a memory filesystem (a ``--shm-dir`` given a
    data directory: the "DRAM" tier's pages written back to that disk, and read from it once
    evicted); None when it is, or where it cannot be told (no ``mountinfo``: not Linux). The
    filesystem is that of the longest mount point above the directory's real path (the last
    one mounted there)."""
    path = os.path.realpath(directory)
    found, kind = "", ""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:  # ID PARENT DEV ROOT MOUNT_POINT OPTIONS [TAGS...] - TYPE SOURCE ...
                fields, _, tail = line.partition(" - ")
                names = fields.split()
                if len(names) < 5 or not tail.split():
                    continue
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), names[4])
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(found):
                    found, kind = mount, tail.split()[0]
    except OSError:
        return None
    if not kind or kind in MEMORY_FILESYSTEMS:
        return None
    return (
        f"the arena's directory {directory} is on {kind}, not in memory: the DRAM tier's pages "
        "go to that disk; give a tmpfs with --shm-dir (the default, /dev/shm, is one)"
    )


def _free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged writer may still use in ``directory``'s filesystem; None when it
    cannot be told."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _no_room(reason: str, size: int, free: int, directory: str, **context: object) -> StorageError:
    """The arena cannot have ``size`` bytes in ``directory``: the error, naming the fixes."""
    return StorageError(
        f"cannot commit the arena's memory: {reason} ({size >> 20} MiB asked, {free >> 20} MiB "
        f"free in {directory}): give a smaller --dram, or make room there (a container's "
        "/dev/shm is 64 MiB unless sized: docker --shm-size, compose shm_size)",
        **context,
    )


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def is_arena_name(path: str) -> bool:
    """Whether ``path``'s file name is one :class:`SharedArena` gives an arena,
    ``kvserver-<pid>-<hex>``: a client maps no other file, whatever a daemon's ``hello``
    names (its grants would have the client write chunks into it: a configuration file, a
    key). A daemon on another host cannot guess a live arena's name (its 32 random bits)."""
    parts = os.path.basename(path).split("-")
    return (
        len(parts) == 3
        and parts[0] == "kvserver"
        and parts[1].isdigit()
        and bool(parts[2])
        and all(c in "0123456789abcdef" for c in parts[2])
    )


def total_length(extents: Iterable[tuple[int, int]]) -> int:
    return sum(length for _, length in extents)


def _create_locked(path: str) -> int:
    """Create ``path`` (0600, never over an existing file) and return its descriptor, holding
    an exclusive ``flock`` that no reaper can take before the name exists."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.new")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:  # the directory refuses files: the operator's to fix
        raise StorageError(
            f"cannot create the arena in {directory}: {exc.strerror}; give a directory this "
            "user may write (a tmpfs) with --shm-dir",
            errno=exc.errno,
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        os.link(tmp, path)  # fails if ``path`` exists, as O_EXCL would
    except OSError as exc:
        os.close(fd)
        raise StorageError(
            f"cannot create arena: {exc.strerror}", path=path, errno=exc.errno
        ) from None
    finally:
        _unlink(tmp)
    return fd


def reap_stale_arenas(directory: str = DEFAULT_SHM_DIR) -> list[str]:
    """Remove arena files left by daemons that died without cleaning up (kill -9, OOM), and
    the local-channel sockets beside them (``<arena>.sock``).

    Only regular files named ``kvserver-<pid>-<hex>`` owned by this user whose lock
    (:class:`SharedArena`) no live process holds are removed. The lock, not the ``<pid>``,
    decides: a pid is reused (a daemon that is pid 1 in its container is pid 1 again after a
    restart, and would leave its predecessor's arena in ``/dev/shm`` forever) and means
    nothing in another pid namespace sharing the directory (a daemon in another container
    whose pid is not running here is alive). Returns the removed paths.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "kvserver" or not parts[1].isdigit():
            continue
        path = os.path.join(directory, name)
        if name.endswith(".sock"):  # a socket whose arena is gone: its daemon is gone too
            arena = path[: -len(".sock")]
            if not os.path.lexists(arena) and _is_own(path, uid, stat.S_ISSOCK):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(path)
            continue
        if remove_if_unheld(path, os.O_NONBLOCK, os.unlink, stat.S_ISREG):  # its daemon gone
            removed.append(path)
            sock = f"{path}.sock"
            if _is_own(sock, uid, stat.S_ISSOCK):
                with contextlib.suppress(OSError):
                    os.unlink(sock)
                    removed.append(sock)
    return removed


def _is_own(path: str, uid: int, kind: Callable[[int], bool]) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == uid and kind(st.st_mode)


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists (one of another user's counts). Not a test of
    whether an arena is stale (:func:`reap_stale_arenas`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
