"""Whether a local-channel client's process is gone, so that its leases may be released early.

Runs in the daemon process, on its event loop; owned by the ZMQ front end
(:mod:`kvserver.daemon.zmq_server`). Not thread-safe: loop only.

Why: a co-located client copies into and out of the arena pages its grants name, in its own
process, with no message to the daemon. Its connection closing does not mean it stopped: a
client closes its links whenever a call times out (and the daemon closes a connection whose
stream it cannot read). Releasing its reservations and pins then would hand their pages to the
next store while the client still copies: its bytes would land in another key's READY chunk
(served as that key), or it would read another key's bytes as its own. So the leases of a
closed connection are released at once only when its *process* is gone (it crashed, was
killed, exited); otherwise they end as every lease does, when completed or at their deadline.

How: when a connection is made, its peer's pid comes from ``SO_PEERCRED`` and is held as a
pidfd (``os.pidfd_open``: immune to pid reuse). When it closes, the pidfd says whether the
process has exited; a process being killed closes its sockets a moment before it counts as
exited, so the watch waits up to :data:`EXIT_GRACE_S` for that (``add_reader`` on the pidfd)
before it decides the process lives. No pidfd (not Linux 5.3+, a peer in a pid namespace the
daemon cannot see): the leases are kept (they end at their deadlines), never released under a
client that may be running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import struct
from collections.abc import Callable
from typing import Any

#: how long a closed connection's process may take to count as exited (a kill closes the
#: sockets first) before its leases are kept.
EXIT_GRACE_S = 2.0
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pidfd(sock: Any) -> int | None:
    """A pidfd of the process at the other end of the Unix socket ``sock``, or None."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
        pid = _CREDS.unpack(raw)[0]
        return os.pidfd_open(pid) if pid > 0 else None
    except (OSError, AttributeError, ValueError, struct.error):
        return None


def exited(pidfd: int) -> bool:
    """True once the process of ``pidfd`` has exited (the pidfd polls readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class ExitWatch:
    """Closed connections whose process has not exited yet, each watched for at most
    :data:`EXIT_GRACE_S`. Invariant: each watched pidfd is closed exactly once, when its
    outcome is decided or at :meth:`stop`."""

    def __init__(self) -> None:
        self._watched: dict[int, asyncio.TimerHandle] = {}

    @property
    def num_watched(self) -> int:
        return len(self._watched)

    def closed(
        self, pidfd: int | None, gone: Callable[[], None], alive: Callable[[], None]
    ) -> None:
        """A connection closed: call ``gone()`` once its process (``pidfd``, owned from now
        on) has exited, now or within the grace; else ``alive()``."""
        if pidfd is None:
            alive()
            return
        if exited(pidfd):
            os.close(pidfd)
            gone()
            return
        loop = asyncio.get_running_loop()
        timer = loop.call_later(EXIT_GRACE_S, self._decide, pidfd, alive)
        self._watched[pidfd] = timer
        loop.add_reader(pidfd, self._decide, pidfd, gone)

    def _decide(self, pidfd: int, outcome: Callable[[], None]) -> None:
        timer = self._watched.pop(pidfd, None)
        if timer is None:
            return
        timer.cancel()
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        outcome()

    def stop(self) -> None:
        """Forget every watch (stopping: the service rolls every lease back itself)."""
        loop = asyncio.get_running_loop()
        for pidfd, timer in self._watched.items():
            timer.cancel()
            loop.remove_reader(pidfd)
            with contextlib.suppress(OSError):
                os.close(pidfd)
        self._watched.clear()
