"""The chains ``chain`` follows, their states, and the learnt odds that a chain returns.

Runs inside the storage engine as part of :class:`~kvserver.policies.chain.ChainPolicy` (single
owner, no locks, no I/O). The policy owns one :class:`StateOdds` and a :class:`Chain` per
conversation it follows; it calls :meth:`Chain.enter` when a chain makes a request,
:meth:`StateOdds.count` when a chain's stay in its state has an outcome, and
:meth:`StateOdds.log_odds` when it ranks a class.

- **chains.** A :class:`Chain` is one conversation as the policy sees it: its turn count, its
  *state*, the tick of its last request, and the chunks that request added (its weight in the
  counts). A first turn's state is (1, log2 of the chunks it added): its size is what tells a
  chat from a one-off document. A later turn's state is (turns so far, capped at
  ``MAX_TURNS``; 0): its size is left out (issue 15, session 11: split five ways by size, a
  turn's outcomes left each state a fifth of the evidence, and the states' estimates scattered
  around the turn's rate, ±0.05 at p 0.88 or ±0.45 log-odds, what a hundred ticks of age
  weigh, most of the replay: with the turn's rate alone ``chain`` closes 48 -> 51 % of the
  ARC→Belady gap on chat at 5 %; the estimates of a whole replay given from its start, 53 %).
  A state with turns 0 or
  less is not a chain's but a shared key's class (:func:`shared_class`);
- **outcomes.** Each stay in a state has one outcome, weighted by the chunks that request
  added: the chain returned, or its tail was evicted first (not returned; a later return still
  adds a return). ``p(state)`` = returns / outcomes, shrunk with ``PRIOR_WEIGHT`` chunks
  towards a prior (no outcome, no change: before any, every state is at even odds): for a
  first turn the rate of the state and its two neighbours in size (``NEIGHBOUR_WEIGHT``), that
  shrunk towards the rate over all states (``PRIOR_WEIGHT``), that towards ``PRIOR_P``; for a
  later turn the rate over all states. A one-off document (hundreds of chunks on its first
  turn) learns p ≈ 0 after one; a chat's early turns p ≈ 1, its last turns less. A state's
  counts are halved when they reach ``HALF_LIFE`` chunks (recent outcomes win);
- **log-odds.** A chain just read ranks by ``clip(logit p, -LO, HI)``;
- **shared keys' classes** (:func:`shared_class`): a read-rate bucket and a *readers' mass*
  bucket, the summed odds that the chains which read the key come back (issue 15, session
  10: a prefix is worth at least what the conversations reading it are; without it a rarely
  read prompt left before the conversation on it that returned).

Invariants: every count is non-negative, and a state's three counts are halved together; a
chain's state has size 0 from its second turn on; ``return_chance`` is in [1e-6, 1 - 1e-6];
``log_odds`` in [-LO, HI]; a shared class's ``shared_mass`` is at least the mass it was made
from (buckets round up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
#: weight, in chunks, of the prior of a first turn's state from its neighbours in size
NEIGHBOUR_WEIGHT = 256.0
#: a state's counts are halved when its outcomes reach this many chunks (recent ones win)
HALF_LIFE = 1 << 16
#: read-rate buckets of shared keys: bucket b holds rates in [2**(b-1), 2**b) / RATE_SCALE
RATE_SCALE = 1 << 16
#: readers' mass buckets of shared keys: bucket m (1 .. 2 * MASS_BUCKETS) stands for a mass up
#: to 2 ** (m - MASS_BUCKETS); at or below MASS_FLOOR a key has no live reader to speak of
MASS_BUCKETS = 20
MASS_FLOOR = 2.0**-MASS_BUCKETS

State = tuple[int, int]  # (turns, log2 chunks added); turns <= 0: a shared key's class


@dataclass(slots=True)
class Chain:
    """One conversation as the policy follows it."""

    turns: int
    state: State
    time: int  # tick of its last request
    weight: int  # chunks its last request added (its weight in the return counts)
    open: bool = True  # its state's outcome not counted yet (neither returned nor evicted)
    planned: bool = False  # followed through lookups (its returns are counted by lookup only)
    lent: float = 0.0  # the odds it added to the readers' mass of the shared keys it read ...
    lent_at: int = 0  # ... at this tick (replaced, not added to, when it reads them again)

    def enter(self, added: int, now: int) -> None:
        """The chain made a request adding ``added`` chunks at tick ``now``: its new state,
        open (no outcome counted yet)."""
        turns = self.turns
        self.state = (1, added.bit_length()) if turns <= 1 else (min(turns, MAX_TURNS), 0)
        self.time = now
        self.weight = max(added, 1)
        self.open = True


@dataclass(slots=True)
class Held:
    """A tracked key as the policy keeps it: one record, not a dict per field (a load reads
    and updates every field of each key it uses)."""

    chain: Chain | None  # the chain that holds it; None: shared (read by two chains)
    uses: int  # reads since it was first stored (a ghost's kept when it comes back)
    born: int  # the tick it was first stored
    mass: float = 0.0  # shared: its readers' summed odds of returning, as of its last use


#: an evicted key remembered: (its uses, the tick it was first stored, its chain; None: shared)
Ghost = tuple[int, int, Chain | None]


def shared_class(uses: int, born: int, now: int, mass: float = 0.0) -> State:
    """The class of a shared key read ``uses`` times since tick ``born`` whose readers' odds
    of returning sum to ``mass``: ``(-m, rate bucket)``, ``m`` 0 for no mass to speak of
    (below ``2 ** -MASS_BUCKETS``), else the least ``m >= 1`` with ``mass <= 2 ** (m -
    MASS_BUCKETS)`` (rounded up, so a key never ranks below its readers' own keys)."""
    rate = int((uses + 1) / (now - born + 1) * RATE_SCALE).bit_length()
    if mass <= MASS_FLOOR:
        return (0, rate)
    fraction, exponent = math.frexp(mass)  # mass = fraction * 2**exponent, 0.5 <= fraction < 1
    if fraction == 0.5:
        exponent -= 1
    bucket = exponent + MASS_BUCKETS
    return (-(bucket if bucket < 2 * MASS_BUCKETS else 2 * MASS_BUCKETS), rate)


def shared_mass(state: State) -> float:
    """The readers' mass a shared class stands for (its bucket's upper bound; 0: none)."""
    return 0.0 if state[0] == 0 else 2.0 ** (-state[0] - MASS_BUCKETS)


def shared_rate(state: State) -> float:
    """The read rate (reads per tick) a shared bucket stands for: the middle of its range."""
    return (1 << state[1]) / (2 * RATE_SCALE)


@dataclass(slots=True)
class StateOdds:
    """Outcomes counted per chain state (chunk-weighted, halved alike) and the return chance
    learnt from them (see the module docstring)."""

    counted: dict[State, float] = field(default_factory=dict)
    outcomes: dict[State, float] = field(default_factory=dict)  # outcomes, not chunks
    returned: dict[State, float] = field(default_factory=dict)
    all_counted: float = 0.0  # the same summed over the states (the prior of each)
    all_returned: float = 0.0
    #: log_odds per state since the last count (every count moves the prior of every state):
    #: an ``evict`` ranks each chain state once, the next often with no outcome in between. A
    #: cache, not state: left out of equality (``evict`` that declines changes no state)
    known: dict[State, float] = field(default_factory=dict, compare=False, repr=False)

    def return_chance(self, state: State) -> float:
        """The learnt chance that a chain in ``state`` returns: its own rate, shrunk towards
        (a first turn) its neighbours' in size, theirs towards all states'; (a later turn, whose
        state is the turn's) all states'."""
        prior = (self.all_returned + PRIOR_WEIGHT * PRIOR_P) / (self.all_counted + PRIOR_WEIGHT)
        returned, counted = self.returned.get, self.counted.get
        turns, size = state
        if turns <= 1:
            below, above = (turns, size - 1), (turns, size + 1)
            near = returned(below, 0.0) + returned(state, 0.0) + returned(above, 0.0)
            seen = counted(below, 0.0) + counted(state, 0.0) + counted(above, 0.0)
            prior = (near + NEIGHBOUR_WEIGHT * prior) / (seen + NEIGHBOUR_WEIGHT)
        p = (returned(state, 0.0) + PRIOR_WEIGHT * prior) / (counted(state, 0.0) + PRIOR_WEIGHT)
        return min(max(p, 1e-6), 1.0 - 1e-6)

    def log_odds(self, state: State) -> float:
        """The log-odds of a chain of ``state`` just read: ``logit p`` clipped to [-LO, HI]."""
        known = self.known.get(state)
        if known is None:
            p = self.return_chance(state)
            known = self.known[state] = min(max(math.log(p / (1.0 - p)), -LO), HI)
        return known

    def count(self, state: State, weight: int, returned: bool, first: bool) -> None:
        """An outcome of a stay in ``state`` whose request added ``weight`` chunks: it returned
        (``returned``) or its tail was evicted. Only the ``first`` outcome of a stay counts as
        one; a return after it adds a return."""
        self.known.clear()
        if returned:
            self.returned[state] = self.returned.get(state, 0.0) + weight
            self.all_returned += weight
        if not first:
            return
        counted = self.counted.get(state, 0.0) + weight
        outcomes = self.outcomes.get(state, 0.0) + 1.0
        if counted >= HALF_LIFE:
            counted /= 2
            outcomes /= 2
            self.returned[state] = self.returned.get(state, 0.0) / 2
        self.counted[state] = counted
        self.outcomes[state] = outcomes
        self.all_counted += weight
        if self.all_counted >= HALF_LIFE:
            self.all_counted /= 2
            self.all_returned /= 2
