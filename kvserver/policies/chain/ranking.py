"""How ``chain`` ranks its classes now, and the merge of the classes that chooses victims.

Runs inside the storage engine as part of :class:`~kvserver.policies.chain.ChainPolicy` (single
owner, no locks, no I/O). The policy holds one :class:`Ranking` over its learnt odds per state
and its return gaps, sets ``kappa`` and ``bias`` on it (only ``lookup`` changes them), and asks
it for the victims of an ``evict`` (:meth:`Ranking.choose`) over its
:class:`~kvserver.policies.chain.queues.ClassQueues`.

- **a chain's class** (turns >= 1): log-odds ``offset + log S(age)``, ``offset`` the state's
  clipped ``logit p`` (:meth:`~kvserver.policies.chain.states.StateOdds.log_odds`), ``S`` the
  learnt gap survival;
- **a shared class** (turns <= 0, :func:`~kvserver.policies.chain.states.shared_class`):
  ``log(e**rate + M S(age))``, ``rate = bias + log(lam * mean gap) - kappa * age / mean gap``
  (its read rate's odds, aged ``kappa`` times as a chain), ``M`` its readers' mass bucket (no
  second term in bucket 0).

The merge. Within a class the log-odds never rise with the age, so each class's LRU list is in
rank order and its head is its least valuable key; ``choose`` keeps the classes' evictable
heads on a heap by their log-odds at that moment and takes the lowest first (ties: the key
queued first). Session 10's readers' mass buckets tripled the classes it merges (system at 5 %:
about 22 per ``evict``, 13 of them shared, for about 18 victims), so the per-class work is
what it costs: a class's constants (offset, log mass) are computed once per call, the rank is
evaluated inline (no call per key; the same float operations in the same order as
:meth:`Ranking.rank`, so the same values to the bit), and a heap entry carries its class's
cursor and constants (no dict per class).

Costs: ``choose`` O(c + v log c) for c non-empty classes and v keys passed over (victims and
keys ``evictable`` refuses); ``offset`` one ``return_chance`` (a chain's) or one ``log``.

Pure: reads the queues, the odds and the gaps; changes nothing.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from kvserver.policies.chain.queues import ClassQueues
from kvserver.policies.chain.return_gaps import ReturnGaps
from kvserver.policies.chain.states import (
    HI,
    MASS_BUCKETS,
    RATE_SCALE,
    State,
    StateOdds,
    shared_mass,
    shared_rate,
)

#: a class's kind in :meth:`Ranking.choose`: a chain's, a shared one without readers, with
_CHAIN, _SHARED, _READ = "chain", "shared", "read"
#: log(shared_mass) per readers' mass bucket (a shared class's ``state[0]``), the same values
_LOG_MASS = {-m: math.log(shared_mass((-m, 0))) for m in range(1, 2 * MASS_BUCKETS + 1)}
#: a class as ``choose`` advances it: (its keys from the head, kind, offset, log readers' mass)
_Line = tuple[Iterator[tuple[Hashable, int]], str, float, float]


@dataclass(slots=True)
class Ranking:
    """The log-odds of the tracked keys now, from the learnt estimates (module docstring)."""

    odds: StateOdds  # outcomes per chain state: the return chances
    gaps: ReturnGaps  # between two requests of one chain: mean, survival
    kappa: float = 1.0  # how much a shared key's age counts (1: as a chain's)
    bias: float = HI  # how much its read rate counts against its readers' odds (HI: most)

    def offset(self, state: State) -> float:
        """The log-odds of a key of ``state`` just read (a shared class: its read rate's part;
        its readers' is added by :meth:`rank`)."""
        if state[0] <= 0:
            return self.bias + math.log(shared_rate(state) * self.gaps.mean)
        return self.odds.log_odds(state)

    def rank(self, age: int, state: State, offset: float) -> float:
        """The log-odds now of a key of class ``state`` (whose :meth:`offset` is ``offset``)
        last used ``age`` ticks ago; within a class it never rises with the age."""
        if state[0] <= 0:  # shared: its read rate's odds, age counting kappa times; its readers'
            rate = offset - self.kappa * age / self.gaps.mean
            if state[0] == 0:
                return rate
            readers = math.log(shared_mass(state)) + self.gaps.log_survival(age)
            if rate < readers:
                rate, readers = readers, rate
            return rate + math.log1p(math.exp(readers - rate))  # log(e**rate + e**readers)
        if age <= 0:
            return offset
        table, b = self.gaps.table, age.bit_length()  # log_survival(age), spelt out: ...
        low = 1 << (b - 1)
        below = table[b - 1]
        return offset + below + (age - low) / low * (table[b] - below)  # ... added in this order

    def entry(self, state: State) -> float:
        """The log-odds of a key of class ``state`` just used (age 0; admission's)."""
        return self.rank(0, state, self.offset(state))

    def choose(
        self,
        queues: ClassQueues,
        need: int,
        cost: Callable[[Hashable], int],
        evictable: Callable[[Hashable], bool],
        now: int,
    ) -> tuple[list[Hashable], float] | None:
        """The victims, lowest log-odds first (ties: queued first), whose costs sum to
        ``need`` or more among the ``evictable`` keys, and the log-odds of the first of them
        (0.0 when none could be considered); ``None`` when the evictable keys cannot cover
        ``need``. Changes nothing."""
        time, table = queues.time, self.gaps.table
        mean, kappa, bias = self.gaps.mean, self.kappa, self.bias
        log, log1p, exp = math.log, math.log1p, math.exp
        log_odds = self.odds.log_odds
        # (cursor, kind: CHAIN, SHARED or READ (shared, with readers), offset, log M) per class
        # still to advance: every class first, then the last victim's
        todo: list[_Line] = []
        for state, members in queues.lists.items():
            if state[0] > 0:
                todo.append((iter(members.items()), _CHAIN, log_odds(state), 0.0))
            else:  # offset(state), shared_rate spelt out
                offset = bias + log((1 << state[1]) / (2 * RATE_SCALE) * mean)
                if state[0] == 0:
                    todo.append((iter(members.items()), _SHARED, offset, 0.0))
                else:
                    todo.append((iter(members.items()), _READ, offset, _LOG_MASS[state[0]]))
        heads: list[tuple[float, int, Hashable, _Line]] = []
        push, replace = heapq.heappush, heapq.heapreplace
        victims: list[Hashable] = []
        freed = 0
        lowest: float | None = None
        while True:
            for line in todo:
                cursor, kind, offset, mass = line
                for key, seq in cursor:
                    if not evictable(key):
                        continue
                    age = now - time[key]
                    # Ranking.rank inlined, the same operations in the same order
                    if kind is _CHAIN:
                        if age <= 0:
                            value = offset
                        else:
                            b = age.bit_length()  # 2**(b-1) <= age < 2**b
                            low = 1 << (b - 1)
                            below = table[b - 1]
                            value = offset + below + (age - low) / low * (table[b] - below)
                    else:
                        value = offset - kappa * age / mean
                        if kind is _READ:
                            if age <= 0:
                                readers = mass + 0.0
                            else:
                                b = age.bit_length()
                                low = 1 << (b - 1)
                                below = table[b - 1]
                                readers = mass + (below + (age - low) / low * (table[b] - below))
                            if value < readers:
                                value, readers = readers, value
                            value = value + log1p(exp(readers - value))
                    if lowest is None:  # the first pass: every class's head
                        push(heads, (value, seq, key, line))
                    else:
                        replace(heads, (value, seq, key, line))
                    break
                else:  # the class has no evictable key left
                    if lowest is not None:
                        heapq.heappop(heads)
            if lowest is None:
                lowest = heads[0][0] if heads else 0.0
            if freed >= need:
                return victims, lowest
            if not heads:
                return None
            _, _, key, line = heads[0]
            victims.append(key)
            freed += cost(key)
            todo = [line]

    def ordered(self, queues: ClassQueues, now: int) -> list[Hashable]:
        """Every tracked key, lowest log-odds first (ties: queued first)."""
        offsets = {state: self.offset(state) for state in queues.lists}
        order = sorted(
            (self.rank(now - queues.time[key], state, offsets[state]), seq, key)
            for state, members in queues.lists.items()
            for key, seq in members.items()
        )
        return [key for _, _, key in order]
