"""The event log: a bounded, sequence-numbered history of storage events with live subscribers.

Runs on the daemon's event loop (single owner, asyncio only). The engine numbers events with a
gap-free sequence; the log keeps the newest ``capacity`` of them so a subscriber that reconnects
with ``from_seq`` receives exactly the events it missed, in order, with no gap — unless they have
already been dropped from the buffer, which :meth:`EventLog.replay` reports as
:class:`EventGap` so the subscriber knows to resynchronise (e.g. with a full Lookup).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from kvserver.errors import InvalidArgument
from kvserver.events import Event


class EventGap(Exception):
    """Requested events are no longer retained; ``oldest`` is the first seq still available."""

    def __init__(self, requested: int, oldest: int) -> None:
        super().__init__(f"events before seq {oldest} were dropped (requested {requested})")
        self.requested = requested
        self.oldest = oldest


class EventLog:
    """Bounded event history plus wake-ups for subscribers."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise InvalidArgument("event log capacity must be positive")
        self._events: deque[Event] = deque(maxlen=capacity)
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event (0 when none yet)."""
        return self._events[-1].seq if self._events else 0

    @property
    def oldest_seq(self) -> int:
        return self._events[0].seq if self._events else self.last_seq + 1

    def extend(self, events: list[Event]) -> None:
        """Append events (already numbered, increasing) and wake subscribers."""
        if not events:
            return
        self._events.extend(events)
        self._changed.set()
        self._changed = asyncio.Event()

    def replay(self, from_seq: int) -> list[Event]:
        """Retained events with ``seq >= from_seq``; EventGap if some were dropped."""
        if from_seq < 1:
            from_seq = 1
        if not self._events:
            return []
        oldest = self._events[0].seq
        if from_seq < oldest:
            # The first events ever emitted start at 1: nothing was dropped if oldest is 1.
            raise EventGap(from_seq, oldest)
        start = from_seq - oldest
        if start >= len(self._events):
            return []
        return [self._events[i] for i in range(start, len(self._events))]

    async def follow(self, from_seq: int) -> AsyncIterator[Event]:
        """Yield events from ``from_seq`` on, forever (until :meth:`close`)."""
        next_seq = max(from_seq, 1)
        while not self._closed:
            waiter = self._changed
            batch = self.replay(next_seq)
            for event in batch:
                yield event
            if batch:
                next_seq = batch[-1].seq + 1
                continue
            await waiter.wait()

    def close(self) -> None:
        """Stop every follower (they return after their current batch)."""
        self._closed = True
        self._changed.set()
