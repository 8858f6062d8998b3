"""Chain-return eviction (``chain``): conversations ranked by the learnt odds that they come
back, shared prefixes by how often they are read, each chain's tail before its head.

Runs inside the storage engine like every policy (single owner, no locks, no I/O); see
:mod:`kvserver.policies.base` for the call contract. It reads whole requests through
:meth:`EvictionPolicy.lookup` (``reads_requests = True``: the engine passes a planning lookup's
keys, misses included), which is what lets it follow a conversation from turn to turn.

Why. A conversation's next turn re-reads its whole context, so a private chain is worth its
space only if the conversation comes back, and a chain that was read (or stored) long ago is
more likely to have ended. Which chains end is learnt, not assumed. The modules, one concept
each (imports go down the list):

- :mod:`~kvserver.policies.chain.states`: a chain (one conversation as the policy follows
  it), its state (turns so far; on a first turn, log2 of the chunks it added), and the return
  chance learnt per state from the outcomes seen (it returned, or its tail was evicted first);
- :mod:`~kvserver.policies.chain.return_gaps`: the learnt survival ``S(g)`` of the gaps between
  two requests of one chain (a chain idle ``g`` ticks is live with odds ``p / (1 - p) *
  S(g)``);
- :mod:`~kvserver.policies.chain.queues`: the tracked keys in one LRU list per class (a chain
  state, or a shared key's read-rate and readers' mass buckets), each list in rank order;
- :mod:`~kvserver.policies.chain.ranking`: a class's log-odds now (its state's odds and the
  gap survival; a shared class's read rate, ``kappa``, ``bias`` and readers' mass), and the
  merge of the classes' heads by rank that chooses the victims;
- :mod:`~kvserver.policies.chain.reads`: what a read does to the keys it reads: each queued
  again in its class; a shared key's readers' mass decayed and the reading chain's share
  replaced, a key read by a second chain made shared;
- :mod:`~kvserver.policies.chain.admission`: whether a store's new keys are worth the keys they
  would displace (a one-off document, once documents were seen to leave unread, is declined);
- :mod:`~kvserver.policies.chain.policy`: :class:`ChainPolicy`, which follows the chains
  through lookups, stores, loads and evictions, values shared prefixes by read rate and by the
  odds that the chains reading them return (their readers' mass), and adapts how much their
  age (``kappa``) and their read rate (``bias``) count.

docs/benchmarks.md ("Eviction policies vs Belady") has the measurements and what was tried.
"""

from __future__ import annotations

from kvserver.policies.chain.admission import MARGIN, MIN_OUTCOMES
from kvserver.policies.chain.policy import KAPPA_STEP, ChainPolicy
from kvserver.policies.chain.states import HALF_LIFE, HI, LO, MAX_TURNS, PRIOR_WEIGHT

__all__ = [
    "HALF_LIFE",
    "HI",
    "KAPPA_STEP",
    "LO",
    "MARGIN",
    "MAX_TURNS",
    "MIN_OUTCOMES",
    "PRIOR_WEIGHT",
    "ChainPolicy",
]
