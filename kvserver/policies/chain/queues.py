"""The tracked keys of ``chain`` in one LRU list per class, merged by rank to choose victims.

Runs inside the storage engine as part of :class:`~kvserver.policies.chain.ChainPolicy` (single
owner, no locks, no I/O). The policy queues a key when it is stored or read
(:meth:`ClassQueues.queue_many`) and drops it when it leaves (:meth:`ClassQueues.drop_many`);
:meth:`~kvserver.policies.chain.ranking.Ranking.choose` merges the lists to choose the victims
of an ``evict``.

Order. A key's *class* is its chain's state, or a shared key's read-rate bucket. Within a class
every key's log-odds are the same offset (the class's, from the policy's current estimates)
plus a function of the key's age that never rises, so a list kept in order of last use is in
rank order: its head is the class's least valuable key. ``Ranking.choose`` merges the classes'
evictable heads on a heap by their log-odds at that moment and takes the lowest first; ties go
to the key queued first (its sequence number).

Costs: ``queue_many`` and ``drop_many`` O(1) per key (one call a batch).

Invariants: ``time`` and ``classes`` hold exactly the tracked keys, each key in the list of its
class and in no other; no list is empty; sequence numbers rise in each list from head to tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from kvserver.policies.chain.states import State


@dataclass(slots=True)
class ClassQueues:
    """Per-class LRU lists of the tracked keys (see the module docstring)."""

    time: dict[Hashable, int] = field(default_factory=dict)  # key -> tick of its last use
    classes: dict[Hashable, State] = field(default_factory=dict)
    lists: dict[State, OrderedDict[Hashable, int]] = field(default_factory=dict)  # -> seq
    seq: int = 0  # queue order (ties)

    def __contains__(self, key: object) -> bool:
        return key in self.time

    def __len__(self) -> int:
        return len(self.time)

    def queue_many(self, queued: list[tuple[Hashable, State]], now: int) -> None:
        """(Re)queue each (key, class) of ``queued``, in order, at the end of its class's list,
        used at ``now`` (one call per batch of keys: the store path pays no call per key)."""
        classes, lists, time, seq = self.classes, self.lists, self.time, self.seq
        last: State | None = None  # a batch's keys are mostly of one class: its list, once
        members: OrderedDict[Hashable, int] = OrderedDict()
        for key, state in queued:
            seq += 1
            time[key] = now
            old = classes.get(key)
            if old == state:  # used again in its class (a load, a re-read): to its list's end
                if state != last:
                    last, members = state, lists[state]
                members.move_to_end(key)
                members[key] = seq
                continue
            if old is not None:
                left = lists[old]
                del left[key]
                if not left:
                    del lists[old]
                    if old == last:
                        last = None
            if state != last:
                found = lists.get(state)
                if found is None:
                    found = lists[state] = OrderedDict()
                last, members = state, found
            members[key] = seq
            classes[key] = state
        self.seq = seq

    def drop(self, key: Hashable) -> None:
        """Forget the tracked ``key``. REQUIRES: ``key`` is tracked."""
        self.drop_many((key,))

    def drop_many(self, keys: Iterable[Hashable]) -> None:
        """Forget the tracked ``keys``. REQUIRES: each is tracked, none twice."""
        classes, lists, time = self.classes, self.lists, self.time
        for key in keys:
            state = classes.pop(key)
            members = lists[state]
            del members[key]
            if not members:
                del lists[state]
            del time[key]
