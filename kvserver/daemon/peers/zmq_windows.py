"""A fetch's windows over a peer's ZMQ data plane, under the peer's cap on unsent replies.

Runs in the daemon process, on its event loop; part of :class:`~kvserver.daemon.peers.fetch.
PeerFetches` (used only from there), for a peer without a stream port this daemon may dial
(a fleet with CURVE and no TLS certificate). Not thread-safe: loop only.

Flow control. The serving daemon pins each zero-copy ``get`` reply until ZMQ has sent it,
and answers ``capacity`` to a ``get`` that arrives while the connection has
``zmq_send_max_unsent`` bytes or more unsent in two replies or more (``zmq_send.py``, a
quarter of its DRAM by default). Asking every window of a fetch at once (session 10) made a
fetch larger than that cap be refused part of its windows every time (then asked again one by
one). So :func:`fetch_windows` keeps at most ``n`` windows asked and not yet received on its
connection (:meth:`PeerLink.windows_in_flight`), asking the next one as each reply arrives:
when this daemon asks a window, the peer counts as unsent the ``n - 1`` others in flight and
those just received whose pin's release lags their last byte (it reaches the peer's loop from
pyzmq's gc thread, which a loaded host can keep waiting: three windows of 4 MiB were seen
lagging on the shared 2-core machine), so ``n`` windows fill half the cap its ``hello``
announces (``zmq_send_max_unsent``, asked once per link) and the other half is the slack for
those: a 32 MiB fetch from a peer with 128 MiB of DRAM (cap 32 MiB) has 4 of its 8 windows
of 4 MiB in flight at once, one with many GiB all of them. A peer that announces no cap (older) gets
:data:`~kvserver.daemon.peers.link.ZMQ_WINDOWS_IN_FLIGHT` (two: one is copied into DRAM while
the next is on the wire). Recovery: a refused window (releases that lagged more, or an older
peer's cap under four windows) is counted (``refused_windows``), the rest of that fetch asks
one window at a time (one unsent reply is never refused), the link's later fetches one fewer
than it had in flight, and the window is asked again once; refused again, it is not sent
(another holder, or a miss). The peer is not suspect for a refusal and the connection is
kept; nor for a ``capacity`` that is not its cap (too busy: its SSD read buffers), whose
window is not sent and not asked again.

A window that fails (:class:`PeerFailed`: a timeout, a malformed reply) marks the peer suspect
and ends the fetch from it: the windows not yet asked are not asked (their keys go to another
holder, or miss), those in flight are awaited (each bounded by the peer timeout), so a dead
peer costs one timeout, not one per window. A cancelled fetch cancels its calls in flight
(their connection is closed, not reused: a late reply cannot be taken for another's).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from kvserver.client.aio import AsyncKVClient
from kvserver.daemon.peers.book import PeerBook
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.link import PeerFailed, PeerLink
from kvserver.daemon.peers.place import Parts, Placer
from kvserver.errors import CapacityError
from kvserver.namespace import NamespaceSpec

#: per window asked: (keys it sent, direct parts).
Sent = tuple[list[bytes], Parts]
#: what a ``capacity`` answer names when it is the cap on unsent replies (``zmq_send.py``
#: puts the setting in its message), not another bound (a peer's SSD read buffers: that
#: window is not sent, and the link keeps its windows in flight).
CAP_REFUSAL = "zmq_send_max_unsent"


async def fetch_windows(
    book: PeerBook,
    placer: Placer,
    spec: NamespaceSpec,
    peer: Peer,
    windows: list[list[bytes]],
    protect: Sequence[bytes],
    direct: bool,
) -> list[Sent]:
    """Fetch ``windows`` from ``peer`` on one connection of its link, at most
    ``link.windows_in_flight()`` in flight (module docstring), placing each as it arrives and
    protecting the windows placed before it from the eviction it may cause; per window asked
    (in the order received), (keys it sent, direct parts)."""
    link = book.link(peer)
    window_bytes = max((len(w) for w in windows), default=1) * spec.tp_world_size * spec.part_bytes
    try:
        depth = await link.windows_in_flight(window_bytes)
    except PeerFailed as exc:  # its hello failed: the windows were asked of a dead peer
        book.counters.fetches += len(windows)
        book.failed(peer, exc)
        return []
    try:
        async with link.connection() as kv:
            return await _pipeline(
                book, placer, spec, peer, link, kv, windows, protect, direct, depth
            )
    except PeerFailed as exc:  # no connection in time
        book.failed(peer, exc)
        return []


async def _pipeline(
    book: PeerBook,
    placer: Placer,
    spec: NamespaceSpec,
    peer: Peer,
    link: PeerLink,
    kv: AsyncKVClient,
    windows: list[list[bytes]],
    protect: Sequence[bytes],
    direct: bool,
    depth: int,
) -> list[Sent]:
    keep = set(protect)  # and the windows placed: a later one must not evict them
    todo: deque[tuple[list[bytes], bool]] = deque((w, False) for w in windows)  # (window, again)
    asked: deque[tuple[list[bytes], bool, asyncio.Task[Sent | None]]] = deque()
    out: list[Sent] = []
    failed = False
    try:
        while todo or asked:
            while todo and not failed and len(asked) < depth:
                window, again = todo.popleft()
                call = _window(book, placer, spec, peer, link, kv, window, keep, direct)
                asked.append((window, again, asyncio.ensure_future(call)))
            if not asked:
                break  # failed: the windows left are not asked
            window, again, task = asked.popleft()
            try:
                sent = await task
            except PeerFailed:
                failed = True  # counted and the peer marked suspect by ``_window``
                continue
            if sent is not None:
                out.append(sent)
                continue
            book.counters.refused_windows += 1
            if depth > 1:
                link.refused(depth)  # later fetches: one fewer in flight
            depth = 1  # this one: one unsent reply is never refused
            if not again:
                todo.appendleft((window, True))  # after the one in flight
    finally:
        for _, _, task in asked:  # cancelled: none is left running on the connection
            task.cancel()
        if asked:
            await asyncio.gather(*(t for _, _, t in asked), return_exceptions=True)
    return out


async def _window(
    book: PeerBook,
    placer: Placer,
    spec: NamespaceSpec,
    peer: Peer,
    link: PeerLink,
    via: AsyncKVClient,
    keys: list[bytes],
    keep: set[bytes],
    direct: bool,
) -> Sent | None:
    """Fetch one window from ``peer`` on ``via`` and place it, protecting the keys of
    ``keep`` from the eviction (and adding its own to it, for the windows after it); returns
    (keys it sent, direct parts), or None when the peer refused it at its cap on unsent
    replies (``capacity`` naming :data:`CAP_REFUSAL`: not counted as a fetch); another
    ``capacity`` (the peer too busy) sends nothing, the peer not suspect. Raises
    :class:`PeerFailed` (counted, the peer marked suspect)."""
    try:
        rows = await link.fetch(spec, keys, via=via)
    except CapacityError as exc:
        if CAP_REFUSAL in str(exc):
            return None
        book.counters.fetches += 1  # too busy now (its SSD read buffers): not sent, no fault
        return [], {}
    except PeerFailed as exc:
        book.counters.fetches += 1
        book.failed(peer, exc)
        raise
    book.counters.fetches += 1
    sent = keys[: len(rows)]
    book.counters.fetched_chunks += len(rows)
    book.counters.fetched_bytes += len(rows) * spec.tp_world_size * spec.part_bytes
    placed = placer.place(spec, sent, rows, keep, direct)
    keep.update(sent)
    return sent, placed
