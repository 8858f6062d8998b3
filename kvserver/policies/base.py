"""Eviction policy ABC: which ready chunk leaves a tier when space is needed.

Runs inside the storage engine (single owner, no locks, no I/O). A policy tracks the keys of the
*ready* entries of one tier; the engine tells it about every change:

    insert(key)        an entry became ready in this tier (after complete_store / promotion)
    insert_batch(keys) several did at once, in the order of their store request: the engine
                       passes a store's keys in request order, so within one batch a prefix
                       chain's chunks come head first (default: ``insert`` each in order)
    touch(keys)        the keys were used (lookup hit, load); feeds recency/frequency
    lookup(keys, hits) a planning lookup read ``keys`` (a request's chain, head first), the
                       first ``hits`` resident (default: ``touch(keys[:hits])``); the engine
                       passes the misses too only to a policy with ``reads_requests``
    remove(key)        an entry left the tier for a reason other than evict() (rollback, drop)
    evict(need, ..., incoming)
                       choose victims whose costs sum to >= need, atomically; ``incoming``
                       (given only to a policy with ``admits``) are the new keys the space
                       is for, and such a policy may decline the store (``None``, with
                       ``declined`` set)

Keys are opaque hashable values (the engine uses ``(namespace_index, chunk_key)`` tuples), so
one policy instance serves every namespace of a tier. Costs are in allocator pages, which lets
namespaces with different chunk sizes share one budget.

Invariants every implementation keeps:
- ``evict`` is all-or-nothing: it returns victims whose total cost is >= ``need`` and forgets
  them, or returns ``None`` and changes nothing (ghost/adaptive state included).
- ``evict`` never returns a key for which ``evictable(key)`` is false (pinned, protected).
- ``evict`` returns ``None`` only if the evictable keys cannot cover ``need``, or, for a
  policy with ``admits`` that was given ``incoming``, if it ranks those new keys below the
  victims they would displace (an admission decision: nothing changes, ``declined`` is set
  until the next ``evict``; the engine reports those keys as not admitted, as reuse gating's).
- the set of tracked keys is exactly the set inserted and not yet removed/evicted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC):
    """Base class of eviction policies; see the module docstring for the contract."""

    #: registry name, e.g. "lru"
    name: str = ""
    #: True: the engine calls :meth:`lookup` with a request's whole chain (misses included);
    #: False: only its hits, through ``touch`` (no key tuples built for the misses)
    reads_requests: bool = False
    #: True: ``evict`` may decline a store it is told the new keys of (``incoming``) when it
    #: values them below the victims (admission control); the engine then passes them
    admits: bool = False
    #: True when the last ``evict`` returned None because it declined ``incoming`` (room could
    #: have been made); False when it returned victims or could not make room. Only a policy
    #: with ``admits`` sets it.
    declined: bool = False

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """Track a newly ready key as most recently used. REQUIRES: key not tracked."""

    def insert_batch(self, keys: Sequence[Hashable]) -> None:
        """Track the keys of one store batch, given in request order (a prefix chain's head
        before its tail). The default inserts them one by one in that order; prefix-aware
        policies may use the positions. REQUIRES: no key tracked."""
        for key in keys:
            self.insert(key)

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Stop tracking ``key`` (no-op if it is not tracked)."""

    @abstractmethod
    def touch(self, keys: Iterable[Hashable]) -> None:
        """Mark tracked keys as used, first key = most important (processed last-to-first so
        the first key ends up most recent). Untracked keys are ignored, except that adaptive
        policies may learn from them (ARC ghost hits)."""

    def lookup(self, keys: Sequence[Hashable], hits: int) -> None:
        """A request read ``keys`` (head first); the first ``hits`` are tracked (its leading
        run of resident keys). The default touches the hits; policies that follow requests
        (``reads_requests``) may use the whole chain, e.g. to learn which keys come next."""
        if hits:
            self.touch(keys[:hits])

    @abstractmethod
    def evict(
        self,
        need: int,
        cost: Callable[[Hashable], int],
        evictable: Callable[[Hashable], bool],
        incoming: Sequence[Hashable] = (),
    ) -> list[Hashable] | None:
        """Choose victims with ``sum(cost(k)) >= need`` among keys where ``evictable(k)``.

        ``incoming``: the untracked keys the space is for (a store batch, head first), or
        empty when unknown (a policy without ``admits`` ignores it). Atomic: on success the
        victims are no longer tracked; on ``None`` nothing changed. ``need <= 0`` returns
        ``[]``.
        """

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Hashable]:
        """Tracked keys, in eviction order (first = next victim, ignoring pins)."""
