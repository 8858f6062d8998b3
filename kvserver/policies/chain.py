"""Chain-return eviction: conversations ranked by the learnt odds that they come back, shared
prefixes by how often they are read, each chain's tail before its head.

Runs inside the storage engine like every policy (single owner, no locks, no I/O); see
:mod:`kvserver.policies.base` for the call contract. It reads whole requests through
:meth:`EvictionPolicy.lookup` (``reads_requests = True``: the engine passes a planning lookup's
keys, misses included), which is what lets it follow a conversation from turn to turn.

Why. A conversation's next turn re-reads its whole context, so a private chain is worth its
space only if the conversation comes back, and a chain that was read (or stored) long ago is
more likely to have ended. Which chains end is learnt, not assumed:

- **chains.** A request extends a *chain*: the last key of the previous request of the same
  conversation (the chain's *tail*) is among its keys. A lookup finds the deepest known tail
  in its keys (tails are remembered after their keys leave, so an evicted conversation that
  returns is still recognised); the chain's turn count goes up by one and the request's last
  key becomes its tail. No known tail: a new chain (a conversation's first turn, a document).
  The keys a lookup missed are the chain's when they are stored (``insert_batch``); a batch
  no lookup announced is a chain of its own. A lookup that adds nothing to its chain (its
  last key is the tail) is no new turn: while that key is still pending (looked up, not
  stored: the scheduler retrying a request's planning lookup) nothing is counted; once it
  was stored, it is a re-read: the chain returned, and stays in its state;
- **plain clients.** A client that never looks up (put/get, gRPC) shows only stores and
  loads. A load (``touch``) of a chain no lookup followed is that chain's return, counted as
  a re-read; a chain a lookup follows has its returns counted by ``lookup`` only (the load
  after a planning lookup is the same request). Without this such clients' puts learnt
  only evictions (p near 0) and admission declined half of them;
- **state and odds.** A chain's *state* is (turns so far, capped at ``MAX_TURNS``; log2 of the
  chunks its last request added). Each stay in a state has one outcome, weighted by the
  chunks that request added: the chain returned, or its tail was evicted first (not returned;
  a later return still adds a return). ``p(state)`` = returns / outcomes, shrunk towards the
  rate over all states with ``PRIOR_WEIGHT`` chunks (no outcome, no change: before any, every
  state is at even odds and the policy is LRU). A one-off document (hundreds of chunks on
  its first turn) learns p ≈ 0 after one; a chat's early turns p ≈ 1, its last turns less;
- **when.** A chain of state s is live with prior odds ``p / (1 - p)``; after ``g`` ticks
  without a return its odds are ``p / (1 - p) * S(g)``, ``S(g)`` the chance that a live
  chain's next request comes more than ``g`` ticks after its last, learnt from the gaps seen
  (:mod:`kvserver.policies.return_gaps`: a histogram, not an exponential, since users answer
  after heavy-tailed think times). Chains are ranked by ``clip(logit p) + log S(g)``
  evaluated when ``evict`` runs (issue 15 round 7; before it ``S(g) = exp(-r g)``, a fixed
  deadline ``t_last + logit(p) / r``); ``r`` is the learnt rate of returns (1 / the mean gap,
  in policy ticks, between two requests of one chain);
- **shared prefixes.** A key read by two different chains (a system prompt, a document several
  questions start from), or stored again by another chain than the one that stored it before
  it was evicted (every evicted key is a *ghost* for a while: its uses, when it was first
  stored, its chain), is *shared*; it is valued by its read rate ``lam`` (reads per tick
  since it was first stored): its log-odds are ``HI + ln(lam / r) - r g``, those of a
  memoryless chain sure to return whose reads are ``lam / r`` times as frequent (so a rare
  prompt can rank below a fresh conversation);
- **how shared keys age, adapted online** (as ARC adapts its split). A chain's odds fall with
  the time since its last read; a shared key read at a steady rate does not become less
  likely to be read again. Its age counts ``kappa`` times: its log-odds are
  ``HI + ln(lam / r) - kappa r g``, with ``kappa`` in [0, 1]
  (1: it ages as a chain, 0: ranked by its read rate alone). ``kappa`` starts at 1 and moves
  with the misses on recently evicted keys (ghosts) that a lookup shows: each missed chunk
  that was the same conversation's adds ``KAPPA_STEP`` (conversations lacked room), each
  that was shared or another conversation's takes ``KAPPA_STEP`` off (shared prefixes left
  too early). In a small cache, where conversations' chunks are what misses, shared keys age
  as chains; in a large one, where what misses is a rarely read prompt that outlived the
  conversations around it, they are kept by their read rate;
- **tail before head.** The keys of one request are queued deepest first, so of two keys read
  together the deeper leaves first and what stays is a usable prefix;
- **admission** (``admits``). A store that must evict shows ``evict`` its new keys
  (``incoming``). Each would be queued at the next tick in its chain's state (the chain that
  looked it up; a batch no lookup announced is a new chain's first turn; a returning ghost
  of a shared key in its read-rate class): if every one of them would rank below the first
  victim (lower log-odds, age 0) by ``MARGIN`` or more, and each such state has
  ``MIN_OUTCOMES`` outcomes of its own (a state learnt from one eviction is no evidence),
  storing them would swap kept keys for keys that leave first, so ``evict`` declines
  (``None``, nothing changed, ``declined`` set) and the engine reports the new keys as not
  admitted (``filtered``, as reuse gating does: not stored, and not a full cache).
  A document (hundreds of new chunks on a first turn) is declined once documents have been
  seen to leave unread (``p`` of its state near 0), unless what it displaces ranks lower
  still (an older document's leftovers). Without ``incoming`` (the SSD tier; promotions and
  peer fetches' placements, ``prepare_store(gated=False)``) ``evict`` never declines. Why:
  every store must otherwise be made room for, and a 2,000-chunk document in a cache of
  3,500 flushes most of the conversations it holds (docs/benchmarks.md: it is most of what
  ``chain`` gains on chat at 5 %).

Order. Keys are kept in one LRU list per class (a chain state, or a shared read-rate bucket):
within a class the log-odds are the same offset plus a function of the age that never rises
(``log S(g)``, or ``-kappa r g`` for a shared class, ``kappa`` >= 0), so the list is in
rank order. ``evict`` merges the classes' evictable heads by their log-odds now (offsets
from the current estimates) and takes the lowest first; ties go to the key queued first.

Costs: ``lookup`` O(len(keys)) dict operations (one more probe per missed key: its ghost; a return
adds its gap to the histogram, whose 64-entry table the next ``evict`` rebuilds);
``insert_batch`` and ``touch`` O(1) per key;
``evict`` O(c + v log c) for c non-empty classes and v keys passed over (victims and pinned
ones), plus O(len(incoming)) dict probes to admit (it stops at the first key that ranks).
``bench_policies`` measures the cost per chunk operation against LRU.

Invariants: ``_time``, ``_class`` and ``_owner`` hold exactly the tracked keys, each key in the
list of its class; ghosts and tracked keys are disjoint; ``_tails`` (two per tracked key +
1,024), ``_pending`` (four + 1,024) and ``_ghosts`` (one) are bounded, oldest dropped first.
``evict`` changes nothing before it has chosen every victim and decided to admit, so a
``None`` leaves the same state; ``kappa`` stays in [0, 1] and only ``lookup`` changes it.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvserver.policies.base import EvictionPolicy
from kvserver.policies.return_gaps import ReturnGaps

#: turn counts above this share one state
MAX_TURNS = 16
#: clip of logit(p), a just-read chain's log-odds: at most HI (sure to return; also the
#: log-odds of a shared key read once per mean gap) ...
HI = 6.0
#: ... and at least -LO (sure not to)
LO = 14.0
#: prior of the return chance over all states; weight, in chunks, of a prior (that one in the
#: overall rate, the overall rate in a state's)
PRIOR_P = 0.5
PRIOR_WEIGHT = 64.0
#: a state's counts are halved when its outcomes reach this many chunks (recent ones win)
HALF_LIFE = 1 << 16
#: read-rate buckets of shared keys: bucket b holds rates in [2**(b-1), 2**b) / RATE_SCALE
RATE_SCALE = 1 << 16
#: change of ``kappa`` (how much a shared key's age counts) per missed chunk that was a ghost
KAPPA_STEP = 0.003
#: admission's evidence: a store is declined only if the state its new keys would enter has
#: at least this many outcomes of its own ...
MIN_OUTCOMES = 2
#: ... and they rank below the first victim by at least this much (log-odds)
MARGIN = 0.25

_State = tuple[int, int]  # (turns, log2 chunks added); turns 0 = a shared-key rate bucket


@dataclass(slots=True)
class _Chain:
    """One conversation as the policy follows it."""

    turns: int
    state: _State
    time: int  # tick of its last request
    weight: int  # chunks its last request added (its weight in the return counts)
    open: bool = True  # its state's outcome not counted yet (neither returned nor evicted)
    planned: bool = False  # followed through lookups (its returns are counted by lookup only)


class ChainPolicy(EvictionPolicy):
    """Per-conversation odds of return, learnt online (see the module docstring)."""

    name = "chain"
    reads_requests = True
    admits = True

    def __init__(self) -> None:
        self._now = 0  # ticks: one per lookup, touch or store batch
        self._seq = 0  # queue order (ties)
        self._time: dict[Hashable, int] = {}  # tracked key -> tick of its last use
        self._class: dict[Hashable, _State] = {}
        self._lists: dict[_State, OrderedDict[Hashable, int]] = {}  # class -> key -> seq
        self._owner: dict[Hashable, _Chain] = {}
        self._uses: dict[Hashable, int] = {}
        self._born: dict[Hashable, int] = {}
        self._shared: set[Hashable] = set()
        #: evicted shared key -> (uses, tick it was first stored)
        self._ghosts: OrderedDict[Hashable, tuple[int, int, _Chain | None]] = OrderedDict()
        self._tails: OrderedDict[Hashable, _Chain] = OrderedDict()
        self._pending: OrderedDict[Hashable, _Chain] = OrderedDict()  # looked up, not stored
        self._counted: dict[_State, float] = {}
        self._outcomes: dict[_State, float] = {}  # outcomes counted per state (halved alike)
        self._returned: dict[_State, float] = {}
        self._all_counted = 0.0  # the same summed over the states (the prior of each)
        self._all_returned = 0.0
        self._gaps = ReturnGaps()  # between two requests of one chain: mean, survival
        self._kappa = 1.0  # how much a shared key's age counts (1: as a chain's)

    # ------------------------------------------------------------------ observability

    def return_chance(self, state: _State) -> float:
        """The learnt chance that a chain in ``state`` (turns, log2 chunks added) returns."""
        prior = (self._all_returned + PRIOR_WEIGHT * PRIOR_P) / (self._all_counted + PRIOR_WEIGHT)
        p = (self._returned.get(state, 0.0) + PRIOR_WEIGHT * prior) / (
            self._counted.get(state, 0.0) + PRIOR_WEIGHT
        )
        return min(max(p, 1e-6), 1.0 - 1e-6)

    @property
    def mean_gap(self) -> float:
        """The learnt mean gap, in ticks, between two requests of one chain."""
        return self._gaps.mean

    def log_survival(self, age: int) -> float:
        """The learnt log chance that a live chain's next request comes more than ``age``
        ticks after its last (0 at age 0, never rising with the age)."""
        return self._gaps.log_survival(age)

    @property
    def shared_aging(self) -> float:
        """``kappa``: how much a shared key's age counts against it (1: as much as a chain's,
        0: not at all), adapted online from the misses on ghosts."""
        return self._kappa

    def is_shared(self, key: Hashable) -> bool:
        """Whether ``key`` was read by two different chains."""
        return key in self._shared

    def turns(self, key: Hashable) -> int | None:
        """The turn count of the chain that holds ``key`` (None: shared or not tracked)."""
        owner = self._owner.get(key)
        return None if owner is None or key in self._shared else owner.turns

    # ------------------------------------------------------------------ contract

    def lookup(self, keys: Sequence[Hashable], hits: int) -> None:
        """A request read ``keys`` (head first), the first ``hits`` resident: it continues the
        chain whose tail is the deepest of its keys (or starts one); its hits are used."""
        self._now += 1
        now, tails = self._now, self._tails
        chain = None
        j = len(keys) - 1
        while j >= 0:
            chain = tails.pop(keys[j], None)
            if chain is not None:
                break
            j -= 1
        if chain is not None and j == len(keys) - 1:  # nothing added: the same request again
            tails[keys[j]] = chain
            if keys[j] not in self._pending:  # stored since: a re-read, the chain returned
                self._reread(chain, now)
            chain.planned = True  # else a planning lookup retried: no outcome
            self._use(keys[:hits], chain)
            return
        if chain is not None:
            self._count(chain, returned=True)
            self._gaps.add(now - chain.time)
            chain.turns += 1
            added = len(keys) - j - 1
        else:
            chain = _Chain(1, (1, 0), now, 0)
            added = len(keys) - hits
        chain.planned = True
        self._enter(chain, added, now)
        if keys:
            tails[keys[-1]] = chain
            self._bound(tails)
        pending, time, ghosts = self._pending, self._time, self._ghosts
        step = 0  # missed chunks that were this chain's ghosts, less those that were others'
        for key in keys[hits:]:
            if key not in time:
                pending[key] = chain
                pending.move_to_end(key)
                ghost = ghosts.get(key)
                if ghost is not None:
                    step += 1 if ghost[2] is chain else -1
        if step:
            self._kappa = min(max(self._kappa + KAPPA_STEP * step, 0.0), 1.0)
        self._bound(pending, 4)
        self._use(keys[:hits], chain)

    def insert(self, key: Hashable) -> None:
        """Track ``key`` as a batch of one."""
        self.insert_batch((key,))

    def insert_batch(self, keys: Sequence[Hashable]) -> None:
        """Track the keys of one store batch (head first): each joins the chain that looked
        it up, else the batch is a new chain; deepest queued first. Tracked keys are used."""
        self._now += 1
        now, pending, time = self._now, self._pending, self._time
        own: _Chain | None = None
        for position in range(len(keys) - 1, -1, -1):
            key = keys[position]
            if key in time:
                self._use((key,), None)
                continue
            chain = pending.pop(key, None)
            if chain is None:
                if own is None:
                    own = _Chain(1, (1, 0), now, 0)
                    self._enter(own, len(keys), now)
                    self._tails[keys[-1]] = own
                    self._bound(self._tails)
                chain = own
            ghost = self._ghosts.pop(key, None)
            self._owner[key] = chain
            self._born[key] = now if ghost is None else ghost[1]
            self._uses[key] = 0 if ghost is None else ghost[0]
            if ghost is not None and ghost[2] is not chain:  # shared, or another chain's
                self._shared.add(key)
                self._queue(key, self._rate_class(key), now)
            else:
                self._queue(key, chain.state, now)

    def remove(self, key: Hashable) -> None:
        if key in self._time:
            self._drop(key)

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Use the tracked ``keys`` in their classes (first key ends most recent). A load of a
        chain no lookup followed (a plain client's get of what it put) is that chain's return:
        its state's outcome (returned) is counted and the chain stays in its state, open
        again; a chain :meth:`lookup` follows has its returns counted there (the load after a
        planning lookup is the same request, no second return)."""
        self._now += 1
        now, owner, shared = self._now, self._owner, self._shared
        used = [key for key in keys if key in self._time]
        for key in used:
            chain = owner[key]  # counted once per load: _reread sets its time to now
            if not chain.planned and chain.time != now and key not in shared:
                self._reread(chain, now)
        self._use(used, None)

    def evict(
        self,
        need: int,
        cost: Callable[[Hashable], int],
        evictable: Callable[[Hashable], bool],
        incoming: Sequence[Hashable] = (),
    ) -> list[Hashable] | None:
        self.declined = False
        if need <= 0:
            return []
        heads: list[tuple[float, int, _State]] = []  # (log-odds now, seq, class)
        head: dict[_State, Hashable] = {}  # each class's next candidate
        cursors: dict[_State, Iterator[tuple[Hashable, int]]] = {}
        offsets: dict[_State, float] = {}
        for state, members in self._lists.items():
            if members:
                offsets[state] = self._offset(state)
                cursors[state] = iter(members.items())
                self._advance(heads, head, state, cursors[state], offsets[state], evictable)
        victims: list[Hashable] = []
        lowest = heads[0][0] if heads else 0.0
        freed = 0
        while freed < need:
            if not heads:
                return None
            _, _, state = heapq.heappop(heads)
            key = head[state]
            victims.append(key)
            freed += cost(key)
            self._advance(heads, head, state, cursors[state], offsets[state], evictable)
        if incoming and self._declines(incoming, lowest):
            self.declined = True
            return None
        ghosts, tails = self._ghosts, self._tails
        for key in victims:
            chain = tails.get(key)
            if chain is not None and chain.open:
                self._count(chain, returned=False)
            shared = key in self._shared
            ghosts[key] = (self._uses[key], self._born[key], None if shared else self._owner[key])
            self._drop(key)
        while len(ghosts) > len(self._time):
            ghosts.popitem(last=False)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._time

    def __len__(self) -> int:
        return len(self._time)

    def __iter__(self) -> Iterator[Hashable]:
        """Tracked keys in eviction order (first = next victim, ignoring pins)."""
        offsets = {state: self._offset(state) for state in self._lists}
        order = sorted(
            (self._rank(key, state, offsets[state]), seq, key)
            for state, members in self._lists.items()
            for key, seq in members.items()
        )
        return iter([key for _, _, key in order])

    # ------------------------------------------------------------------ internals

    def _declines(self, incoming: Sequence[Hashable], lowest: float) -> bool:
        """Whether every new key of ``incoming`` would rank below ``lowest``, the log-odds of
        the first victim (the least valuable key that may leave), at age 0, by ``MARGIN`` or
        more, each in a state with evidence of its own (``MIN_OUTCOMES`` outcomes; a shared
        key's by its read rate): storing them would then
        swap kept keys for keys worth less (admission control). A state learnt from a few
        outcomes, or a few log-odds apart, is no evidence: the store is admitted."""
        lowest -= MARGIN
        now = self._now + 1  # the tick insert_batch will queue them at
        time, pending, ghosts = self._time, self._pending, self._ghosts
        fresh: float | None = None  # a batch no lookup announced: a new chain's first turn
        new = False
        last: _Chain | None = None  # a batch is mostly one chain's: its rank, once
        last_rank = 0.0
        for key in incoming:
            if key in time:
                continue
            new = True
            chain = pending.get(key)
            ghost = ghosts.get(key)
            if ghost is not None and ghost[2] is not chain:  # comes back shared
                lam = (ghost[0] + 1) / (now - ghost[1] + 1)
                rank = self._offset((0, int(lam * RATE_SCALE).bit_length()))
            elif chain is not None:
                if chain is not last:
                    last, last_rank = chain, self._proven(chain.state)
                rank = last_rank
            else:
                if fresh is None:
                    fresh = self._proven((1, len(incoming).bit_length()))
                rank = fresh
            if rank >= lowest:
                return False
        return new

    def _proven(self, state: _State) -> float:
        """The log-odds of a key of chain state ``state`` just read, or ``HI`` (ranks above
        every victim) while the state has too few outcomes of its own to decline on."""
        if self._outcomes.get(state, 0.0) < MIN_OUTCOMES:
            return HI
        return self._offset(state)

    def _advance(
        self,
        heads: list[tuple[float, int, _State]],
        head: dict[_State, Hashable],
        state: _State,
        cursor: Iterator[tuple[Hashable, int]],
        offset: float,
        evictable: Callable[[Hashable], bool],
    ) -> None:
        """Queue the class's next evictable key (none left: the class drops out)."""
        for key, seq in cursor:
            if evictable(key):
                head[state] = key
                heapq.heappush(heads, (self._rank(key, state, offset), seq, state))
                return

    def _rank(self, key: Hashable, state: _State, offset: float) -> float:
        """The log-odds now of ``key`` (of class ``state``, whose log-odds at age 0 are
        ``offset``); within a class it never falls as the key's last use grows."""
        age = self._now - self._time[key]
        if state[0] == 0:  # shared: its age counts kappa times, memoryless
            return offset - self._kappa * age / self._gaps.mean
        if age <= 0:
            return offset
        # self._gaps.log_survival(age), inlined (one call per key evict passes over)
        table, b = self._gaps.table, age.bit_length()  # 2**(b-1) <= age < 2**b
        low = 1 << (b - 1)
        below = table[b - 1]
        return offset + below + (age - low) / low * (table[b] - below)

    def _offset(self, state: _State) -> float:
        """The log-odds of a key of ``state`` just read."""
        if state[0] == 0:  # shared, read-rate bucket
            lam = (1 << state[1]) / (2 * RATE_SCALE)
            return HI + math.log(lam * self._gaps.mean)
        p = self.return_chance(state)
        return min(max(math.log(p / (1.0 - p)), -LO), HI)

    def _rate_class(self, key: Hashable) -> _State:
        lam = (self._uses[key] + 1) / (self._now - self._born[key] + 1)
        return (0, int(lam * RATE_SCALE).bit_length())

    def _enter(self, chain: _Chain, added: int, now: int) -> None:
        """``chain`` made a request adding ``added`` chunks at tick ``now``."""
        chain.state = (min(chain.turns, MAX_TURNS), added.bit_length())
        chain.time = now
        chain.weight = max(added, 1)
        chain.open = True

    def _count(self, chain: _Chain, returned: bool) -> None:
        """One outcome of ``chain``'s state, once per state: it returned, or its tail was
        evicted first (counted as not returned; a later return still counts as one)."""
        state, weight = chain.state, chain.weight
        if returned:
            self._returned[state] = self._returned.get(state, 0.0) + weight
            self._all_returned += weight
        if not chain.open:
            return
        chain.open = False
        counted = self._counted.get(state, 0.0) + weight
        outcomes = self._outcomes.get(state, 0.0) + 1.0
        if counted >= HALF_LIFE:
            counted /= 2
            outcomes /= 2
            self._returned[state] = self._returned.get(state, 0.0) / 2
        self._counted[state] = counted
        self._outcomes[state] = outcomes
        self._all_counted += weight
        if self._all_counted >= HALF_LIFE:
            self._all_counted /= 2
            self._all_returned /= 2

    def _reread(self, chain: _Chain, now: int) -> None:
        """``chain``'s keys were read again with nothing added (a re-read, or a plain client's
        load): it returned, and stays in its state, open again, last read at ``now``."""
        self._count(chain, returned=True)
        self._gaps.add(now - chain.time)
        chain.time = now
        chain.open = True

    def _use(self, keys: Sequence[Hashable], chain: _Chain | None) -> None:
        """The tracked ``keys`` were read (head first) by ``chain`` (None: by whoever holds
        them): queued again deepest first; a key another chain holds becomes shared."""
        owner, shared, uses, now = self._owner, self._shared, self._uses, self._now
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            uses[key] += 1
            if chain is not None and owner[key] is not chain and key not in shared:
                shared.add(key)
            if key in shared:
                self._queue(key, self._rate_class(key), now)
            else:
                if chain is not None:
                    owner[key] = chain
                self._queue(key, owner[key].state, now)

    def _queue(self, key: Hashable, state: _State, now: int) -> None:
        """(Re)queue ``key`` at the end of ``state``'s list, used at ``now``."""
        old = self._class.get(key)
        if old is not None:
            del self._lists[old][key]
            if not self._lists[old]:
                del self._lists[old]
        self._seq += 1
        self._lists.setdefault(state, OrderedDict())[key] = self._seq
        self._class[key] = state
        self._time[key] = now

    def _drop(self, key: Hashable) -> None:
        state = self._class.pop(key)
        del self._lists[state][key]
        if not self._lists[state]:
            del self._lists[state]
        del self._time[key], self._owner[key], self._uses[key], self._born[key]
        self._shared.discard(key)

    def _bound(self, table: OrderedDict[Hashable, _Chain], factor: int = 2) -> None:
        """Keep ``table`` (oldest first) within ``factor`` entries per tracked key (+1024)."""
        limit = factor * len(self._time) + 1024
        while len(table) > limit:
            table.popitem(last=False)
