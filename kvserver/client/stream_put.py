"""A client's ``put`` over the daemon's stream port, in windows (``docs/wire.md`` §4 and §6,
"Client ops"): what one stream request may carry, and what is left for ZMQ when the stream
stops part way.

Runs in client processes, called by both clients' ``put`` (``KVClient`` on the calling
thread, ``AsyncKVClient`` in :class:`~kvserver.client.stream_use.StreamUse`'s worker thread).

Why: the daemon takes one stream put of at most its ``max_message_bytes``, and answers one
``capacity`` when the pages its stream puts in flight reserve would pass a quarter of its
DRAM while another is in flight. Sent as one request, such a put went over ZMQ whole, the
slower path (and one put alone, however large, reserved all its pages from its header). A
daemon that announces ``stream_put_max_reserved`` in its ``hello`` (that quarter) gets a
larger put as consecutive stream requests on the client's one link (:func:`stream_windows`:
whole keys, each within ``max_message_bytes`` and 1/:data:`QUOTA_SHARE` of that quota,
counted in whole pages as the daemon counts them), pipelined one deep (:class:`StreamPut`).
An older daemon's hello does not say: the put is one request, as before.

Each window is stored, or rejected, on its own, and the results merge as the ZMQ windows' do
(``ops.merge_puts``: each list in the order of the put's keys). A window the stream does not
carry — answered ``capacity`` (other connections' puts in flight hold the quota), over
``max_message_bytes`` (one key), ``unknown_namespace`` / ``unauthenticated``, or the link
failing (:class:`~kvserver.client.stream.StreamFailed`: what the daemon did with the windows
outstanding is unknown, and a window whose bytes did not all arrive was rolled back) — ends
the stream's part: no window is sent after it, the one already sent behind it is answered
(and counts when stored), and every window not stored over the stream goes over ZMQ
(:meth:`StreamPut.rest`); the windows stored stay stored and count in the result. They are
not retried on the stream: ``capacity`` means other clients hold its quota now, and ZMQ takes
the rest without waiting for them. Another error reply to a window is kept, the later windows
sent all the same, and it is raised once the put is done (as over ZMQ: the first window's
error, after every window's reply). ``Unavailable`` (the daemon gone with a window
outstanding) is raised at once; the windows stored before it stay stored.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvserver.client.calls import PutResult
from kvserver.client.common import Session
from kvserver.client.parts import Parts
from kvserver.client.stream import NotHere, StreamLink
from kvserver.errors import (
    CapacityError,
    KVServerError,
    Unauthenticated,
    Unavailable,
    UnknownNamespace,
)

#: a window reserves at most 1/QUOTA_SHARE of the daemon's quota for stream puts in flight,
#: so two clients' windows fit in it at once (one alone proceeds whatever its size). Each
#: window costs the daemon a reservation and a completion of its own: a quarter of the quota
#: made a 128 MiB put 2-17 ms slower than one request, half of it 3-7 ms (docs/benchmarks.md).
QUOTA_SHARE = 2

#: the largest result reply a pipelined window may have (module docstring): well within a
#: loopback socket's smallest receive buffer.
PIPELINE_REPLY_BYTES = 32 << 10

#: error replies after which the rest of the put goes over ZMQ (``StreamUse.call``'s).
_TO_ZMQ = (CapacityError, UnknownNamespace, Unauthenticated)


def stream_quota(s: Session) -> int | None:
    """The daemon's ``stream_put_max_reserved`` from its last hello (None: not announced, an
    older daemon; the put is then one request)."""
    value = s.server.get("stream_put_max_reserved")
    return value if type(value) is int and value > 0 else None


def stream_windows(
    parts: Parts, max_payload: int, max_reserved: int, page: int
) -> list[tuple[int, int]]:
    """``[start, end)`` runs of consecutive keys (whole keys), each of at most ``max_payload``
    bytes of payload and ``max_reserved`` bytes of pages (each part rounded up to ``page``,
    the DRAM the daemon reserves for it); a key over either is a run of its own. One run when
    all fit. Entries are not checked here: the daemon checks each window as any put."""
    runs: list[tuple[int, int]] = []
    start = size = held = 0
    page = max(page, 1)
    for i, entry in enumerate(parts):
        try:
            sizes = [memoryview(entry).nbytes]
        except TypeError:  # one buffer per rank
            sizes = [memoryview(p).nbytes for p in entry]
        nbytes, pages = sum(sizes), sum(-(-n // page) * page for n in sizes)
        if i > start and (size + nbytes > max_payload or held + pages > max_reserved):
            runs.append((start, i))
            start, size, held = i, 0, 0
        size, held = size + nbytes, held + pages
    runs.append((start, len(parts)))
    return runs


class StreamPut:
    """One client ``put`` as a call on the link (module docstring): ``StreamUse.call`` runs
    it and returns it, or None when the stream stopped part way (or at once). Then
    :meth:`rest` is what goes over ZMQ, and :meth:`merge` the put's result with ZMQ's.
    ``error``: the first error reply to a window, raised by the caller once the put is done.

    Pipelined: the next window is sent before the reply to the one before it is read (one
    reply outstanding at most), so the daemon's completing a window and its reply overlap
    the next window's bytes, as ZMQ's windows do. Only when that reply is small
    (:data:`PIPELINE_REPLY_BYTES`): the daemon sends it while the client is still sending,
    and it must fit the client's socket buffer (else both would wait on each other)."""

    def __init__(
        self,
        s: Session,
        ns_id: str,
        keys: Sequence[bytes],
        parts: Parts,
        lease_s: float | None,
        timeout: float,
    ) -> None:
        self._s, self._ns_id, self._lease_s, self._timeout = s, ns_id, lease_s, timeout
        self.keys, self.parts = keys, parts
        #: the windows cut (:meth:`windows`), once the link is known
        self.cut: list[tuple[int, int]] = []
        #: the stream's answer of each window answered (None: an error reply)
        self.done: dict[int, PutResult | None] = {}
        self.error: KVServerError | None = None

    def windows(self, link: StreamLink) -> list[tuple[int, int]]:
        """This put's windows on ``link`` (one: an older daemon, or keys and parts that do
        not pair up, which the daemon refuses whole)."""
        quota = stream_quota(self._s)
        if quota is None or len(self.keys) != len(self.parts):
            return [(0, len(self.keys))]
        page = self._s.server.get("page_size")
        page = page if type(page) is int and page > 0 else 1
        return stream_windows(self.parts, link.max_payload, quota // QUOTA_SHARE, page)

    def __call__(self, link: StreamLink) -> StreamPut:
        """Send the windows; see the class docstring. Raises what ends the stream's part
        (``NotHere``, ``StreamFailed``, an error of ``_TO_ZMQ``: ``StreamUse`` turns each into
        "over ZMQ"), or Unavailable; a reply still outstanding is read first when the link
        stays usable."""
        self.cut = self.windows(link)
        waiting: deque[tuple[int, int, float]] = deque()  # (window, request id, deadline)
        stop: BaseException | None = None
        for index, (start, end) in enumerate(self.cut):
            if stop is not None:
                break
            keys, parts = self.keys[start:end], self.parts[start:end]
            deadline = time.monotonic() + self._timeout
            try:
                request_id = link.send_put(self._ns_id, keys, parts, self._lease_s,
                                           self._s.client_id, deadline,
                                           outstanding=bool(waiting))  # fmt: skip
            except NotHere as exc:  # one key over max_message_bytes: nothing sent
                stop = exc
                break
            waiting.append((index, request_id, deadline))
            while len(waiting) > 1 or (waiting and _reply_bytes(keys) > PIPELINE_REPLY_BYTES):
                found = self._collect(link, *waiting.popleft())
                stop = stop or found
        while waiting:
            found = self._collect(link, *waiting.popleft())
            stop = stop or found
        if stop is not None:
            raise stop
        return self

    def _collect(
        self, link: StreamLink, index: int, request_id: int, deadline: float
    ) -> BaseException | None:
        """Read window ``index``'s reply; returns what stops the stream's part (NotHere or an
        error of ``_TO_ZMQ``; that window not done), else None. Raises StreamFailed and
        Unavailable (the link unusable)."""
        try:
            self.done[index] = link.put_reply(request_id, deadline)
        except (NotHere, *_TO_ZMQ) as exc:
            return exc
        except Unavailable:
            raise
        except KVServerError as exc:  # this window refused; the others go on, as over ZMQ
            self.error = self.error or exc
            self.done[index] = None
        return None

    def rest(self) -> tuple[list[bytes], list[Any]]:
        """The keys and parts of the windows the stream did not answer, in order (all of
        them when the stream was not used)."""
        if not self.cut:
            return list(self.keys), list(self.parts)
        keys: list[bytes] = []
        parts: list[Any] = []
        for index, (start, end) in enumerate(self.cut):
            if index not in self.done:
                keys.extend(self.keys[start:end])
                parts.extend(self.parts[start:end])
        return keys, parts

    def merge(self, zmq: PutResult | None) -> PutResult:
        """The put's result: the stream's windows and ``zmq`` (the rest's), each list in the
        order of the put's keys, as ``ops.merge_puts`` gives the ZMQ windows'."""
        results = [r for r in self.done.values() if r is not None]
        if zmq is not None:
            results.append(zmq)
        if len(results) == 1:
            return results[0]
        order = {key: i for i, key in enumerate(self.keys)}

        def ordered(lists: list[list[bytes]]) -> list[bytes]:
            return sorted((k for run in lists for k in run), key=lambda k: order.get(k, -1))

        return PutResult(
            ordered([r.stored for r in results]),
            ordered([r.present for r in results]),
            ordered([r.filtered for r in results]),
            rejected=any(r.rejected for r in results),
        )


def _reply_bytes(keys: Sequence[bytes]) -> int:
    """A bound on a put's result reply for ``keys`` (each key at most once in its lists,
    msgpack's bin header at most 5 bytes, the map's keys and the head besides)."""
    return sum(len(k) + 5 for k in keys) + 256
