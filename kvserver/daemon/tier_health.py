"""The condition of a tier below DRAM: ``ok``, ``degraded`` or ``unavailable``, and when a write
may probe a degraded tier again.

Runs on the daemon's event loop; owned by one tier (``tiering.SsdTier``) and shared with its
write-back (``writeback.WriteBack``), which reports each write's outcome. Not thread-safe:
loop only. Transitions are logged once each.

- ``ok``: writes go through.
- ``degraded`` (a write failed: ENOSPC, EIO, EACCES ...): write-backs are skipped, reads keep
  serving, and one write (a probe) is let through every ``retry_s``; the first success
  returns to ``ok``.
- ``unavailable`` (the tier could not be opened; its owner retries every ``retry_s``), or
  its directory was lost while open (:meth:`TierHealth.directory_lost`: removed, renamed or
  replaced; reads keep serving from the open files, no write goes through, and write outcomes
  change nothing until the owner finds the directory back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvserver.daemon.tiers import DEGRADED, OK, UNAVAILABLE
from kvserver.ssd.config import TierCounters

logger = logging.getLogger(__name__)

NOT_OPENED = "not opened yet"


class TierHealth:
    """One tier's condition; see the module docstring."""

    def __init__(
        self,
        label: str,
        retry_s: float,
        counters: TierCounters,
        clock: Callable[[], float],
    ) -> None:
        self._label = label
        self._retry_s = retry_s
        self._counters = counters
        self._clock = clock
        self._retry_at = 0.0
        self.condition, self.reason = UNAVAILABLE, NOT_OPENED
        #: why the open directory is lost ("" while it is not)
        self.lost = ""

    def set(self, condition: str, reason: str) -> None:
        """Enter ``condition`` (logged when it changes)."""
        if (condition, reason) != (self.condition, self.reason):
            if condition == OK:
                if self.reason != NOT_OPENED:
                    logger.info("%s: ok again (was %s)", self._label, self.condition)
            else:
                logger.warning(
                    "%s %s: %s; DRAM keeps serving, retrying every %g s",
                    self._label,
                    condition,
                    reason,
                    self._retry_s,
                )
        self.condition, self.reason = condition, reason

    @property
    def is_ok(self) -> bool:
        return self.condition == OK

    def write_succeeded(self) -> None:
        """A write went through: a degraded tier is ``ok`` again."""
        if self.condition == DEGRADED:
            self.set(OK, "")

    def directory_lost(self, reason: str) -> None:
        """The open directory is lost (``reason``): ``unavailable`` until it is back
        (``reason`` ""), then ``ok``."""
        if reason:
            self.lost = reason
            self.set(UNAVAILABLE, reason)
        elif self.lost:
            self.lost = ""
            self.set(OK, "")

    def failed_write(self, exc: BaseException) -> None:
        """A write failed: the tier is ``degraded``, the next probe in ``retry_s`` (counted
        only while the directory is lost)."""
        self._counters.io_errors += 1
        if self.lost:
            return
        self._retry_at = self._clock() + self._retry_s
        self.set(DEGRADED, f"write failed: {exc}")

    def writable(self, probing: bool) -> bool:
        """Writes go through when ok; when degraded, one write (a probe: none is in flight,
        ``probing`` False) once ``retry_s`` has passed since the last failure."""
        if self.condition == OK:
            return True
        return self.condition == DEGRADED and not probing and self._clock() >= self._retry_at
