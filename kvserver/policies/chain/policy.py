"""``ChainPolicy``: follows each conversation from turn to turn and ranks its chunks by the learnt
odds that it comes back; shared prefixes by how often they are read.

Runs inside the storage engine like every policy (single owner, no locks, no I/O); see
:mod:`kvserver.policies.base` for the call contract and :mod:`kvserver.policies.chain` for the
idea. This module owns which chain holds which key, the chains' tails, the keys looked up and
not yet stored, the ghosts and the readers' mass of shared keys; the learnt odds per state
(:mod:`~kvserver.policies.chain.states`), the gaps' survival
(:mod:`~kvserver.policies.chain.return_gaps`), the ranked lists
(:mod:`~kvserver.policies.chain.queues`) and the ranking that merges them, ``kappa`` and
``bias`` (:mod:`~kvserver.policies.chain.ranking`) are objects it holds; admission
(:mod:`~kvserver.policies.chain.admission`) reads them. What a read does to the keys it reads
(queued again; the readers' mass moved, a key read by a second chain made shared) is
:mod:`~kvserver.policies.chain.reads`'s, over the records this module holds.

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
- **when.** A chain of state s is live with prior odds ``p / (1 - p)``; after ``g`` ticks
  without a return its odds are ``p / (1 - p) * S(g)``, ``S(g)`` the chance that a live
  chain's next request comes more than ``g`` ticks after its last, learnt from the gaps seen.
  Chains are ranked by ``clip(logit p) + log S(g)`` evaluated when ``evict`` runs; ``r`` is
  the learnt rate of returns (1 / the mean gap, in policy ticks, between two requests of one
  chain);
- **shared prefixes.** A key read by two different chains (a system prompt, a document several
  questions start from), or stored again by another chain than the one that stored it before
  it was evicted (every evicted key is a *ghost* for a while: its uses, when it was first
  stored, its chain), is *shared*; it is valued by its read rate ``lam`` (reads per tick
  since it was first stored) and by its *readers*: its odds are ``e**bias * lam / r *
  e**(-kappa r g) + M S(g)``, ``M`` the summed odds (as of its last use) that the chains
  which read it come back. A key read by a live conversation is worth at least what that
  conversation's own keys are (prefix semantics: they are no use without it), and a rare
  prompt's worth is mostly its live readers' (a conversation on it that returns reads it
  again). A chain that reads a key again replaces its share of ``M``, it does not add a
  second one;
- **how much a read rate counts against the readers, adapted online** (``bias`` in [0, HI]).
  ``bias`` = HI ranks a shared key as a chain sure to return whose reads are ``lam / r``
  times as frequent (a prompt above any conversation read as recently: the ranking before
  session 10); 0 weighs its expected reads per mean gap as a chain's odds of returning in
  one. It starts at HI and moves with the same misses as ``kappa``: in a small cache, where
  conversations' chunks are what misses, towards 0 (their keys win room from rarely read
  prompts, which keep what their live readers give them); where prompts are what misses,
  back towards HI;
- **how shared keys age, adapted online** (as ARC adapts its split). A chain's odds fall with
  the time since its last read; a shared key read at a steady rate does not become less
  likely to be read again. ``kappa`` in [0, 1] (1: it ages as a chain, 0: ranked by its read
  rate alone) starts at 1 and moves with the misses on ghosts that a lookup shows: each
  missed chunk that was the same conversation's adds ``KAPPA_STEP`` (conversations lacked
  room), each that was shared or another conversation's takes ``KAPPA_STEP`` off (shared
  prefixes left too early). In a small cache, where conversations' chunks are what misses,
  shared keys age as chains; in a large one, where what misses is a rarely read prompt that
  outlived the conversations around it, they are kept by their read rate;
- **tail before head.** The keys of one request are queued deepest first, so of two keys read
  together the deeper leaves first and what stays is a usable prefix.

Costs: ``lookup`` O(len(keys)) dict operations (one more probe per missed key: its ghost; a
return adds its gap to the histogram, whose table is rebuilt now and then); ``insert_batch``
and ``touch`` O(1) per key (a shared key's mass: one ``exp`` per distinct age a call sees);
``evict`` as :meth:`Ranking.choose`, plus O(len(incoming))
dict probes to admit (it stops at the first key that ranks). ``bench_policies`` measures the
cost per chunk operation against LRU.

Invariants: ``_queues`` and ``_held`` (a key's chain, uses, first store; chain None: shared)
hold exactly the tracked keys; ghosts and tracked keys are disjoint; ``_tails`` (two per
tracked key + 1,024), ``_pending`` (four + 1,024) and ``_ghosts`` (one) are bounded, oldest
dropped first. ``evict`` changes nothing before it has chosen every victim and decided to
admit, so a ``None`` leaves the same state; ``kappa`` stays in [0, 1], ``bias`` in [0, HI],
and only ``lookup`` changes them; a shared key's readers' mass is at least the odds the
chain that read it last had then (classes round it up).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from kvserver.policies.base import EvictionPolicy
from kvserver.policies.chain.admission import declines
from kvserver.policies.chain.queues import ClassQueues
from kvserver.policies.chain.ranking import Ranking
from kvserver.policies.chain.reads import Reads
from kvserver.policies.chain.return_gaps import ReturnGaps
from kvserver.policies.chain.states import (
    HI,
    Chain,
    Ghost,
    Held,
    State,
    StateOdds,
    shared_class,
)

#: change of ``kappa`` (how much a shared key's age counts) and of ``bias`` (how much its read
#: rate counts against its readers' odds, log-odds) per missed chunk that was a ghost
KAPPA_STEP = 0.003


class ChainPolicy(EvictionPolicy):
    """Per-conversation odds of return, learnt online (see the module docstring)."""

    name = "chain"
    reads_requests = True
    admits = True

    def __init__(self) -> None:
        self._now = 0  # ticks: one per lookup, touch or store batch
        self._queues = ClassQueues()  # the tracked keys by class, in rank order
        self._held: dict[Hashable, Held] = {}  # the tracked keys: chain (None: shared), uses
        self._ghosts: OrderedDict[Hashable, Ghost] = OrderedDict()  # evicted keys
        self._tails: OrderedDict[Hashable, Chain] = OrderedDict()
        self._pending: OrderedDict[Hashable, Chain] = OrderedDict()  # looked up, not stored
        self._odds = StateOdds()  # outcomes per chain state: the return chances
        self._gaps = ReturnGaps()  # between two requests of one chain: mean, survival
        self._ranking = Ranking(self._odds, self._gaps)  # the log-odds now; kappa, bias
        self._reads = Reads(self._held, self._queues, self._odds, self._gaps)  # what reads do

    # ------------------------------------------------------------------ observability

    def return_chance(self, state: State) -> float:
        """The learnt chance that a chain in ``state`` (turns, log2 chunks added) returns."""
        return self._odds.return_chance(state)

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
        return self._ranking.kappa

    @property
    def shared_bias(self) -> float:
        """``bias``: the log-odds a shared key's read rate is lifted by against its readers'
        odds (HI: ranked as a chain sure to return; 0: as odds), adapted online."""
        return self._ranking.bias

    def readers(self, key: Hashable) -> float:
        """A shared key's readers' summed odds of returning, as of its last use (0: none, or
        not shared)."""
        held = self._held.get(key)
        return 0.0 if held is None or held.chain is not None else held.mass

    def is_shared(self, key: Hashable) -> bool:
        """Whether ``key`` was read by two different chains."""
        held = self._held.get(key)
        return held is not None and held.chain is None

    def turns(self, key: Hashable) -> int | None:
        """The turn count of the chain that holds ``key`` (None: shared or not tracked)."""
        held = self._held.get(key)
        return None if held is None or held.chain is None else held.chain.turns

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
            self._reads.use(keys[:hits], chain, now)
            return
        if chain is not None:
            self._count(chain, returned=True)
            self._gaps.add(now - chain.time)
            chain.turns += 1
            added = len(keys) - j - 1
        else:
            chain = Chain(1, (1, 0), now, 0)
            added = len(keys) - hits
        chain.planned = True
        chain.enter(added, now)
        if keys:
            tails[keys[-1]] = chain
            self._bound(tails)
        pending, time, ghosts = self._pending, self._queues.time, self._ghosts
        step = 0  # missed chunks that were this chain's ghosts, less those that were others'
        for key in keys[hits:]:
            if key not in time:
                pending[key] = chain
                pending.move_to_end(key)
                ghost = ghosts.get(key)
                if ghost is not None:
                    step += 1 if ghost[2] is chain else -1
        if step:
            ranking = self._ranking
            ranking.kappa = min(max(ranking.kappa + KAPPA_STEP * step, 0.0), 1.0)
            ranking.bias = min(max(ranking.bias - KAPPA_STEP * step, 0.0), HI)
        self._bound(pending, 4)
        self._reads.use(keys[:hits], chain, now)

    def insert(self, key: Hashable) -> None:
        """Track ``key`` as a batch of one."""
        self.insert_batch((key,))

    def insert_batch(self, keys: Sequence[Hashable]) -> None:
        """Track the keys of one store batch (head first): each joins the chain that looked
        it up, else the batch is a new chain; deepest queued first. Tracked keys are used."""
        self._now += 1
        now, pending, time, ghosts = self._now, self._pending, self._queues.time, self._ghosts
        held, use, lend = self._held, self._reads.use, self._reads.lend
        queued: list[tuple[Hashable, State]] = []  # queued in one call, in this order
        own: Chain | None = None
        for position in range(len(keys) - 1, -1, -1):
            key = keys[position]
            if key in time:
                self._queues.queue_many(queued, now)
                queued.clear()
                use((key,), None, now)
                continue
            chain = pending.pop(key, None)
            if chain is None:
                if own is None:
                    own = Chain(1, (1, 0), now, 0)
                    own.enter(len(keys), now)
                    self._tails[keys[-1]] = own
                    self._bound(self._tails)
                chain = own
            ghost = ghosts.pop(key, None)
            if ghost is None:
                held[key] = Held(chain, 0, now)
                queued.append((key, chain.state))
            elif ghost[2] is not chain:  # shared, or another chain's: its storer reads it
                mass = lend(chain, now)
                held[key] = Held(None, ghost[0], ghost[1], mass)
                queued.append((key, shared_class(ghost[0], ghost[1], now, mass)))
            else:
                held[key] = Held(chain, ghost[0], ghost[1])
                queued.append((key, chain.state))
        self._queues.queue_many(queued, now)

    def remove(self, key: Hashable) -> None:
        if key in self._queues:
            self._drop(key)

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Use the tracked ``keys`` in their classes (first key ends most recent). A load of a
        chain no lookup followed (a plain client's get of what it put) is that chain's return:
        its state's outcome (returned) is counted and the chain stays in its state, open
        again; a chain :meth:`lookup` follows has its returns counted there (the load after a
        planning lookup is the same request, no second return)."""
        self._now += 1
        now, get = self._now, self._held.get
        used: list[tuple[Hashable, Held]] = []
        settled: Chain | None = None  # the last chain seen that needs no reread this load
        for key in keys:
            held = get(key)
            if held is None:  # not tracked
                continue
            used.append((key, held))
            chain = held.chain
            if chain is None or chain is settled:  # shared; a chain checked this load
                continue
            if not chain.planned and chain.time != now:  # once per load: _reread sets it
                self._reread(chain, now)
            settled = chain  # a load's keys are mostly one chain's: checked once
        self._reads.requeue(used, now)

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
        chosen = self._ranking.choose(self._queues, need, cost, evictable, self._now)
        if chosen is None:
            return None
        victims, lowest = chosen
        if incoming and declines(
            incoming,
            lowest,
            self._now + 1,  # the tick insert_batch would queue them at
            self._queues.time,
            self._pending,
            self._ghosts,
            self._odds,
            self._ranking.entry,
        ):
            self.declined = True
            return None
        ghosts, tails, held = self._ghosts, self._tails, self._held
        for key in victims:
            chain = tails.get(key)
            if chain is not None and chain.open:
                self._count(chain, returned=False)
            gone = held.pop(key)
            ghosts[key] = (gone.uses, gone.born, gone.chain)
        self._queues.drop_many(victims)
        tracked = len(self._queues.time)
        while len(ghosts) > tracked:
            ghosts.popitem(last=False)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._queues.time

    def __len__(self) -> int:
        return len(self._queues)

    def __iter__(self) -> Iterator[Hashable]:
        """Tracked keys in eviction order (first = next victim, ignoring pins)."""
        return iter(self._ranking.ordered(self._queues, self._now))

    # ------------------------------------------------------------------ internals

    def _count(self, chain: Chain, returned: bool) -> None:
        """One outcome of ``chain``'s state, once per state: it returned, or its tail was
        evicted first (counted as not returned; a later return still counts as one)."""
        self._odds.count(chain.state, chain.weight, returned, chain.open)
        chain.open = False

    def _reread(self, chain: Chain, now: int) -> None:
        """``chain``'s keys were read again with nothing added (a re-read, or a plain client's
        load): it returned, and stays in its state, open again, last read at ``now``."""
        self._count(chain, returned=True)
        self._gaps.add(now - chain.time)
        chain.time = now
        chain.open = True

    def _drop(self, key: Hashable) -> None:
        self._queues.drop(key)
        del self._held[key]

    def _bound(self, table: OrderedDict[Hashable, Chain], factor: int = 2) -> None:
        """Keep ``table`` (oldest first) within ``factor`` entries per tracked key (+1024)."""
        limit = factor * len(self._queues) + 1024
        while len(table) > limit:
            table.popitem(last=False)
