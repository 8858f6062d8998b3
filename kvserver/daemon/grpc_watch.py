"""The gRPC ``WatchEvents`` streams: where a subscriber resumes, how many streams are open, and
what each is written.

Runs in the daemon process, on its one event loop (called by ``grpc_server.py``'s WatchEvents
handler, which authenticates the caller and turns errors into a status); not thread-safe.

Call order: ``EventStreams(service, log_id, max_watchers)`` → per stream ``from_seq =
admit(request)`` → ``await serve(from_seq, context, who)`` → at shutdown ``stop()``, which ends
every stream with OK.

Contract:
- :meth:`EventStreams.admit` raises :class:`CannotResume` (OUT_OF_RANGE) for another daemon
  run's ``log_id`` or a ``from_seq`` beyond the next event, EventGap for one the bounded log
  no longer holds, and CapacityError (RESOURCE_EXHAUSTED) when ``max_watchers`` streams are
  open: each event is written to every stream on the loop, so a caller opening thousands of
  streams multiplied the loop's work per store for every other client.
- :meth:`EventStreams.serve` sends the initial metadata (``log_id``, the first seq), then
  every event from ``from_seq`` on of a namespace ``who`` sees (a tenant's stream skips other
  tenants'), until the client leaves, the log closes or :meth:`EventStreams.stop`; EventGap
  if the subscriber fell behind the bounded log. The stream counts as open while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.daemon.auth import Principal
from kvserver.daemon.service import KVService
from kvserver.errors import CapacityError
from kvserver.eventlog import EventGap
from kvserver.events import Event
from kvserver.grpc_format import FROM_SEQ_KEY, LOG_ID_KEY, event_to_proto


class CannotResume(Exception):
    """WatchEvents cannot continue from the requested point: OUT_OF_RANGE."""

    def __init__(self, message: str, oldest: int) -> None:
        super().__init__(message)
        self.oldest = oldest


class EventStreams:
    """The WatchEvents streams of one gRPC front end (see the module docstring)."""

    def __init__(self, service: KVService, log_id: str, max_watchers: int) -> None:
        self.service = service
        #: identity of this daemon run's event log (sequence numbers restart with the daemon).
        self.log_id = log_id
        self._max_watchers = max_watchers
        self._stopping = asyncio.Event()
        self._watchers = 0  # WatchEvents streams open

    def stop(self) -> None:
        """End every stream (with OK) and any opened later."""
        self._stopping.set()

    def admit(self, req: pb.WatchEventsRequest) -> int:
        """The first seq to send to a new stream (see the module docstring for what it raises)."""
        from_seq = self._resume_point(req)
        if self._watchers >= self._max_watchers:
            raise CapacityError(
                f"{self._max_watchers} WatchEvents streams are open (the "
                "daemon's max_event_watchers); retry later"
            )
        return from_seq

    async def serve(self, from_seq: int, context: grpc.aio.ServicerContext, who: Principal) -> None:
        """Write the stream admitted at ``from_seq`` (see the module docstring)."""
        self._watchers += 1
        try:
            await context.send_initial_metadata(
                ((LOG_ID_KEY, self.log_id), (FROM_SEQ_KEY, str(from_seq)))
            )
            await self._follow(from_seq, context, who)
        finally:
            self._watchers -= 1

    def _resume_point(self, req: pb.WatchEventsRequest) -> int:
        """The first seq to send; CannotResume (OUT_OF_RANGE) if the log cannot supply it."""
        log = self.service.events
        last = log.last_seq
        if req.log_id and req.log_id != self.log_id:
            raise CannotResume(
                f"event log {req.log_id[:32]!r} is gone (the daemon restarted); this log is "
                f"{self.log_id!r}, oldest seq {log.oldest_seq}",
                log.oldest_seq,
            )
        from_seq = req.from_seq or last + 1
        if from_seq > last + 1:
            raise CannotResume(
                f"from_seq {from_seq} is beyond the next event {last + 1} "
                f"(did the daemon restart?); oldest seq {log.oldest_seq}",
                log.oldest_seq,
            )
        log.replay(from_seq)  # raises EventGap now rather than after the first write
        return from_seq

    async def _follow(
        self, from_seq: int, context: grpc.aio.ServicerContext, who: Principal
    ) -> None:
        """Write events from ``from_seq`` on until the client leaves or the server stops;
        only those of namespaces ``who`` sees (a tenant's stream skips other tenants')."""
        follower = self.service.events.follow(from_seq)
        stopping = asyncio.ensure_future(self._stopping.wait())
        pending: asyncio.Future[Event] | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(follower))
                await asyncio.wait((pending, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    return  # shutting down: end the stream with OK
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    return  # the event log was closed
                pending = None
                if not who.is_admin and not self._sees(who, event.ns_id):
                    continue
                await context.write(self._event_message(event).SerializeToString())
        finally:
            stopping.cancel()
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, EventGap):
                    await pending
            aclose = getattr(follower, "aclose", None)
            if aclose is not None:
                await aclose()

    def _sees(self, who: Principal, ns_id: str) -> bool:
        spec = self.service.find_namespace(ns_id)
        return spec is not None and who.sees(spec)

    def _event_message(self, event: Event) -> pb.Event:
        return event_to_proto(event, self.log_id)
