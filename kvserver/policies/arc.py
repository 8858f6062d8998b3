"""ARC eviction policy: adaptive balance between recency (T1) and frequency (T2).

Runs inside the storage engine like every policy (single owner, no locks, no I/O); see
:mod:`kvserver.policies.base` for the call contract. The algorithm is Megiddo and Modha's ARC
(FAST 2003).

State:
- ``T1``: resident keys seen once; ``T2``: resident keys seen at least twice. Both are
  OrderedDicts ordered LRU → MRU.
- ``B1`` / ``B2``: ghost lists, keys only, of what was recently evicted from T1 / T2.
- ``p`` (``target_t1_size``): how many entries T1 should get; moved by ghost hits.

Transitions:
- ``insert(k)``: k in B1 → p += max(1, |B2|/|B1|), k leaves B1 and enters T2 (MRU);
  k in B2 → p -= max(1, |B1|/|B2|), k leaves B2 and enters T2; otherwise k enters T1 (MRU).
- ``touch(ks)`` (last-to-first): T1 hit → T2 MRU; T2 hit → T2 MRU; a ghost hit only adapts p
  (as vLLM does) and leaves the ghost in place.
- ``evict``: victim by victim, take T1's LRU end while T1 (minus the victims already chosen
  from it) is larger than p, else T2's LRU end; non-evictable keys are skipped, and when one list
  has no evictable key left the other one is used. Only on commit do victims go to the MRU end of
  B1 / B2, and the ghost lists are trimmed.

Ghost bound. The policy does not know the tier's capacity, so it uses c = |T1| + |T2| at the
moment of a committed eviction (an eviction means the tier is full, so c is its capacity in
entries). After each commit, as in classic ARC (|T1|+|B1| <= c, |T1|+|T2|+|B1|+|B2| <= 2c):
B1 is trimmed from its LRU end until |T1| + |B1| <= c, then B2 (then B1) until
|B1| + |B2| <= c. p is clamped to [0, c'] where c' = |T1| + |T2| (+1 for the key being inserted)
when it adapts.

Invariants: T1, T2, B1, B2 are pairwise disjoint; tracked keys = T1 + T2; ghosts are never
returned by ``__iter__`` or ``evict``; ``evict`` returning None leaves every list and p untouched.
Cost of ``evict``: O(victims + skipped non-evictable keys + ghost entries trimmed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from kvserver.policies.base import EvictionPolicy

_NONE: Hashable = object()  # "no evictable key left in this list"


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache over unit-count lists (as vLLM's ``ARCCachePolicy``)."""

    name = "arc"

    def __init__(self) -> None:
        self._p = 0.0
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()

    # ------------------------------------------------------------------ observability

    @property
    def target_t1_size(self) -> float:
        """The adaptive target p for |T1|."""
        return self._p

    @property
    def num_recent(self) -> int:
        """|T1|: resident keys seen once."""
        return len(self._t1)

    @property
    def num_frequent(self) -> int:
        """|T2|: resident keys seen at least twice."""
        return len(self._t2)

    @property
    def num_ghosts(self) -> int:
        """|B1| + |B2|."""
        return len(self._b1) + len(self._b2)

    # ------------------------------------------------------------------ contract

    def insert(self, key: Hashable) -> None:
        """Track ``key``; a ghost key comes back as frequent (T2), a new one as recent (T1).
        A key already tracked is treated as ``touch([key])``."""
        if key in self._t1 or key in self._t2:
            self.touch((key,))
            return
        if key in self._b1:
            self._adapt_up(extra=1)
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._adapt_down(extra=1)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def remove(self, key: Hashable) -> None:
        if self._t1.pop(key, _NONE) is _NONE:
            self._t2.pop(key, None)

    def touch(self, keys: Iterable[Hashable]) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(list(keys)):
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)
            elif key in self._b1:
                self._adapt_up(extra=0)
            elif key in self._b2:
                self._adapt_down(extra=0)

    def evict(
        self,
        need: int,
        cost: Callable[[Hashable], int],
        evictable: Callable[[Hashable], bool],
        incoming: Sequence[Hashable] = (),
    ) -> list[Hashable] | None:
        if need <= 0:
            return []
        t1, t2 = self._t1, self._t2
        # Lazy scans from the LRU ends; nothing is mutated until every victim is chosen.
        cand1 = (k for k in t1 if evictable(k))
        cand2 = (k for k in t2 if evictable(k))
        victims: list[Hashable] = []
        num_from_t1 = 0
        left1, left2 = True, True  # whether the list may still hold an evictable key
        freed = 0
        while freed < need:
            prefer_t1 = len(t1) - num_from_t1 > self._p
            key: Hashable = _NONE
            for use_t1 in (prefer_t1, not prefer_t1):
                if use_t1 and left1:
                    key = next(cand1, _NONE)
                    left1 = key is not _NONE
                elif not use_t1 and left2:
                    key = next(cand2, _NONE)
                    left2 = key is not _NONE
                if key is not _NONE:
                    num_from_t1 += use_t1
                    break
            if key is _NONE:
                return None  # not enough evictable cost: nothing changed
            victims.append(key)
            freed += cost(key)
        self._commit(victims)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[Hashable]:
        """Resident keys in the order ``evict`` would take them if every key were evictable."""
        order: list[Hashable] = []
        t1, t2 = list(self._t1), list(self._t2)
        i1 = i2 = 0
        while i1 < len(t1) or i2 < len(t2):
            if i1 < len(t1) and (len(t1) - i1 > self._p or i2 == len(t2)):
                order.append(t1[i1])
                i1 += 1
            else:
                order.append(t2[i2])
                i2 += 1
        return iter(order)

    # ------------------------------------------------------------------ internals

    def _commit(self, victims: list[Hashable]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        capacity = len(t1) + len(t2)
        for key in victims:
            if key in t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
        while b1 and len(t1) + len(b1) > capacity:
            b1.popitem(last=False)
        while len(b1) + len(b2) > capacity:
            (b2 if b2 else b1).popitem(last=False)

    def _adapt_up(self, extra: int) -> None:
        """A B1 hit: T1 was too small."""
        step = max(1.0, len(self._b2) / len(self._b1))
        self._p = min(self._p + step, float(len(self._t1) + len(self._t2) + extra))

    def _adapt_down(self, extra: int) -> None:
        """A B2 hit: T2 was too small."""
        step = max(1.0, len(self._b1) / len(self._b2))
        self._p = max(self._p - step, 0.0)
        self._p = min(self._p, float(len(self._t1) + len(self._t2) + extra))
