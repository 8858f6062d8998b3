"""KV events of the ZMQ front end in vLLM's format: the PUB publisher and the replay protocol.

Runs in the daemon process, on its event loop (``docs/wire.md`` §5). Not thread-safe: loop only.

Call order: ``EventPublisher(service)`` → ``set_pod()`` once the data port is known →
``await publish_forever(pub)`` as a task (follows the event log until it closes; a subscriber
that fell behind the log's capacity sees the gap in ``seq``) and ``await replay(router, ident,
start)`` for each replay request read on the data-plane ROUTER.

A replay request (``[b"", start_seq]``) is answered with ``[b"", seq, payload]`` per retained
batch with ``seq >= start_seq`` (at most :data:`REPLAY_MAX_BATCHES` / :data:`REPLAY_MAX_BYTES`;
the client asks again from the last seq) and the end marker ``[b"", -1, b""]`` — the same
protocol as vLLM's replay ROUTER, on the data port.
"""

from __future__ import annotations

import logging
import socket
import time

import zmq
import zmq.asyncio

from kvserver import wire, wire_events
from kvserver.daemon.service import KVService
from kvserver.errors import KVServerError
from kvserver.eventlog import EventGap
from kvserver.events import Event

logger = logging.getLogger(__name__)

#: replay answers at most this many batches / bytes per request (ask again from the last seq).
REPLAY_MAX_BATCHES = 10_000
REPLAY_MAX_BYTES = 64 << 20


class EventPublisher:
    """Encodes engine events as vLLM ``KVEventBatch`` messages; see the module docstring."""

    def __init__(self, service: KVService) -> None:
        self._service = service
        self._pod = socket.gethostname()
        self._topics: dict[str, tuple[bytes, int]] = {}  # ns_id → (topic, block size)

    def set_pod(self, data_port: int, host_id: str = "") -> None:
        """Name this daemon in topics as ``host_id`` (its name in the fleet, so indexers that
        read the topics see the hosts the fleet index and ``ScoreHosts`` name), else as
        ``<hostname>:<data_port>``."""
        self._pod = host_id or f"{socket.gethostname()}:{data_port}"
        self._topics.clear()

    async def publish_forever(self, pub: zmq.asyncio.Socket) -> None:
        """Publish every event from now on; returns when the event log is closed."""
        events = self._service.events
        next_seq = events.last_seq + 1
        while True:
            try:
                async for event in events.follow(next_seq):
                    await self._publish(pub, event)
                    next_seq = event.seq + 1
                return  # the event log was closed
            except EventGap as gap:
                logger.warning("event publisher fell behind: %s", gap)
                next_seq = gap.oldest

    async def _publish(self, pub: zmq.asyncio.Socket, event: Event) -> None:
        try:
            topic, payload = self.encode(event, time.time())
            await pub.send_multipart([topic, wire.seq_bytes(event.seq), payload])
        except (KVServerError, zmq.ZMQError) as exc:  # a lost event is counted by its seq gap
            logger.warning("cannot publish event %d: %s", event.seq, exc)

    def encode(self, event: Event, ts: float) -> tuple[bytes, bytes]:
        """(topic, payload) of one event as a batch of one, stamped ``ts``."""
        meta = self._topics.get(event.ns_id)
        if meta is None:
            spec = self._service.namespace(event.ns_id)
            meta = (wire.event_topic(f"{self._pod}/{event.ns_id}", spec.model), spec.chunk_tokens)
            self._topics[event.ns_id] = meta
        topic, block_size = meta
        return topic, wire_events.encode_batch(ts, [wire_events.to_wire(event, block_size)])

    async def replay(self, router: zmq.asyncio.Socket, ident: bytes, start: bytes) -> None:
        """vLLM's replay protocol: every retained batch with seq >= start, then the end mark."""
        events = self._service.events
        start_seq = int.from_bytes(start, "big")
        try:
            batch = events.replay(start_seq)
        except EventGap as gap:
            batch = events.replay(gap.oldest)
        sent_bytes, now = 0, time.time()  # replayed batches carry the replay time as ts
        for event in batch[:REPLAY_MAX_BATCHES]:
            _topic, payload = self.encode(event, now)
            await router.send_multipart([ident, b"", wire.seq_bytes(event.seq), payload])
            sent_bytes += len(payload)
            if sent_bytes > REPLAY_MAX_BYTES:
                break
        await router.send_multipart([ident, b"", wire.REPLAY_END_SEQ, b""])
