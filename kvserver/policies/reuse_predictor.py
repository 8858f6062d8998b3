"""The reuse rate of newly stored chunks, learnt per signature: the prefix policy's insertion
value (after SHiP's signature-based insertion).

Runs inside the storage engine, owned by :class:`~kvserver.policies.prefix.PrefixPolicy` (its
``predictor``): single owner, no locks, no I/O. The signature of a stored chunk is (log2 of
its position in its store batch, log2 of the batch's length); per signature the predictor
counts the chunks read again and those evicted unread, the policy reporting each outcome
(:meth:`ReusePredictor.learn`, or counted per signature: ``learn_reused``,
``learn_unread``). A chat's next turn re-reads a short batch; a one-off document of hundreds
of chunks is never read again.

Contract: ``rate(sig)`` is in (0, 1] and changes only when an outcome of ``sig`` is learnt;
learning ``n`` outcomes at once gives the rates learning them one by one gives.
"""

from __future__ import annotations

#: position in a store batch at which a chunk's prior credit (before any learning) is halved
DEPTH_SCALE = 64
#: weight, in outcomes, of that prior in a signature's reuse rate
PRIOR_WEIGHT = 2.0
#: a signature's counts are halved when its outcome count reaches this (recent ones win)
HALF_LIFE = 4096

#: (log2 of a chunk's position in its store batch, log2 of the batch's length)
Signature = tuple[int, int]


class ReusePredictor:
    """Per-signature reuse rate of newly stored chunks: ``(reused + w * prior) / (seen + w)``
    with ``prior = 1 / (1 + position / DEPTH_SCALE)`` and ``w = PRIOR_WEIGHT``, where ``seen``
    counts the outcomes learnt (a new chunk touched: reused; evicted untouched: not). Rates
    change only when an outcome is learnt, so keys stored in a row get equal credit (and
    leave in LRU order). O(1) per call.

    Invariant: for every signature, ``0 <= reused <= seen`` (both halved together)."""

    def __init__(self) -> None:
        self._seen: dict[Signature, float] = {}
        self._reused: dict[Signature, float] = {}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReusePredictor):
            return NotImplemented
        return (self._seen, self._reused) == (other._seen, other._reused)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    @staticmethod
    def signature(position: int, length: int) -> Signature:
        return (position.bit_length(), length.bit_length())

    def rate(self, sig: Signature) -> float:
        """The predicted share of chunks with ``sig`` that are read again, in (0, 1]."""
        prior = 1.0 / (1.0 + ((1 << sig[0]) >> 1) / DEPTH_SCALE)
        return (self._reused.get(sig, 0.0) + PRIOR_WEIGHT * prior) / (
            self._seen.get(sig, 0.0) + PRIOR_WEIGHT
        )

    def learn(self, sig: Signature, reused: bool) -> None:
        """One outcome of a chunk stored with ``sig``."""
        seen = self._seen.get(sig, 0.0) + 1.0
        hits = self._reused.get(sig, 0.0) + (1.0 if reused else 0.0)
        if seen >= HALF_LIFE:
            seen, hits = seen / 2, hits / 2
        self._seen[sig], self._reused[sig] = seen, hits

    def learn_unread(self, counts: dict[Signature, int]) -> None:
        """``learn(sig, reused=False)`` ``n`` times for each ``sig: n`` of ``counts`` (the
        chunks of one eviction that were never read), with the same result, one dict update
        per signature."""
        self._learn_counts(counts, 0.0)

    def learn_reused(self, counts: dict[Signature, int]) -> None:
        """``learn(sig, reused=True)`` ``n`` times for each ``sig: n`` of ``counts`` (the new
        chunks one touch read first), with the same result, one dict update per signature."""
        self._learn_counts(counts, 1.0)

    def _learn_counts(self, counts: dict[Signature, int], hit: float) -> None:
        seen_of, reused_of = self._seen, self._reused
        for sig, n in counts.items():
            seen, hits = seen_of.get(sig, 0.0), reused_of.get(sig, 0.0)
            for _ in range(n):
                seen += 1.0
                hits += hit
                if seen >= HALF_LIFE:
                    seen, hits = seen / 2, hits / 2
            seen_of[sig], reused_of[sig] = seen, hits
