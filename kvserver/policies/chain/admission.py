"""Admission for ``chain``: whether a store's new keys are worth the keys they would displace.

Runs inside the storage engine as part of :class:`~kvserver.policies.chain.ChainPolicy` (single
owner, no locks, no I/O): ``evict``, told the new keys a store is for (``incoming``), has chosen
its victims and calls :func:`declines` before it changes anything; a decline makes ``evict``
return ``None`` with ``declined`` set (the engine reports the keys as not admitted,
``filtered``, as reuse gating does: not stored, and not a full cache).

Why. Every store must otherwise be made room for, and a 2,000-chunk document in a cache of
3,500 flushes most of the conversations it holds (docs/benchmarks.md: it is most of what
``chain`` gains on chat at 5 %). Each new key would be queued at the next tick in its chain's
state (the chain that looked it up; a batch no lookup announced is a new chain's first turn; a
returning ghost of a shared key in its read-rate class): if every one of them would rank below
the first victim (lower log-odds, age 0) by ``MARGIN`` or more, and each such state has
``MIN_OUTCOMES`` outcomes, its own and its two neighbours' in size on the same turn (a state
learnt from one eviction is no evidence; since session 9 two documents of neighbouring sizes
are, as they are for the pooled return chance), storing them would swap kept keys for keys that
leave first. A document (hundreds of new chunks on a
first turn) is so declined once documents have been seen to leave unread (``p`` of its state
near 0), unless what it displaces ranks lower still (an older document's leftovers). Without
``incoming`` (the SSD tier; promotions and peer fetches' placements) nothing is declined.

Pure: reads the policy's tables it is given, changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Hashable, Mapping, Sequence

from kvserver.policies.chain.states import HI, Chain, Ghost, State, StateOdds, shared_class

#: admission's evidence: a store is declined only if the state its new keys would enter and
#: its two neighbours in size on the same turn have at least this many outcomes ...
MIN_OUTCOMES = 2
#: ... and they rank below the first victim by at least this much (log-odds)
MARGIN = 0.25


def proven(state: State, odds: StateOdds, offset: Callable[[State], float]) -> float:
    """The log-odds of a key of chain state ``state`` just read (``offset``), or ``HI`` (ranks
    above every victim) while the state and its two neighbours in size on the same turn (the
    states its return chance is pooled with) have too few outcomes to decline on."""
    turns, size = state
    outcomes = odds.outcomes.get
    seen = (
        outcomes((turns, size - 1), 0.0) + outcomes(state, 0.0) + outcomes((turns, size + 1), 0.0)
    )
    if seen < MIN_OUTCOMES:
        return HI
    return offset(state)


def declines(
    incoming: Sequence[Hashable],
    lowest: float,
    now: int,
    tracked: Container[Hashable],
    pending: Mapping[Hashable, Chain],
    ghosts: Mapping[Hashable, Ghost],
    odds: StateOdds,
    offset: Callable[[State], float],
) -> bool:
    """Whether every new key of ``incoming`` (those not ``tracked``) would rank below
    ``lowest``, the log-odds of the first victim, at age 0 by ``MARGIN`` or more, each in a
    state with evidence of its own (a shared key's by its read rate); False when none is new.

    ``now`` is the tick the store would queue them at; ``pending`` the chains that looked keys
    up, ``ghosts`` the evicted keys remembered, ``offset(state)`` a class's log-odds at age 0
    (a shared class's readers' mass included: a ghost coming back shared is lent the odds of
    the chain that looked it up, as the store would)."""
    lowest -= MARGIN
    fresh: float | None = None  # a batch no lookup announced: a new chain's first turn
    new = False
    last: Chain | None = None  # a batch is mostly one chain's: its rank, once
    last_rank = 0.0
    for key in incoming:
        if key in tracked:
            continue
        new = True
        chain = pending.get(key)
        ghost = ghosts.get(key)
        if ghost is not None and ghost[2] is not chain:  # comes back shared, read by chain
            lent = math.exp(odds.log_odds(chain.state)) if chain is not None else 0.0
            rank = offset(shared_class(ghost[0], ghost[1], now, lent))
        elif chain is not None:
            if chain is not last:
                last, last_rank = chain, proven(chain.state, odds, offset)
            rank = last_rank
        else:
            if fresh is None:
                fresh = proven((1, len(incoming).bit_length()), odds, offset)
            rank = fresh
        if rank >= lowest:
            return False
    return new
