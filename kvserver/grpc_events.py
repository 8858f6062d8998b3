"""EventStream: the events of one WatchEvents call of a daemon's gRPC API, as an iterator.

Runs in any process, made by ``GrpcClient.watch_events`` (kvserver/grpc_client.py); one
stream is used by one thread. Call order: iterate (each ``next()`` waits for the daemon's next
event) → :meth:`EventStream.close` (or use it as a context manager); :attr:`log_id` and
:attr:`next_seq` may be read at any time, to resume after a disconnect. Errors are raised from
``next()`` as kvserver errors (``kvserver.grpc_errors``: ``EventsDropped`` when the resume
point is gone).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from kvserver.events import Event
from kvserver.grpc_errors import rpc_error
from kvserver.grpc_format import FROM_SEQ_KEY, LOG_ID_KEY, event_from_proto


class EventStream:
    """Iterator over the events of one WatchEvents call; :meth:`close` ends it.

    :attr:`log_id` and :attr:`next_seq` say where the stream stands (before the first event:
    where the daemon started it). Resume after a disconnect, with no gap and no duplicate, by
    ``client.watch_events(stream.next_seq, log_id=stream.log_id)``. Iteration ends when the
    daemon shuts down or after :meth:`close`; errors are raised from ``next()``.
    """

    def __init__(self, call: Any, target: str, from_seq: int, log_id: str) -> None:
        self._rpc = call
        self._target = target
        self._closed = False
        self._log_id = log_id
        self._next_seq = from_seq  # 0 = not known until the daemon's headers arrive

    @property
    def log_id(self) -> str:
        self._resolve()
        return self._log_id

    @property
    def next_seq(self) -> int:
        """Seq of the next event this stream will deliver (0 if the call failed at once)."""
        self._resolve()
        return self._next_seq

    def _resolve(self) -> None:
        if self._next_seq and self._log_id:
            return
        try:
            metadata = dict(self._rpc.initial_metadata() or ())
        except grpc.RpcError:
            return
        self._log_id = self._log_id or str(metadata.get(LOG_ID_KEY, ""))
        seq = str(metadata.get(FROM_SEQ_KEY, ""))
        if not self._next_seq and seq.isdigit():
            self._next_seq = int(seq)

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        try:
            msg = next(self._rpc)
        except grpc.RpcError as exc:
            if self._closed and exc.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise rpc_error(exc, self._target) from None
        self._log_id = msg.log_id
        self._next_seq = msg.seq + 1
        return event_from_proto(msg)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._rpc.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
