"""Zero-copy replies of the ZMQ front end: arena views sent as frames, under pins of our own.

Runs in the daemon process, on its event loop; used by :mod:`kvserver.daemon.zmq_server` (the
send) and :mod:`kvserver.daemon.zmq_ops` (the pin). Not thread-safe: loop only.

Call order: ``pin(ns_id, keys)`` → read the parts (``KVService.read_part``) into a
:class:`Parts` → ``send(router, ident, req_id, sid, parts)`` (non-blocking: a ROUTER send never
waits) → the pin is released once
ZMQ has finished with every frame → ``await close()`` at shutdown (cancels the watchers and
releases every pin left; the sockets close with linger 0 right after, so ZMQ drops the frames).

``get``/``read_parts`` replies reference the arena pages themselves. Large parts
(>= ``zmq.COPY_THRESHOLD``) go out as tracked frames under a pin (a load lease of client
``ZMQ_SEND_CLIENT``, lease ``max_lease_s``), so an eviction can never overwrite bytes still
being sent; smaller ones are copied, which is cheaper. The tracker is a ``threading.Event`` set
by pyzmq's gc thread, so it is polled with a short exponential backoff rather than awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import zmq

from kvserver import wire
from kvserver.daemon.service import KVService
from kvserver.errors import KVServerError

logger = logging.getLogger(__name__)

#: lease owner of the pins that guard in-flight zero-copy sends.
ZMQ_SEND_CLIENT = "kvserver-zmq-send"
_TRACKER_POLL_S = (0.0005, 0.02)  # first and largest poll interval


@dataclass(slots=True)
class Parts:
    """A reply with payload: key-major parts (each a list of arena views) under a send pin
    (``guard``, 0 when nothing is pinned)."""

    result: dict[str, Any]
    parts: list[list[memoryview]]
    guard: int


class ZeroCopySender:
    """Send pins and the sends they guard; see the module docstring."""

    def __init__(self, service: KVService) -> None:
        self._service = service
        self._guards: set[int] = set()
        self._watchers: set[asyncio.Task[None]] = set()

    def pin(self, ns_id: str, keys: list[bytes]) -> int:
        """Pin ``keys`` for a send; returns the guard (raises what ``prepare_load`` raises)."""
        return self.adopt(self._service.hold(ns_id, keys, client=ZMQ_SEND_CLIENT))

    def adopt(self, lease_id: int) -> int:
        """Take a load lease of ``ZMQ_SEND_CLIENT`` (``KVService.hold``/``get``) as a send
        pin; returns it as the guard (0 stays 0: nothing pinned)."""
        if lease_id:
            self._guards.add(lease_id)
        return lease_id

    def release(self, guard: int) -> None:
        """End a send pin (no-op for 0 or an unknown guard)."""
        if guard in self._guards:
            self._guards.discard(guard)
            try:
                self._service.complete_load(guard)
            except KVServerError as exc:  # expired (a send stuck for max_lease_s) or closed
                logger.warning("send pin %d: %s", guard, exc)

    def send(
        self, router: zmq.Socket[bytes], ident: bytes, req_id: int, sid: str, reply: Parts
    ) -> None:
        """Send ``reply``: large views zero-copy and tracked, released once ZMQ is done.
        REQUIRES: a running event loop (the release is watched by a task)."""
        out: list[Any] = []
        tracked: list[zmq.Frame] = []
        guard = reply.guard
        for views in reply.parts:
            for view in views:
                if view.nbytes >= zmq.COPY_THRESHOLD:
                    frame = zmq.Frame(view, copy=False, track=True)
                    tracked.append(frame)
                    out.append(frame)
                else:
                    out.append(bytes(view))
        header = _header(req_id, sid, reply)
        try:
            router.send_multipart([ident, header, *out], copy=False)
        finally:
            if tracked:
                task = asyncio.get_running_loop().create_task(
                    self._release_when_sent(zmq.MessageTracker(*tracked), guard)
                )
                self._watchers.add(task)
                task.add_done_callback(self._watchers.discard)
            else:
                self.release(guard)

    def copy_out(self, req_id: int, sid: str, reply: Parts) -> list[bytes]:
        """``reply`` as frames that own their bytes (header, then a copy of every view), for
        a transport that may write them later; the pin ends now."""
        try:
            return [_header(req_id, sid, reply)] + [
                bytes(view) for views in reply.parts for view in views
            ]
        finally:
            self.release(reply.guard)

    async def close(self) -> None:
        """Stop watching sends and release every pin. Idempotent."""
        watchers = list(self._watchers)
        for task in watchers:
            task.cancel()
        for task in watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for guard in list(self._guards):
            self.release(guard)

    async def _release_when_sent(self, tracker: zmq.MessageTracker, guard: int) -> None:
        delay, longest = _TRACKER_POLL_S
        try:
            while not tracker.done:
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)
        finally:
            # on cancellation (stop) the sockets close with linger 0 right after: ZMQ drops
            # the frames, so releasing here is safe too.
            self.release(guard)


def _header(req_id: int, sid: str, reply: Parts) -> bytes:
    """The reply header of ``reply`` (``part_frames`` when a part spans several views)."""
    result = reply.result
    if any(len(views) != 1 for views in reply.parts):
        result["part_frames"] = [len(views) for views in reply.parts]
    return wire.encode_reply(req_id, sid, result)
