"""``Pacing``: when a fleet member retries Redis and when it resyncs (the spread, the backoff).

Runs on the daemon's event loop, owned by one ``ClusterNode`` (``node.py``), which asks it
before each registration (:meth:`Pacing.urgent`, then :meth:`Pacing.spread` for one that is
not) and after each failure (:meth:`Pacing.failed` → :meth:`Pacing.retry_pause`), and tells
it of each success (:meth:`Pacing.succeeded`).

Why (docs/cluster.md, "Retries and the resync's spread"): a fleet that lost Redis at one
moment would retry in step, and one that found it back (or restarted empty) would send every
member's index at once: 100 hosts x ~8 MB per 1 M chunks. So every registration but an
incarnation's first waits a random delay in [0, ``resync_window_s``) before its resync, and
retries pause min(1 s, heartbeat interval), doubled per failure in a row up to
``retry_cap_s``, each pause drawn in [half, whole].

State (this class alone): the random source (a seeded one in tests), the registrations tried,
the failures in a row, and when the delayed resync under way starts.
"""

from __future__ import annotations

import asyncio
import random
import time

from kvserver.cluster.config import ClusterConfig


class Pacing:
    """The member's retry pauses and resync delays (module docstring)."""

    def __init__(self, config: ClusterConfig, rng: random.Random | None = None) -> None:
        self._config = config
        self._rng = rng if rng is not None else random.Random()
        #: registrations tried (the first is urgent: not delayed); failures in a row
        self._attempts = 0
        self._failures = 0
        #: when (monotonic) the delayed resync under way starts; 0.0: none waiting
        self._resync_at = 0.0

    def urgent(self) -> bool:
        """Count a registration attempt; True for this incarnation's first (``kvserver
        start`` waits for it: no delay)."""
        self._attempts += 1
        return self._attempts == 1

    def resync_in_s(self) -> float:
        """Seconds until the delayed resync under way starts (0.0: none waiting)."""
        return max(0.0, self._resync_at - time.monotonic()) if self._resync_at else 0.0

    async def spread(self) -> None:
        """Wait a random delay in [0, ``resync_window_s``) before a resync that is not urgent:
        the members of a fleet that all found Redis back, or restarted empty, at the same
        moment send their indexes over the window, not at once. Meanwhile the index lags (this
        member is absent from it, never wrong) and :meth:`resync_in_s` says how long."""
        delay = self._rng.random() * self._config.resync_window_s
        if delay <= 0:
            return
        self._resync_at = time.monotonic() + delay
        try:
            await asyncio.sleep(delay)
        finally:
            self._resync_at = 0.0

    def failed(self) -> None:
        """One more failure in a row."""
        self._failures += 1

    def succeeded(self) -> None:
        """A registration went through: the backoff starts again from its base."""
        self._failures = 0

    def retry_pause(self) -> float:
        """The pause before the next retry: min(1 s, heartbeat interval), doubled per failure
        in a row up to ``retry_cap_s``, drawn in [half, whole] (a fleet that lost Redis at the
        same moment does not retry in step; a full or failing Redis is not asked by every host
        every second)."""
        base = min(self._config.heartbeat_interval_s, 1.0)
        cap = max(base, self._config.retry_cap_s)
        pause = min(cap, base * 2.0 ** min(self._failures - 1, 30))
        return pause * self._rng.uniform(0.5, 1.0)
