"""Fetches from peers under way, and placing what they bring in DRAM.

Runs in the daemon process, on its event loop; part of :class:`~kvserver.daemon.peers.tier.
PeerTier`. Not thread-safe: loop only.

:meth:`PeerFetches.fetch` is given the keys a load needs from peers (each with the hosts the
directory says hold it) and:

1. claims the keys no other fetch is bringing; for the others it waits (without asking again)
   for the fetch that claimed them;
2. cuts its own keys into runs, one per peer: each key goes to a holder that is not suspect,
   preferring the one that holds the longest run from that key (between equals, the one that
   last sent chunks of the namespace: :meth:`PeerFetches.last_sender`), so a prompt held by
   one peer is one call per window of :data:`WINDOW_BYTES` (``stream_window_bytes``, by
   default :data:`STREAM_WINDOW_BYTES`, over a peer's stream); a peer's windows are
   pipelined on one of its link's connections (``PeerLink.connection``), each bounded by the
   peer timeout: they arrive one after another, in order, so each window is copied into DRAM
   while the next is still on the wire (windows on separate connections would arrive
   together, at the end); over ZMQ as many in flight as fill half the peer's cap on unsent
   replies (``zmq_windows.py``), over a stream all are asked at once; different peers are
   asked concurrently;
3. as each run arrives (already checked: one part per rank of ``part_bytes``), places it in
   DRAM as an SSD promotion does (:class:`~kvserver.daemon.peers.place.Placer`): one
   ``prepare_store(gated=False)`` for the run (protecting from the eviction it may cause the
   request's keys already in DRAM and the windows of the same fetch placed before it: a fetch
   larger than DRAM keeps its leading windows, which a load can use, not its last ones),
   ``write_part`` of every part, ``complete_store`` of the keys written; the BlockStored events
   then go out on the normal path (``publish``), which also announces the chunks in the fleet
   index. Over a peer's stream port (``PeerLink.stream``: it advertises one this daemon may
   dial) the windows are asked the same way on one stream connection, as a pipeline: a window's
   pages are reserved before its reply comes (the first while the peer looks its keys up, each
   next one while the window before it is on the wire), a worker thread receives each reply,
   head and payload, straight into them (no ``write_part`` copy), and the window before is
   completed meanwhile; a window's keys are completed once every part of it has arrived (its
   leading chunks as soon as they are in, while its last :data:`EARLY_TAIL_BYTES` are on the
   wire, when DRAM reserved every key: ``Placer.complete_early``), those
   the reply did not bring (a peer holding a shorter run) and every key of a reply cut short
   are rolled back (the receiving thread is stopped before the pages are given back:
   ``stream.py``). Reserving ahead can evict, for chunks the peer then does not send, at most
   two windows' worth of DRAM per fetch (``stream_window_bytes``);
4. keys a peer did not send (it no longer holds them, it failed, it timed out) are tried once
   more with another holder; after that they are a miss (the load reports them missing). A
   peer that failed or timed out is marked suspect.

When DRAM cannot take a run (every page pinned or reserved) and the caller asked for
``direct``, its checked parts are returned instead, for a remote ``get`` to send on.

Invariant: a (namespace, key) is in the in-flight map from the moment one fetch claims it until
that fetch has finished with it (placed, returned direct, or given up), and maps to that
fetch's future, which is resolved exactly then with its direct parts ({} on failure or
cancellation), never with an exception.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from kvserver.daemon.config import DEFAULT_PEER_STREAM_WINDOW
from kvserver.daemon.peers import zmq_windows
from kvserver.daemon.peers.book import PeerBook
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.link import PeerFailed
from kvserver.daemon.peers.place import Parts, Placer, Slot
from kvserver.daemon.peers.stream import PeerStream
from kvserver.daemon.peers.stream_connection import ReplyJob
from kvserver.engine import StorageEngine
from kvserver.errors import CapacityError, UnknownKey, UnknownNamespace
from kvserver.namespace import NamespaceSpec
from kvserver.wire_stream import MAX_KEYS, ReplyHead

logger = logging.getLogger(__name__)

#: rounds of fetching: the first holder of each key, then another for what it did not send.
ROUNDS = 2
#: a run is asked for in windows of at most this many payload bytes (at least one chunk
#: each), pipelined on one connection; each is copied into the arena as soon as it has
#: arrived, while the later ones are still on the wire.
WINDOW_BYTES = 4 << 20
#: the same over a peer's stream, where a window is received straight into pages reserved
#: before its reply (the first while the peer looks its keys up, each next one while the
#: window before it is on the wire) and completed while the next one is received. A window
#: costs one request, one reservation and one hand-over to the receiving thread, and each
#: hand-over can wait for a core: 8 MiB windows (four per 32 MiB fetch) were ~5 ms slower
#: per 32 MiB fetch than one 32 MiB window on the shared 2-core machine (bench_peers,
#: docs/benchmarks.md, "Pipelined stream windows"). A peer failing mid-window loses that
#: window's keys. The default of ``PeerFetches(stream_window_bytes=)``: ``peer_stream_window``.
STREAM_WINDOW_BYTES = DEFAULT_PEER_STREAM_WINDOW

#: over a peer's stream, a window's chunks but about this many payload bytes at its end (at
#: least one chunk) are made ready as soon as they have arrived, while these last ones are
#: still on the wire (``StreamConnection.start_reply(early=)``, ``Placer.complete_early``):
#: after the window's last byte only these are left to complete. Enough bytes that the
#: completion of the others (~0.2 ms for 112 chunks of 256 KiB) is done before they arrive.
EARLY_TAIL_BYTES = 4 << 20

#: namespaces whose last sender is remembered at most (the oldest are dropped first).
SENDERS_MAX = 4096


def windows_of(
    runs: list[list[bytes]], chunk_bytes: int, window_bytes: int, max_keys: int = MAX_KEYS
) -> list[list[bytes]]:
    """``runs`` cut into windows of at most ``window_bytes`` (at least one chunk each) and
    ``max_keys`` keys (the most a peer stream request may name)."""
    per = max(1, min(window_bytes // chunk_bytes, max_keys))
    return [keys[j : j + per] for keys in runs for j in range(0, len(keys), per)]


class PeerFetches:
    """The fetches of one daemon under way; see the module docstring."""

    def __init__(
        self,
        engine: StorageEngine,
        book: PeerBook,
        *,
        publish: Callable[[], None],
        stream_window_bytes: int = STREAM_WINDOW_BYTES,
    ) -> None:
        self._engine = engine
        self._book = book
        self._placer = Placer(engine, book, publish)
        #: a run is asked of a peer's stream in windows of at most this many payload bytes.
        self.stream_window_bytes = stream_window_bytes
        self._inflight: dict[tuple[str, bytes], asyncio.Future[Parts]] = {}
        #: ns_id -> the peer that last sent chunks of it, oldest first (``last_sender``).
        self._senders: dict[str, str] = {}

    def last_sender(self, ns_id: str) -> str | None:
        """The peer that most recently sent chunks of ``ns_id`` (None: none yet): a hint
        whom to ask first, never trusted for what it holds."""
        return self._senders.get(ns_id)

    def _note_sender(self, ns_id: str, host_id: str) -> None:
        senders = self._senders
        senders.pop(ns_id, None)  # re-inserted last: the newest
        senders[ns_id] = host_id
        while len(senders) > SENDERS_MAX:
            del senders[next(iter(senders))]

    @property
    def num_in_flight(self) -> int:
        """Keys claimed by a fetch that has not finished."""
        return len(self._inflight)

    def in_flight(self, ns_id: str, key: bytes) -> bool:
        return (ns_id, key) in self._inflight

    async def drain(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, for the fetches under way to finish (each is bounded
        by its windows' peer timeouts): at shutdown, so that no receiving thread still writes
        into arena pages when the arena goes. True when none is left."""
        pending = list({id(f): f for f in self._inflight.values()}.values())
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        return not self._inflight

    async def fetch(
        self,
        spec: NamespaceSpec,
        wanted: Sequence[tuple[bytes, frozenset[str]]],
        peers: Mapping[str, Peer],
        *,
        protect: Sequence[bytes] = (),
        direct: bool = False,
        guessed: frozenset[bytes] = frozenset(),
    ) -> Parts:
        """Bring the keys of ``wanted`` (key, holders) into DRAM (see the module docstring);
        returns, when ``direct``, the parts of keys DRAM could not take, else {}. The holders
        of the ``guessed`` keys are a guess, not the directory's word: one that does not
        send them is no miss (``missed_chunks``)."""
        ns_id = spec.ns_id
        mine: list[tuple[bytes, frozenset[str]]] = []
        theirs: dict[int, asyncio.Future[Parts]] = {}
        wanted_holders = dict(wanted)
        absent = set(self._engine.missing(ns_id, wanted_holders))
        if not self._inflight:  # usually: no other fetch under way, nothing to join
            mine = [(key, holders) for key, holders in wanted_holders.items() if key in absent]
        else:
            for key, holders in wanted_holders.items():
                fut = self._inflight.get((ns_id, key))
                if fut is not None:
                    theirs[id(fut)] = fut
                    self._book.counters.joined_chunks += 1
                elif key in absent:
                    mine.append((key, holders))
        out: Parts = {}
        if mine:
            out.update(await self._run(spec, mine, peers, protect, direct, guessed))
        for fut in theirs.values():
            shared = await asyncio.shield(fut)  # our cancellation must not cancel theirs
            if direct:
                out.update((k, v) for k, v in shared.items() if k in wanted_holders)
        return out

    async def _run(
        self,
        spec: NamespaceSpec,
        mine: list[tuple[bytes, frozenset[str]]],
        peers: Mapping[str, Peer],
        protect: Sequence[bytes],
        direct: bool,
        guessed: frozenset[bytes],
    ) -> Parts:
        """Claim ``mine``, fetch and place them, release the claim, share the result."""
        ns_id = spec.ns_id
        fut: asyncio.Future[Parts] = asyncio.get_running_loop().create_future()
        for key, _ in mine:
            self._inflight[(ns_id, key)] = fut
        got: Parts = {}
        try:
            todo = mine
            asked: dict[str, set[bytes]] = {}  # per peer, the keys asked of it
            for _round in range(ROUNDS):
                runs = self._plan(ns_id, todo, peers, asked)
                if not runs:
                    break
                by_peer: dict[str, list[list[bytes]]] = {}
                for h, keys in runs:
                    by_peer.setdefault(h, []).append(keys)  # a peer's runs, in order
                calls = [self._fetch_windows(spec, peers[h], ws, protect, direct)
                         for h, ws in by_peer.items()]  # fmt: skip
                # one peer (usually): awaited in this task, no task and loop turn for it
                results = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
                done: set[bytes] = set()
                for h, windows in zip(by_peer, results, strict=True):
                    for sent, parts in windows:
                        done.update(sent)
                        got.update(parts)
                        if sent:
                            self._note_sender(ns_id, h)
                # the keys sent are keys of ``todo`` (each once): as many means all of them
                todo = [] if len(done) == len(todo) else [(k, h) for k, h in todo if k not in done]
            self._book.counters.missed_chunks += sum(k not in guessed for k, _ in todo)
            return got
        finally:
            for key, _ in mine:
                del self._inflight[(ns_id, key)]
            fut.set_result(got)

    def _plan(
        self,
        ns_id: str,
        todo: list[tuple[bytes, frozenset[str]]],
        peers: Mapping[str, Peer],
        asked: dict[str, set[bytes]],
    ) -> list[tuple[str, list[bytes]]]:
        """Runs of consecutive keys, one holder each (see the module docstring; between
        holders of equally long runs, the one that last sent chunks of ``ns_id``), leaving
        out for each key the peers already ``asked`` for it (per peer, its keys); records
        in ``asked`` whom each key is asked."""
        book = self._book
        # keys mostly share their holders (one frozenset): usable holders once per set
        memo: dict[frozenset[str], frozenset[str]] = {}
        usable: list[frozenset[str]] = []
        for k, hs in todo:
            hosts = memo.get(hs)
            if hosts is None:
                hosts = memo[hs] = frozenset(h for h in hs if h in peers and not book.is_suspect(h))
            if asked:
                hosts = frozenset(h for h in hosts if k not in asked.get(h, ()))
            usable.append(hosts)
        prefer = self._senders.get(ns_id)
        runs: list[tuple[str, list[bytes]]] = []
        n, i = len(todo), 0
        while i < n:
            if not usable[i]:
                i += 1
                continue

            def reach(h: str, start: int = i) -> int:
                j = start
                while j < n and h in usable[j]:
                    j += 1
                return j

            if len(usable[i]) == 1:
                (best,) = usable[i]
            else:
                best = max(sorted(usable[i], key=lambda h: (h != prefer, h)), key=reach)
            end = reach(best)
            keys = [k for k, _ in todo[i:end]]
            asked.setdefault(best, set()).update(keys)
            runs.append((best, keys))
            i = end
        return runs

    async def _fetch_windows(
        self,
        spec: NamespaceSpec,
        peer: Peer,
        runs: list[list[bytes]],
        protect: Sequence[bytes],
        direct: bool,
    ) -> list[tuple[list[bytes], Parts]]:
        """Fetch ``runs`` from ``peer`` in windows (of :data:`WINDOW_BYTES` over ZMQ, of
        ``stream_window_bytes`` over its stream), pipelined on one connection, placing
        each as it arrives; per window (keys it sent, direct parts)."""
        link = self._book.link(peer)
        chunk_bytes = spec.part_bytes * spec.tp_world_size
        try:
            stream = await link.stream()
        except PeerFailed as exc:  # its hello failed: the windows were asked of a dead peer
            self._book.counters.fetches += len(windows_of(runs, chunk_bytes, WINDOW_BYTES))
            self._book.failed(peer, exc)
            return []
        if stream is not None:
            windows = windows_of(runs, chunk_bytes, self.stream_window_bytes)
            return await self._stream_windows(spec, peer, stream, windows, protect, direct)
        windows = windows_of(runs, chunk_bytes, WINDOW_BYTES)
        return await zmq_windows.fetch_windows(
            self._book, self._placer, spec, peer, windows, protect, direct
        )

    async def _stream_windows(
        self,
        spec: NamespaceSpec,
        peer: Peer,
        stream: PeerStream,
        windows: list[list[bytes]],
        protect: Sequence[bytes],
        direct: bool,
    ) -> list[tuple[list[bytes], Parts]]:
        """``_fetch_windows`` over the peer's stream port, every window asked at once on one
        connection and received in order, each within the peer timeout, as a pipeline: a
        window's pages are reserved (:meth:`_slot`) before its reply comes, the first while
        the peer looks its keys up, each next one while the window before it is on the wire;
        a worker thread receives each reply whole, head and payload, straight into them
        (``StreamConnection.start_reply``: one hand-over per window), and the window before
        it is completed meanwhile. A failure ends the windows after it too (their keys go to
        another holder or miss); the pages of a window that did not arrive, and those of
        chunks a reply did not bring, are given back."""
        book, tp, size = self._book, spec.tp_world_size, spec.part_bytes
        tail = max(1, EARLY_TAIL_BYTES // (tp * size))  # chunks completed after the last byte
        out: list[tuple[list[bytes], Parts]] = []
        ahead: list[Slot] = []  # reserved, not yet settled (at most two)
        keep = set(protect)  # and the windows already placed: a later one must not evict them

        def on_head(head: ReplyHead) -> None:  # on the loop, as a reply's head arrives
            book.counters.fetched_chunks += head.count
            book.counters.fetched_bytes += head.count * tp * size

        job: ReplyJob | None = None
        try:
            async with stream.connection() as conn:
                deadline = time.monotonic() + stream.timeout_s
                ids = await conn.send_requests(spec.ns_id, windows, deadline)
                ahead.append(self._placer.slot(spec, windows[0], keep))  # while the peer looks up

                def start(k: int) -> ReplyJob:  # receive window k into ahead[0]
                    book.counters.fetches += 1
                    book.counters.stream_fetches += 1
                    deadline = time.monotonic() + stream.timeout_s
                    slot = ahead[0]
                    early = len(slot.keys) - tail if slot.can_complete_early else 0
                    return conn.start_reply(
                        ids[k], slot.rows, tp, size, deadline, on_head, early=early,
                        on_early=lambda count: self._placer.complete_early(slot, count),
                    )  # fmt: skip

                job = start(0)
                for k in range(len(windows)):
                    if k + 1 < len(windows):  # while window k is on the wire
                        ahead.append(self._placer.slot(spec, windows[k + 1], keep))
                    assert job is not None  # started for every window
                    head, error = await job.result()
                    slot = ahead.pop(0)
                    job = start(k + 1) if k + 1 < len(windows) else None  # already coming
                    if error is None:
                        out.append(self._placer.settle(spec, slot, head.count, direct))
                        keep.update(out[-1][0])
                        continue
                    self._placer.settle(spec, slot, 0, direct)  # an error reply: no chunks
                    # none held, or too busy now (capacity: its SSD read buffers): a clean
                    # answer, the window left to another holder; anything else is a fault
                    if not isinstance(error, (UnknownNamespace, UnknownKey, CapacityError)):
                        raise PeerFailed(f"peer refused: {error}", timed_out=False,
                                         peer=conn.peer_id)  # fmt: skip
                    out.append(([], {}))
        except PeerFailed as exc:
            book.failed(peer, exc)
        finally:
            if job is not None:  # its thread ends before its pages are given back
                await job.stop()
            for slot in ahead:  # not received: given back (but the keys made ready early)
                sent, parts = self._placer.settle(spec, slot, 0, direct)
                if sent:
                    out.append((sent, parts))
        return out
