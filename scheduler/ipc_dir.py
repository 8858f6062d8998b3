"""The scheduler's private temporary directory (its synthetic workers' ``ipc://`` sockets), and
the removal of those left by schedulers that died without removing theirs.

Runs in the scheduler process (``scheduler/process.py``): :func:`reap_stale_ipc_dirs` once at
start, then :class:`IpcDir` when synthetic workers are spawned, closed in the shutdown's
``finally`` (a forced exit removes it through ``Leaving.dirs``). Not thread-safe (one owner).

A scheduler killed by SIGKILL (or the OOM killer) runs no ``finally``: its directory stayed in
the temp dir for ever (329 empty ``kvserver-sched-*`` directories after a few test runs). Now
the directory is ``<tmp>/kvserver-sched-<pid>-<random>`` (mode 0700): the pid tells an
operator whose it is, and its owner holds a shared ``flock`` on it for as long as it runs; the
kernel drops it when the process dies, however it dies. At start, the scheduler removes the
directories of that name in the temp dir that are this user's and that it can lock
exclusively. A lock rather than the pid alone, as for the token files
(``kvserver/token_file.py``): a reused pid, or a live scheduler in another pid namespace
sharing ``/tmp``, cannot make a live directory look dead, nor a dead one live for ever. The
directory is made under a hidden name (``.kvserver-sched-...``) and renamed to its own once
locked, so that a reaper never sees it unlocked.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import tempfile

from kvserver.errors import InvalidArgument
from kvserver.files import remove_if_unheld

PREFIX = "kvserver-sched-"
#: the longest path a Unix socket may have (Linux: ``sockaddr_un.sun_path`` less its NUL)
MAX_SOCKET_PATH = 107
_NAME = re.compile(rf"^{PREFIX}(?P<pid>\d+)-[A-Za-z0-9_]+$")
_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class IpcDir:
    """A new private directory under ``parent`` (default: the temp dir), locked while this
    object is open; :meth:`close` removes it with its contents (idempotent)."""

    def __init__(self, parent: str | None = None) -> None:
        parent = parent or tempfile.gettempdir()
        staging = tempfile.mkdtemp(prefix=f".{PREFIX}{os.getpid()}-", dir=parent)
        self._fd: int | None = os.open(staging, _OPEN)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            self.path = os.path.join(parent, os.path.basename(staging)[1:])
            os.rename(staging, self.path)
        except BaseException:
            os.close(self._fd)
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def socket_path(self, name: str) -> str:
        """The path of socket ``name`` in the directory; raises InvalidArgument, naming
        TMPDIR, when it is too long for a Unix socket (was: the workers failed to bind, and the
        scheduler waited out ``--hello-timeout-s`` for them)."""
        path = os.path.join(self.path, name)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise InvalidArgument(
                f"the synthetic workers' socket path {path} is longer than {MAX_SOCKET_PATH} "
                "bytes (a Unix socket's limit): point TMPDIR at a shorter directory"
            )
        return path

    def close(self) -> None:
        """Remove the directory, then let go of its lock."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> IpcDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reap_stale_ipc_dirs(parent: str | None = None) -> list[str]:
    """Remove the directories of :class:`IpcDir`'s name under ``parent`` (default: the temp
    dir) that are this user's and whose owner is gone (no process holds their lock); returns
    their paths. Anything else (another user's, a symlink, a file, a live scheduler's, one
    that cannot be read) is left alone."""
    parent = parent or tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(parent) if _NAME.match(name)]
    except OSError:
        return []
    paths = [os.path.join(parent, name) for name in names]
    return [
        path for path in paths
        if remove_if_unheld(path, os.O_DIRECTORY, shutil.rmtree, stat.S_ISDIR)
    ]  # fmt: skip
