"""Which scheduled requests have a chunk full after this step (:class:`StoreCalendar`).

Runs in the scheduler process, on the scheduler's thread; not thread-safe; part of the store
planner (:mod:`scheduler.kv_connector_stores`), which calls :meth:`StoreCalendar.take` once
per ``build_connector_meta``.

A request's next store is due once the tokens computed after the step reach the end of the
chunk at its store cursor: ``done >= (cursor + 1) * chunk_tokens``. Checking that for every
scheduled request every step costs a pass over the whole batch (256 decoding requests: ~40%
of what the connector adds to a scheduler step). A request in steady decode gains exactly one
token per step, so once checked at step ``v`` with ``done`` tokens it cannot be due before
step ``v + due - done``: the calendar files it under that step and leaves it alone until then.

Per step (``take``):

- every request in ``new_reqs`` gets its block table and is checked (as before);
- **calendar path**, when every cached request outside the *partial* set gained exactly one
  token, which ``num_scheduled_tokens`` tells in O(1): it names each scheduled request once
  with at least one token (both schedulers' contract), so its values sum to
  ``len(cached_reqs)`` plus the new requests' tokens plus what the partial requests took
  beyond one each exactly when that holds. Then the block ids of the cached requests that got
  new blocks are appended (one cheap pass), and only the requests filed under this step, the
  partial ones and those whose cursor moved are checked, with ``request.num_computed_tokens``
  (the tokens before this step: both schedulers advance it after ``build_connector_meta``);
- **scan path** otherwise (a cached request outside the partial set took several tokens:
  speculative tokens, a rewound request recomputing, one unknown to the connector): every
  cached request is checked, exactly as without the calendar.

Partial requests are those that took more than one token at their last check (a prompt
prefilled over several steps): they are checked every step until they take one token at a
time. A request whose store cursor moves otherwise than as planned (a refusal for good, a new
block table, a failed load) or whose reservation was refused puts itself on
:attr:`StoreCalendar.moved` (``RequestState``'s watch list) and is checked at the next step.
A request whose stores go out in the step's batch is filed at once (:meth:`StoreCalendar.planned`)
under the step its next chunk fills once the reservation moves its cursor to the planned end:
the step its check after the reply would file it under, without that check (in steady decode
about one request in eight per step).

Invariant (what makes the calendar exact): a request not partial, not moved and scheduled as a
cached request is filed under a step no later than the first step at which it can be due; a
due request is checked again at the next step — it stays due until its cursor moves: the
planner files it again unless its stores went out in the batch; then it is filed for the
cursor the granted reservation gives it (``store_reserved``), and a refusal puts it on the
watch list (``store_refused``), a failed send files it for the next step. So the due
requests found are exactly those the scan finds, the new ones first, then the cached ones in
the scheduler's running order, which is the step's order: the order they were given their
block tables, except that a step's new requests come before its resumed ones in
``new_reqs`` though the scheduler runs them in admission order, so each is numbered again
by its place in the first ``cached_reqs`` that lists it. The order matters when the batch
limit (halved after a full cache) leaves some due requests out. Were a scheduler to break
the contract above, a store would be planned late (a check compares ``done >= end``), never
skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from scheduler.kv_connector_request import RequestState
from scheduler.kv_connector_types import CachedReqLike, ScheduledStep

#: (request, tokens computed after this step) for each request with a chunk full after it.
Due = list[tuple[RequestState, int]]


class StoreCalendar:
    """The requests to check at each step; see the module docstring."""

    def __init__(self, chunk_tokens: int, *, scan_every_step: bool = False) -> None:
        """``scan_every_step``: always take the scan path (what the planner did before the
        calendar; the reference the tests compare it with)."""
        self._ct = chunk_tokens
        self._scan_every_step = scan_every_step
        self._step = 0
        #: step -> requests filed under it (an entry is stale once the request's ``wake``
        #: names another step).
        self._steps: dict[int, list[RequestState]] = {}
        #: requests that had tokens left to compute at their last check (insertion-ordered).
        self._partial: dict[RequestState, None] = {}
        #: requests whose store cursor moved since the last step (``RequestState`` appends).
        self.moved: list[RequestState] = []
        self._order = 0
        #: requests given a block table (``new_reqs``) and not yet seen in ``cached_reqs``:
        #: their place in the step order is known once they are (see :meth:`take`).
        self._fresh: dict[str, RequestState] = {}
        #: steps that had to check every cached request (for tests and profiles).
        self.scans = 0

    def clear(self) -> None:
        """Forget every request (the connector forgot them all)."""
        self._steps.clear()
        self._partial.clear()
        self._fresh.clear()
        self.moved.clear()

    def take(self, step: ScheduledStep, reqs: Mapping[str, RequestState]) -> Due:
        """Apply the step's block tables (``new_reqs`` replace, ``cached_reqs`` append) and
        return the requests with a chunk full after the step: those of ``new_reqs`` in their
        order, then the cached ones in step order. ``reqs``: the connector's requests."""
        self._step = v = self._step + 1
        sched = step.num_scheduled_tokens
        num_scheduled, check = sched.get, self._check
        due: Due = []
        new_reqs, cached, partial = step.new_reqs, step.cached_reqs, self._partial
        if self._fresh:
            self._place_fresh(cached, reqs)
        new_tokens = 0
        new_ids: set[str] = set()
        for new in new_reqs:
            req_id = new.req_id
            new_ids.add(req_id)
            n = num_scheduled(req_id, 0)
            new_tokens += n
            if (state := reqs.get(req_id)) is not None:
                state.new_block_table(new.block_ids)
                self._order += 1
                state.order = self._order
                self._fresh[req_id] = state
                check(state, new.num_computed_tokens + n, n, due)
        num_new = len(due)
        # what the partial requests scheduled as cached took beyond one token each
        beyond = 0
        for state in list(partial) if partial else ():
            req_id = state.request.request_id
            if reqs.get(req_id) is not state:
                del partial[state]
            elif req_id not in new_ids and (n := num_scheduled(req_id, 0)):
                beyond += n - 1
        if (
            len(sched) == len(new_reqs) + len(cached)
            and sum(sched.values()) - new_tokens - len(cached) == beyond
            and not self._scan_every_step
        ):
            for c in [c for c in cached if c.new_block_ids]:
                if (state := reqs.get(c.req_id)) is not None:
                    state.append_blocks(c.new_block_ids)
            exact = True
        else:
            self.scans += 1
            exact = False
            for c in cached:
                if (state := reqs.get(c.req_id)) is None:
                    continue
                if c.new_block_ids:
                    state.append_blocks(c.new_block_ids)
                n = num_scheduled(c.req_id, 0)
                check(state, c.num_computed_tokens + n, n, due)
        # the requests filed under this step (the entries still current), the partial ones
        # and the moved ones that are not checked yet: all of them on the calendar path
        moved: list[RequestState] = []
        if self.moved:  # the requests hold this list: emptied, not replaced
            moved = self.moved[:]
            self.moved.clear()
        filed = [s for s in self._steps.pop(v, ()) if s.wake == v]
        for candidates in (filed, list(partial) if partial else (), moved):
            for state in candidates:
                if state.checked == v:
                    continue
                req = state.request
                if reqs.get(req.request_id) is not state:
                    continue
                n = num_scheduled(req.request_id, 0)
                check(state, req.num_computed_tokens + n, n, due)
        if exact and len(due) - num_new > 1:
            due[num_new:] = sorted(due[num_new:], key=_order)
        return due

    def _place_fresh(
        self, cached: Sequence[CachedReqLike], reqs: Mapping[str, RequestState]
    ) -> None:
        """Put the requests given a block table in an earlier step in the order they come in
        this step's ``cached_reqs``: a scheduler lists a step's new requests before its
        resumed ones in ``new_reqs`` but runs them in admission order (both schedulers append
        admitted requests to the running list). The ones seen swap their numbers among
        themselves, so they stay after every request admitted before them. Only in a step that
        follows admissions; a request not scheduled yet keeps its number and waits."""
        fresh, seen = self._fresh, []
        for c in cached:
            if (state := fresh.pop(c.req_id, None)) is not None:
                if reqs.get(c.req_id) is state:
                    seen.append(state)
                if not fresh:
                    break
        for state, order in zip(seen, sorted(s.order for s in seen), strict=True):
            state.order = order
        for req_id in [r for r, st in fresh.items() if reqs.get(r) is not st]:
            del fresh[req_id]

    def recheck(self, states: Iterable[RequestState]) -> None:
        """Check ``states`` again at the next step: due requests whose stores did not go out
        in this step's batch (skipped, beyond the batch limit, or not sent)."""
        wake = self._step + 1
        for state in states:
            self._file(state, wake)

    def planned(self, state: RequestState, end: int, done: int) -> None:
        """``state``'s chunks below ``end`` went out in this step's batch, with ``done`` tokens
        computed after the step: file it under the step its chunk ``end`` fills, where its
        check after the granted reservation (cursor ``end``, ``RequestState.store_reserved``,
        which does not put it on the watch list) would file it; the step after this one if
        that chunk is full already. A refusal puts it on the watch list, a failed send files
        it for the next step (:meth:`recheck`), either of which comes first."""
        v = self._step
        wake = v + (end + 1) * self._ct - done
        self._file(state, wake if wake > v else v + 1)

    def _check(self, state: RequestState, done: int, n: int, due: Due) -> None:
        """``state`` is given ``n`` tokens this step and has ``done`` tokens computed after it:
        note it in ``due`` when a chunk is full and it is scheduled (the planner files it again
        if its stores do not go out; if they do, its cursor moves when the batch is answered,
        which puts it on :attr:`moved`), else file it under the first step it can be due at."""
        v = self._step
        state.checked = v
        if n > 1:
            self._partial[state] = None
        elif n and self._partial:
            self._partial.pop(state, None)
        end = (state.cursor + 1) * self._ct  # the end of the chunk at its cursor, in tokens
        if done < end:
            self._file(state, v + end - done)
        elif not state.finished:
            if n:
                due.append((state, done))
            else:
                self._file(state, v + 1)  # due once it is scheduled again

    def _file(self, state: RequestState, wake: int) -> None:
        if state.wake != wake:
            state.wake = wake
            if (filed := self._steps.get(wake)) is None:
                self._steps[wake] = [state]
            else:
                filed.append(state)


def _order(item: tuple[RequestState, int]) -> int:
    return item[0].order
