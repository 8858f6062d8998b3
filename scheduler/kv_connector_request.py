"""What the scheduler connector keeps about one request (:class:`RequestState`).

Runs in the scheduler process, on the scheduler's thread; not thread-safe. One instance per
request known to :class:`~scheduler.kv_connector.KVServerSchedulerConnector`; the load
planner, the store planner and the lease book change it only through the methods below, each
named after the event that causes the change.

Invariants (stated once, here, and enforced by the methods):

- **A chunk below the cursor is never planned again.** ``cursor`` is the next chunk index to
  store: chunks below it are stored, being stored, loaded from kvserver, or
  were refused for good. :meth:`store_planned` raises ``InvalidState`` for a plan that starts
  below it. The cursor moves forward when a store reservation is answered
  (:meth:`store_reserved`, :meth:`store_refused` for good), and back only in two cases:
  :meth:`restart` — the request got a new block table (new, or preempted and admitted again):
  stores resume at chunk 0, or past the chunks loaded from kvserver (the daemon's presence
  filter keeps chunks stored before from being copied again); :meth:`load_failed` — a rank
  failed to load a chunk, which is recomputed and so is stored afterwards.
- ``num_loads`` counts the request's load jobs; ``num_stores`` its store jobs plus one for its
  share of the store batch in flight (until a job takes its place, or the reply gave it none).
  Neither goes below 0 (``InvalidState``).
- Every change of the cursor, and a refused store, puts the request on its ``watch`` list
  (the store calendar's ``moved``, :mod:`scheduler.kv_connector_due`), so that the next step
  checks it again — but a granted reservation (:meth:`store_reserved`): the planner filed the
  request under the step its next chunk fills when its stores went out
  (``StoreCalendar.planned``), which is where that check would file it.
- Once :meth:`finish_when_idle` returned True (the scheduler let the request go while
  transfers were in flight), :attr:`is_done` turns True when the last transfer is over; the
  connector then reports it in ``finished_sending`` and forgets it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserver.errors import InvalidState
from kvserver.hashing import BlockHash, BlockHasher
from scheduler.connector_base import RequestLike

#: (num_local_tokens, first chunk, hit keys, end of the offer in tokens) of the last lookup,
#: until allocation.
Offer = tuple[int, int, list[bytes], int]
#: (keys looked up, leading hits, clock at the lookup, ``LeaseBook.change_mark`` then) of the
#: request's last lookup, reused by the next offer while it stays valid
#: (:class:`~scheduler.kv_connector_loads.LoadPlanner`), until allocation.
LastLookup = tuple[list[bytes], int, float, int]


class RequestState:
    """One request's block table, store cursor, transfers in flight and lookup offer."""

    __slots__ = ("_cursor", "_hashes", "_num_loads", "_num_stores", "_watch", "block_ids",
                 "checked", "finished", "last_lookup", "offer", "order", "request",
                 "wake")  # fmt: skip

    def __init__(self, request: RequestLike, watch: list[RequestState] | None = None) -> None:
        """``watch``: where the request puts itself whenever its cursor changes."""
        self.request = request
        self._watch = watch
        #: owned by the store calendar (scheduler/kv_connector_due.py): the step it is filed
        #: under, the last step that checked it, its place in the step order.
        self.wake = self.checked = self.order = 0
        #: the request's GPU blocks from block 0 (read by the planners; set by the methods).
        self.block_ids: list[int] = []
        #: the hit offered by the last lookup, until allocation (:meth:`take_offer`).
        self.offer: Offer | None = None
        #: the last lookup's answer, until allocation (:meth:`looked_up`, :meth:`take_offer`).
        self.last_lookup: LastLookup | None = None
        #: request_finished returned True: report finished_sending when the jobs are over.
        self.finished = False
        self._cursor = 0
        self._num_loads = 0
        self._num_stores = 0
        #: block hashes computed here when the request carries none.
        self._hashes: list[bytes] = []

    def __repr__(self) -> str:
        return (
            f"RequestState({self.request.request_id!r}, cursor={self._cursor}, "
            f"loads={self._num_loads}, stores={self._num_stores}, finished={self.finished})"
        )

    # ------------------------------------------------------------------ reading

    @property
    def req_id(self) -> str:
        return self.request.request_id

    @property
    def cursor(self) -> int:
        """The next chunk to store; every chunk below it is never planned again."""
        return self._cursor

    @property
    def num_loads(self) -> int:
        return self._num_loads

    @property
    def num_stores(self) -> int:
        return self._num_stores

    @property
    def is_busy(self) -> bool:
        """A load or store of the request is planned or in flight."""
        return bool(self._num_loads or self._num_stores)

    @property
    def is_done(self) -> bool:
        """Let go by the scheduler and nothing planned or in flight: its blocks may be freed."""
        return self.finished and not self._num_loads and not self._num_stores

    def block_hashes(self, hasher: BlockHasher) -> Sequence[bytes]:
        """The request's own block hashes, else ones computed (and extended) here with
        ``hasher`` (the namespace's)."""
        req = self.request
        if req.block_hashes:
            return req.block_hashes
        bs, done, tokens = hasher.block_size, len(self._hashes), req.all_token_ids
        if len(tokens) // bs > done:
            self._hashes += hasher.hash_blocks(
                tokens[done * bs : len(tokens) // bs * bs],
                cache_salt=req.cache_salt,
                lora=_lora(req),
                parent=BlockHash(self._hashes[-1]) if done else None,
                start_block=done,
            )
        return self._hashes

    # ------------------------------------------------------------------ admission

    def offered(self, offer: Offer | None) -> None:
        """The last lookup's hit (None: nothing offered)."""
        self.offer = offer

    def looked_up(self, lookup: LastLookup | None) -> None:
        """The daemon answered a lookup of the request (None: forget the last answer)."""
        self.last_lookup = lookup

    def take_offer(self, block_ids: Sequence[int]) -> Offer | None:
        """Blocks were allocated: the request's block table is ``block_ids`` from now on; the
        offer (if any) is returned and forgotten, and so is the last lookup's answer."""
        offer, self.offer = self.offer, None
        self.last_lookup = None
        self.block_ids = list(block_ids)
        return offer

    def restart(self, at: int) -> None:
        """The request has a new block table (it is new, or was preempted and admitted
        again): stores resume at chunk ``at`` (0, or past the chunks loaded from kvserver)."""
        self._move(at)

    def preempted(self) -> None:
        """The scheduler took the request's blocks back."""
        self.block_ids, self.offer = [], None

    def finish_when_idle(self) -> bool:
        """The scheduler is done with the request: True (keep its blocks until
        :attr:`is_done`) while a transfer is planned or in flight, else False."""
        if self._num_loads or self._num_stores:
            self.finished, self.offer = True, None
            return True
        return False

    # ------------------------------------------------------------------ block table

    def new_block_table(self, block_ids: Sequence[int]) -> None:
        self.block_ids = list(block_ids)

    def append_blocks(self, block_ids: Sequence[int]) -> None:
        self.block_ids += block_ids

    # ------------------------------------------------------------------ loads

    def load_pinned(self, end: int) -> None:
        """A load of its chunks up to ``end`` (exclusive) was pinned for a new block table:
        one load job more, and stores resume past the loaded chunks."""
        self.restart(end)
        self._num_loads += 1

    def load_finished(self) -> None:
        """One load job is over (every rank reported it, or its lease expired)."""
        if not self._num_loads:
            raise InvalidState("no load in flight", request=self.req_id)
        self._num_loads -= 1

    def load_failed(self, chunk: int) -> None:
        """A rank failed to load chunk ``chunk``: it is recomputed, so it is stored later."""
        if chunk < self._cursor:
            self._move(chunk)

    # ------------------------------------------------------------------ stores

    def store_planned(self, first: int, end: int) -> None:
        """Chunks ``[first, end)`` go out in this step's store batch: its share of the batch.
        Raises InvalidState (nothing changed) if ``first`` is below the cursor: a chunk below
        the cursor is never planned again."""
        if first < self._cursor or end <= first:
            raise InvalidState(
                "a chunk below the store cursor is never planned again",
                request=self.req_id, first=first, end=end, cursor=self._cursor,
            )  # fmt: skip
        self._num_stores += 1

    def store_reserved(self, end: int) -> None:
        """The batch's reservation was answered: its chunks below ``end`` are stored, being
        stored, or present already. Its share of the batch stays counted: as its store job,
        or until :meth:`store_share_over`. Not on the watch list: the planner filed the
        request for the cursor at ``end`` when it planned (``StoreCalendar.planned``)."""
        if self._cursor < end:
            self._cursor = end

    def store_refused(self, end: int, *, for_good: bool) -> None:
        """No reservation: its share of the batch is over. ``for_good``: the daemon refused
        the chunks below ``end`` (they would fail again: skipped); else (unreachable, cache
        full) they are planned again next step."""
        self.store_share_over()
        if for_good and self._cursor < end:
            self._move(end)
        elif self._watch is not None:  # the chunks are due again
            self._watch.append(self)

    def store_share_over(self) -> None:
        """Its share of the store batch ended without a job."""
        self._store_over()

    def store_finished(self) -> None:
        """One store job is over (every rank reported it, or its lease expired)."""
        self._store_over()

    def _move(self, cursor: int) -> None:
        self._cursor = cursor
        if self._watch is not None:
            self._watch.append(self)

    def _store_over(self) -> None:
        if not self._num_stores:
            raise InvalidState("no store in flight", request=self.req_id)
        self._num_stores -= 1


def _lora(request: RequestLike) -> tuple[str, str] | None:
    """(name, path) of vLLM's ``request.lora_request`` when the request has one."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else (str(lora.lora_name), str(lora.lora_path))
