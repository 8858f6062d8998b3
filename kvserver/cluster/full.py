"""``FullRedis``: a fleet member while Redis refuses its index adds for memory.

Runs on the daemon's event loop, owned by one ``ClusterNode`` (``node.py``), which tells it
of each pipeline that had adds refused (:meth:`FullRedis.refused`), asks it when to retry
the deferred adds (:meth:`FullRedis.due`), and tells it when they are all in
(:meth:`FullRedis.cleared`) or when the index is rebuilt anyway (:meth:`FullRedis.reset`: a
failure, a registration).

Why (docs/cluster.md, Configuration): Redis at ``maxmemory`` under ``noeviction`` refuses
every command that may need memory, and runs the rest. The membership's writes and the
fence's are ``allow-oom`` scripts (``record.ALLOW_OOM``), removes and unlinks free memory:
only the index's adds are refused. The member stays in the fleet, ``degraded``; the writer
keeps the refused adds (``IndexWriter.deferred``) and the node retries them on their own,
after a pause that backs off (``Pacing``), instead of the member leaving and rejoining.

Also the reply helpers of a pipeline run with ``raise_on_error=False`` (:func:`is_oom`,
:func:`first_refused`, :func:`check`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvserver.cluster.pacing import Pacing

logger = logging.getLogger("kvserver.cluster.node")

#: said with a Redis that refuses writes (OOM: ``maxmemory`` reached under ``noeviction``).
OOM_HINT = "Redis is full: raise its maxmemory (docs/cluster.md sizes the index)"


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write for memory (``maxmemory`` reached under
    ``noeviction``): either client library's ``OutOfMemoryError``."""
    return type(exc).__name__ == "OutOfMemoryError"


def first_refused(replies: Sequence[Any]) -> BaseException | None:
    """The first reply that is Redis refusing a write for memory (an add), or None."""
    return next((r for r in replies if isinstance(r, BaseException) and is_oom(r)), None)


def check(replies: Sequence[Any]) -> None:
    """Raise the first error among ``replies`` (commands Redis runs while full: an error
    there is a failure, as when the pipeline raised)."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply


class FullRedis:
    """Whether Redis refuses this member's index adds, and when to retry them."""

    def __init__(self, pacing: Pacing) -> None:
        self._pacing = pacing
        #: Redis refused adds for memory; the writer holds them (``IndexWriter.deferred``)
        self.active = False
        #: when (monotonic) the deferred adds are tried again
        self.retry_at = 0.0

    def due(self) -> bool:
        """Whether the deferred adds are to be tried now."""
        return self.active and time.monotonic() >= self.retry_at

    def wake_at(self, other: float) -> float:
        """The earlier of ``other`` (monotonic) and the next retry, while full."""
        return min(other, self.retry_at) if self.active else other

    def refused(self, exc: BaseException, deferred: int) -> str:
        """Redis refused adds (``exc``; ``deferred`` of them wait now): full, the retry
        after a pause that backs off; returns the condition detail."""
        if not self.active:
            logger.warning("cluster: Redis refuses index writes, out of memory (%s); this host "
                           "stays a member, its new index entries wait", exc)  # fmt: skip
            self._pacing.succeeded()  # the backoff of the adds' retries starts here
        self.active = True
        self._pacing.failed()
        self.retry_at = time.monotonic() + self._pacing.retry_pause()
        return self.detail(deferred)

    @staticmethod
    def detail(deferred: int) -> str:
        """The condition detail while ``deferred`` adds wait."""
        entries = "entry" if deferred == 1 else "entries"
        return (f"OutOfMemoryError: {deferred} index {entries} deferred, missing from the "
                f"index until Redis takes them ({OOM_HINT})")  # fmt: skip

    def cleared(self) -> None:
        """Every deferred add is in: not full any more."""
        logger.info("cluster: Redis takes index writes again; the deferred ones are in")
        self.reset()
        self._pacing.succeeded()

    def reset(self) -> None:
        """Not full (a failure or a registration rebuilds the index instead)."""
        self.active = False
        self.retry_at = 0.0
