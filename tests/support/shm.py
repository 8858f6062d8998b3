"""A shared-memory directory of the test session's own, removed at its end.

Every daemon, scheduler and worker the tests start leaves its arena and its token files
(``kvserver/token_file.py``) in ``$KVSERVER_SHM_DIR``, and a process the tests SIGKILL on
purpose cannot remove them. :class:`SessionDir` makes ``kvserver-tests-<pid>-<random>`` under
the configured directory (default ``/dev/shm``: still tmpfs) and points ``KVSERVER_SHM_DIR`` at
it, so that whatever the session's processes leave goes with the directory
(:meth:`SessionDir.close`); it first removes the directories of sessions whose pytest is no
longer running (a session that was killed). Called from tests/conftest.py's
``pytest_configure`` / ``pytest_unconfigure``, before any test starts a process.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from kvserver.arena import DEFAULT_SHM_DIR, pid_alive
from kvserver.token_file import SHM_DIR_ENV

PREFIX = "kvserver-tests-"


def reap_dead_sessions(base: str) -> list[str]:
    """Remove this user's session directories in ``base`` whose pytest has exited."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if not name.startswith(PREFIX) or not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class SessionDir:
    """The session's directory and the ``KVSERVER_SHM_DIR`` it replaced."""

    def __init__(self) -> None:
        self.previous = os.environ.get(SHM_DIR_ENV)
        base = self.previous or DEFAULT_SHM_DIR
        reap_dead_sessions(base)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
        os.environ[SHM_DIR_ENV] = self.path

    def close(self) -> None:
        if os.environ.get(SHM_DIR_ENV) == self.path:
            if self.previous is None:
                del os.environ[SHM_DIR_ENV]
            else:
                os.environ[SHM_DIR_ENV] = self.previous
        shutil.rmtree(self.path, ignore_errors=True)
