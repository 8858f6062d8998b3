"""What a read does to the keys ``chain`` tracks: each is queued again in its class, and the
readers' mass of the shared keys moves.

Runs inside the storage engine as part of :class:`~kvserver.policies.chain.ChainPolicy` (single
owner, no locks, no I/O). The policy holds one :class:`Reads` over its records of the tracked
keys (``Held``: a key's chain, None when shared; its uses, first store and readers' mass), its
:class:`~kvserver.policies.chain.queues.ClassQueues`, its learnt odds and its return gaps, and
calls it for every read: :meth:`Reads.use` for a lookup's hits and a store's keys already
tracked, :meth:`Reads.requeue` for a load's, :meth:`Reads.lend` for what a chain storing a key
another chain held lends it. Which chain holds a key otherwise (stores, evictions) is the
policy's; a read changes it only here.

- **a chain's key** read by its own chain is queued again in the chain's state;
- **a shared key** (``chain`` None) is valued by its read rate and its *readers' mass* ``M``,
  the summed odds, as of its last use, that the chains reading it return: on each read ``M``
  decays by the gap survival ``S(age)`` since its last use; a chain that reads it again
  replaces its share (what it lent at its previous request, :meth:`Reads.lend`, aged to now)
  with its odds now, it does not add a second one;
- **another chain's key** read by a chain becomes shared, its mass the odds of both;
- keys are queued deepest first (what stays is a usable prefix), a run of shared keys with the
  same uses, first store and mass (a prompt) classed once.

Costs: O(1) per key; one ``exp`` per distinct age a call meets. Invariant: a shared key's
readers' mass is never negative, and at least the odds the chain that read it last had then.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvserver.policies.chain.queues import ClassQueues
from kvserver.policies.chain.return_gaps import ReturnGaps
from kvserver.policies.chain.states import Chain, Held, State, StateOdds, shared_class


@dataclass(slots=True)
class Reads:
    """The effects of a read on the tracked keys' records and queues (see the module
    docstring)."""

    held: dict[Hashable, Held]  # the policy's records of the tracked keys
    queues: ClassQueues  # the tracked keys by class, in rank order
    odds: StateOdds  # outcomes per chain state: the return chances
    gaps: ReturnGaps  # between two requests of one chain: mean, survival

    def use(self, keys: Sequence[Hashable], chain: Chain | None, now: int) -> None:
        """The tracked ``keys`` were read (head first) by ``chain`` (None: by whoever holds
        them): queued again deepest first; a key another chain holds becomes shared."""
        records, time = self.held, self.queues.time
        queued: list[tuple[Hashable, State]] = []
        append = queued.append
        survival, exp = self.gaps.log_survival, math.exp
        known, factor = -1, 1.0  # S(age) of the last age met (a request's keys mostly share one)
        # a request's shared keys (a prompt) mostly share their uses, first store and mass:
        # their class is computed once per run of equal ones
        last: tuple[int, int, float] | None = None
        cls: State = (0, 0)
        if chain is None:
            for key in reversed(keys):
                held = records[key]
                held.uses += 1
                if held.chain is None:
                    if held.mass:
                        if now - time[key] != known:
                            known = now - time[key]
                            factor = exp(survival(known))
                        held.mass *= factor
                    if last != (held.uses, held.born, held.mass):
                        last = (held.uses, held.born, held.mass)
                        cls = shared_class(held.uses, held.born, now, held.mass)
                    append((key, cls))
                else:
                    append((key, held.chain.state))
        else:
            state = chain.state
            # what chain lent these keys at its last request, as of now: replaced, not added to
            owed = chain.lent * math.exp(self.gaps.log_survival(now - chain.lent_at))
            lends = 0.0  # its odds as of now, once a shared key is met
            for key in reversed(keys):
                held = records[key]
                held.uses += 1
                owner = held.chain
                if owner is chain:
                    append((key, state))
                    continue
                if not lends:
                    lends = self.lend(chain, now)
                if owner is None:  # shared: its mass decayed to now, chain's old share out
                    if held.mass:
                        if now - time[key] != known:
                            known = now - time[key]
                            factor = exp(survival(known))
                        mass = held.mass * factor - owed
                    else:
                        mass = 0.0
                    held.mass = (mass if mass > 0.0 else 0.0) + lends
                else:  # another chain's key read by this one: shared from now on, read by both
                    held.chain = None
                    held.mass = self.lend(owner, now) + lends
                if last != (held.uses, held.born, held.mass):
                    last = (held.uses, held.born, held.mass)
                    cls = shared_class(held.uses, held.born, now, held.mass)
                append((key, cls))
        self.queues.queue_many(queued, now)

    def requeue(self, used: Sequence[tuple[Hashable, Held]], now: int) -> None:
        """A load read the tracked keys of ``used`` (head first; each with its record): as
        :meth:`use` with no reading chain, the records already known."""
        queued: list[tuple[Hashable, State]] = []
        append = queued.append
        time, survival = self.queues.time, self.gaps.log_survival
        known, factor = -1, 1.0  # S(age) of the last age met (a load's keys mostly share one)
        for key, held in reversed(used):
            held.uses += 1
            chain = held.chain
            if chain is None:
                if held.mass:  # its readers' mass decayed by S(age) since its last use
                    if now - time[key] != known:
                        known = now - time[key]
                        factor = math.exp(survival(known))
                    held.mass *= factor
                append((key, shared_class(held.uses, held.born, now, held.mass)))
            else:
                append((key, chain.state))
        self.queues.queue_many(queued, now)

    def lend(self, chain: Chain, now: int) -> float:
        """``chain``'s odds of returning as of ``now``, recorded as what it lends the readers'
        mass of the shared keys it reads (as of its last request, so the next read of those
        keys by it can take its share out before adding the new one)."""
        chain.lent = math.exp(self.odds.log_odds(chain.state))
        chain.lent_at = chain.time
        return chain.lent * math.exp(self.gaps.log_survival(now - chain.time))
