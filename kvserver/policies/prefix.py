"""Prefix-aware eviction: shared prefixes by use count, private chains by recency, new chunks by
a learned reuse rate, a chain's tail before its head.

Runs inside the storage engine like every policy (single owner, no locks, no I/O); see
:mod:`kvserver.policies.base` for the call contract.

Why. KV chunks form prefix chains: a lookup's hits stop at its first miss, so a chunk is
worth keeping only while every chunk before it is kept. What the policy can see: a touch is
one request's hits, head first; a store batch is its new chunks, head first. From that:

- **shared vs private.** A key followed by two different keys (in touches or batches), or at
  which a chain read ends while a known child is still held, is a *branch point*: at least two
  chains pass through it. In a touch, every key up to the deepest branch point is a *shared
  prefix* (a system prompt, a document several questions start from) and is valued by its use
  count, which grows with the number of requests passing through it. The keys after it are
  private to one chain (one conversation): its count says how many turns the conversation had,
  not how likely it is to return, so they are all valued 1 and age in LRU order (the chain
  touched last stays longest);
- **new chunks** are valued by a learned reuse rate (:class:`ReusePredictor`, in
  :mod:`kvserver.policies.reuse_predictor`, after SHiP's signature-based insertion): the
  signature of a stored chunk is (log2 of its position in the batch, log2 of the batch
  length); per signature the policy counts the chunks read again and those evicted unread.
  A chat's next turn re-reads a short batch; a one-off document of hundreds of chunks is
  never read again. A chunk whose signature's rate is below
  ``ONE_OFF_RATE`` comes in at that rate, just above the eviction line, and leaves first (scan
  resistance that adapts to the workload); any other new chunk comes in at 1, as if just read,
  so the newest chunk is never the first to go (a client reading back what it just stored
  finds it, as with LRU);
- **tail before head**: an ancestor is read whenever its descendants are and is valued at
  least as high; on equal priority the deeper key leaves first (inserts and touches are
  numbered tail first), so what stays is a usable prefix.

Priority. GreedyDual: each tracked key ``k`` has ``H(k) = L + value(k)`` set when it is inserted
or touched; ``evict`` takes keys in ascending ``(H, tie)`` order and raises ``L`` to the ``H`` of
the last victim, so whatever is not used falls behind everything that is. ``value`` is the use
count of a shared key, 1 for a private one; for a new one its signature's reuse rate if that
is below ``ONE_OFF_RATE``, else 1.

Ghosts. An evicted key's use count (0 if it was private) is remembered (an OrderedDict, oldest
first, at most as many ghosts as tracked keys); a ghost inserted again resumes from it.

Heap. ``_prio[k] = (H, tie)`` is a key's priority; its one heap entry is ``(*_queued[k], k)``
with ``_queued[k] <= _prio[k]`` (a lower bound). A touch only raises priorities, so it updates
``_prio`` and pushes nothing (it pushes only when a priority drops, e.g. a shared key read as
private); ``evict`` pops the smallest entry, and if the key's priority has risen since, pushes
it again at its priority and goes on, so keys leave in exact ``(H, tie)`` order (lazy
reinsertion). Entries that are not a key's ``_queued`` one are garbage, dropped when popped;
the heap is rebuilt once they outnumber live ones.

Invariants: ``_prio`` and ``_queued`` hold exactly the tracked keys, ``_uses`` the same;
``_pending`` (the signature of a new key not yet touched), ``_child``, ``_branches`` and
``_shared`` only tracked keys; ghosts and tracked keys are disjoint. ``evict`` changes nothing
(predictor included) before it has chosen every victim, and a refusal (which has emptied the
heap) puts back the entries it popped and the ``_queued`` it changed, so a ``None`` leaves the
same state. Costs: insert O(log n) per key; touch O(1) per key (dict updates); evict
O(v log n) for v entries popped (victims, skipped non-evictable, garbage and re-queued ones);
``bench_policies`` measures the cost per chunk operation against LRU.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from itertools import repeat

from kvserver.policies.base import EvictionPolicy
from kvserver.policies.reuse_predictor import ReusePredictor, Signature

#: a new chunk whose signature's reuse rate is below this comes in at that rate (one-off: it
#: leaves first); above it, at 1 like a chunk just read (LRU among them: the newest stays)
ONE_OFF_RATE = 0.5

#: runs an iterator to its end, keeping nothing (a C loop over ``map(...)``)
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend

_Entry = tuple[float, int, Hashable]  # (H, tie, key)


class _Heap(list[_Entry]):
    """A binary heap of ``(H, tie, key)`` entries (``heapq`` on a list). Two heaps are equal
    when they hold the same entries, whatever their layout: a refused ``evict`` pops entries
    and pushes them back, which keeps the entries but may move them."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list):
            return NotImplemented
        return sorted(self, key=_order) == sorted(other, key=_order)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal


def _order(entry: _Entry) -> tuple[float, int]:
    return entry[0], entry[1]  # ties are unique: keys are never compared


class PrefixPolicy(EvictionPolicy):
    """GreedyDual-Frequency over prefix chains with learned insertion (see the module
    docstring)."""

    name = "prefix"

    def __init__(self) -> None:
        self._age = 0.0  # L
        self._tie = 0
        self._prio: dict[Hashable, tuple[float, int]] = {}
        self._uses: dict[Hashable, int] = {}
        self._pending: dict[Hashable, Signature] = {}
        self._child: dict[Hashable, Hashable] = {}  # the first child seen after a key
        self._branches: set[Hashable] = set()  # keys seen with two different children
        self._shared: set[Hashable] = set()  # keys valued by their use count
        self._heap = _Heap()
        self._queued: dict[Hashable, tuple[float, int]] = {}  # each key's heap entry
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()
        self._predictor = ReusePredictor()

    # ------------------------------------------------------------------ observability

    @property
    def age(self) -> float:
        """GreedyDual's L: the priority of the last victim."""
        return self._age

    @property
    def num_ghosts(self) -> int:
        return len(self._ghosts)

    def is_shared(self, key: Hashable) -> bool:
        """Whether ``key`` was last used as part of a shared prefix (valued by its uses)."""
        return key in self._shared

    @property
    def predictor(self) -> ReusePredictor:
        """The learned reuse rates of new chunks (read-only use)."""
        return self._predictor

    # ------------------------------------------------------------------ contract

    def insert(self, key: Hashable) -> None:
        """Track ``key`` as a batch of one; a tracked key is treated as ``touch([key])``."""
        self.insert_batch((key,))

    def insert_batch(self, keys: Sequence[Hashable]) -> None:
        """Track ``keys`` of one store batch in chain order (see the module docstring for
        what the position changes). Tracked keys in it are touched instead."""
        length = len(keys)
        predictor, child, prio = self._predictor, self._child, self._prio
        ghosts, uses, pending = self._ghosts, self._uses, self._pending
        #: the batch's values per signature: rates change only when an outcome is learnt,
        #: which only a touch of a tracked key in the batch does (then they are asked again)
        values: dict[Signature, float] = {}
        size_bits = length.bit_length()  # the signature's second half: the batch's length
        heap, queued, push, age = self._heap, self._queued, heapq.heappush, self._age
        for position in range(length - 1, -1, -1):
            key = keys[position]
            if key in prio:
                self.touch((key,))
                values.clear()
                heap, queued = self._heap, self._queued  # touch may rebuild them
                continue
            if position + 1 < length:
                child.setdefault(key, keys[position + 1])
            ghost = ghosts.pop(key, None)
            if ghost is not None:  # a returning chain: it was read before
                uses[key] = ghost + 1
                if ghost:
                    self._shared.add(key)
                self._set(key, ghost + 1.0 if ghost else 1.0)
                heap, queued = self._heap, self._queued
                continue
            sig = (position.bit_length(), size_bits)  # ReusePredictor.signature
            uses[key] = 0
            pending[key] = sig
            value = values.get(sig)
            if value is None:
                rate = predictor.rate(sig)
                value = values[sig] = rate if rate < ONE_OFF_RATE else 1.0
            # self._set(key, value), inlined (one per new key of every store). An untracked
            # key has no heap entry (``_queued`` holds the tracked keys only), and one entry
            # more for one key more keeps ``len(heap) <= 2 * len(prio) + 64`` (which every
            # call leaves true): no lower bound to compare with, no rebuild to check
            self._tie = tie = self._tie + 1
            h = age + value
            prio[key] = queued[key] = (h, tie)
            push(heap, (h, tie, key))

    def remove(self, key: Hashable) -> None:
        if self._prio.pop(key, None) is not None:
            del self._uses[key]
            self._forget(key)
            self._compact()

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Use ``keys`` (a chain, head first). The keys up to the deepest branch point among
        them are a shared prefix, valued by their use counts; the rest are private to one chain
        and valued 1, so they age in LRU order (see the module docstring)."""
        keys = list(keys)
        uses, pending, child, branches = self._uses, self._pending, self._child, self._branches
        shared, prio, heap, push = self._shared, self._prio, self._heap, heapq.heappush
        queued = self._queued
        first_reads: list[Signature] = []  # new keys read for the first time: outcomes
        age, tie = self._age, self._tie
        in_shared = False  # at or above the deepest branch point (keys go tail to head)
        after: Hashable = None  # the key after ``key`` in the chain
        last = len(keys) - 1
        for i in range(last, -1, -1):
            key = keys[i]
            if key not in uses:
                after = key
                continue
            if i < last:
                if child.setdefault(key, after) != after:
                    branches.add(key)
            elif child.get(key) in uses:
                branches.add(key)  # the chain read ends here although a known child is held
            after = key
            if key in pending:
                first_reads.append(pending.pop(key))
            count = uses[key] = uses[key] + 1
            if in_shared or key in branches:
                in_shared = True
                shared.add(key)
                h = age + count
            else:
                shared.discard(key)
                h = age + 1.0
            tie += 1
            new = prio[key] = (h, tie)
            if new < queued[key]:  # lower than its heap entry (rare): queue it again
                queued[key] = new
                push(heap, (h, tie, key))
        self._tie = tie
        if first_reads:  # learnt per signature at once (nothing above reads the predictor)
            self._predictor.learn_reused(Counter(first_reads))
        if len(heap) > 2 * len(prio) + 64:
            self._rebuild()

    def evict(
        self,
        need: int,
        cost: Callable[[Hashable], int],
        evictable: Callable[[Hashable], bool],
        incoming: Sequence[Hashable] = (),
    ) -> list[Hashable] | None:
        if need <= 0:
            return []
        heap, prio, queued = self._heap, self._prio, self._queued
        popped: list[_Entry] = []  # entries that were in the heap, to undo a refusal
        requeued: dict[Hashable, tuple[float, int]] = {}  # key -> its entry before
        held: list[_Entry] = []  # live entries of keys that are not evictable
        victims: list[Hashable] = []
        freed = 0
        top = self._age
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            entry = pop(heap)
            h, tie, key = entry
            current = queued.get(key)
            if current != (h, tie):
                popped.append(entry)
                continue  # garbage: dropped for good unless the eviction is refused
            if not requeued or key not in requeued:
                popped.append(entry)
            now = prio[key]
            if now != current:  # touched since it was queued: queue it at its priority
                requeued.setdefault(key, current)
                queued[key] = now
                push(heap, (*now, key))
                continue
            if not evictable(key):
                held.append(entry)
                continue
            victims.append(key)
            if h > top:
                top = h
            freed += cost(key)
            if freed >= need:
                break
        else:  # not enough evictable cost; the heap is empty: put back what was in it
            queued.update(requeued)
            self._heap = _Heap(popped)
            heapq.heapify(self._heap)
            return None
        for entry in held:
            push(heap, entry)
        self._age = top
        ghosts, pending, uses, shared = self._ghosts, self._pending, self._uses, self._shared
        child, branches = self._child, self._branches
        # the victims leave every map (``_forget`` for the batch, each map's loop in C); a
        # ghost keeps the use count of a shared victim, 0 for a private one, in victim order
        nones = repeat(None)
        _consume(map(prio.__delitem__, victims))
        _consume(map(queued.pop, victims, nones))
        # the signatures of victims never read, and how many of each
        unread = Counter(filter(None, map(pending.pop, victims, nones)))
        counts = list(map(uses.pop, victims))
        ghosts.update(zip(victims, repeat(0)))
        if shared and not shared.isdisjoint(victims):
            for key, count in zip(victims, counts, strict=True):
                if key in shared:
                    ghosts[key] = count
                    shared.discard(key)
        _consume(map(child.pop, victims, nones))
        branches.difference_update(victims)
        if unread:
            self._predictor.learn_unread(unread)
        excess = len(ghosts) - len(prio)
        if excess > 0:
            _consume(map(ghosts.popitem, repeat(False, excess)))  # the oldest first
        self._compact()
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._prio

    def __len__(self) -> int:
        return len(self._prio)

    def __iter__(self) -> Iterator[Hashable]:
        """Tracked keys in eviction order (first = next victim, ignoring pins)."""
        return iter(sorted(self._prio, key=self._prio.__getitem__))

    # ------------------------------------------------------------------ internals

    def _forget(self, key: Hashable) -> None:
        """Drop the per-key state besides ``_prio``/``_uses`` of a key that left."""
        self._pending.pop(key, None)
        self._queued.pop(key, None)
        self._child.pop(key, None)
        self._branches.discard(key)
        self._shared.discard(key)

    def _set(self, key: Hashable, value: float) -> None:
        self._tie += 1
        new = self._prio[key] = (self._age + value, self._tie)
        queued = self._queued.get(key)
        if queued is None or new < queued:  # else its entry is a lower bound: queued lazily
            self._queued[key] = new
            heapq.heappush(self._heap, (*new, key))
            if len(self._heap) > 2 * len(self._prio) + 64:
                self._rebuild()

    def _compact(self) -> None:
        """Drop garbage entries from the top of the heap; rebuild when they dominate."""
        heap, queued = self._heap, self._queued
        while heap and queued.get(heap[0][2]) != (heap[0][0], heap[0][1]):
            heapq.heappop(heap)
        if len(heap) > 2 * len(self._prio) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._queued = dict(self._prio)
        self._heap = _Heap((h, tie, key) for key, (h, tie) in self._prio.items())
        heapq.heapify(self._heap)
