"""The learnt distribution of the gaps between two requests of one conversation (``chain``).

Runs inside the storage engine as part of :class:`~kvserver.policies.chain.ChainPolicy` (single
owner, no locks, no I/O): ``chain`` calls :meth:`ReturnGaps.add` once per returning
conversation and :meth:`ReturnGaps.log_survival` for each candidate an ``evict`` compares.

Why. ``chain`` ranks a conversation last read ``g`` ticks ago by its odds of being live,
``p / (1 - p) * S(g)``, with ``S(g)`` the chance that a live conversation's next request comes
more than ``g`` ticks after its last. Assuming memoryless returns (``S(g) = exp(-g / mean)``)
is right when the next request is a uniform pick among the live conversations, and wrong when
users answer after a heavy-tailed think time: the mean is inflated by the tail, and a
conversation idle for ten mean gaps is still live with a chance the exponential puts at
``e**-10`` (docs/benchmarks.md: in the timed traces a fresh one-off document then outranked
conversations that came back). So ``S`` is learnt:

- a histogram of the observed gaps by bit length (bin ``b`` holds gaps in ``[2**(b-1), 2**b)``),
  halved when it holds ``LIMIT`` returns (recent ones win);
- ``S(2**b)`` = the share of the gaps ``>= 2**b``, mixed with ``PRIOR`` returns of a log-normal
  fitted to the histogram (the mean and spread of the bins' log gaps): beyond the longest gap
  seen the tail is the fitted one, never zero. Before any return the log-normal has the mean
  gap's median and spread 1;
- between two powers of two ``log S`` is interpolated linearly in the gap, which is exact for
  an exponential (memoryless returns give back the old ranking, up to the estimate's noise).

The table of ``log S`` at the powers of two is rebuilt by :meth:`add` once the returns added
since the last build reach ``REBUILD_SHARE`` of the histogram (every return while it holds
fewer than 32), so ``log_survival`` changes nothing and costs one interpolation.

Invariants: ``log_survival(0) == 0``; it never increases with the age (the histogram's
shares never increase with the edge, the prior's neither, and the table is clamped); the
mean gap stays positive.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field

#: returns the histogram holds before its counts are halved
LIMIT = 2048.0
#: weight, in returns, of the fitted log-normal in the survival estimate
PRIOR = 4.0
#: weight of the newest gap in the mean gap (exponential average)
GAP_WEIGHT = 1.0 / 256
#: the mean gap before any return was seen, in ticks
PRIOR_GAP = 64.0
#: the survival table is rebuilt once the returns added since it was built reach this share
#: of the histogram's (at least one): a rebuild is 65 bins of Python, a return one increment
REBUILD_SHARE = 1.0 / 32
#: bins by bit length: gaps and ages are ticks below 2**64 (an age is a tick count since the
#: policy started; a gap at or past 2**63 counts as 2**63 - 1)
_BINS = 65
#: a bin's log gap (its middle, 1.5 * 2**(b-1)) and its edge's, for the fit and the prior
_CENTRES = [math.log(1.5 * (1 << (b - 1))) if b else 0.0 for b in range(_BINS)]
_EDGES = [b * math.log(2) for b in range(_BINS)]


@dataclass(slots=True)
class ReturnGaps:
    """Gaps between two requests of one chain: their mean and their survival function."""

    mean: float = PRIOR_GAP  # exponential average of the gaps, in ticks
    counts: list[float] = field(default_factory=lambda: [0.0] * _BINS)  # by bit length
    total: float = 0.0
    since: float = 0.0  # returns added since the table was built
    table: list[float] = field(default_factory=list)  # log S(2**b), b = 0..64

    def __post_init__(self) -> None:
        if not self.table:
            self.table = self._survival_table()

    def add(self, gap: int) -> None:
        """A chain came back ``gap`` ticks after its last request (``gap`` >= 1)."""
        gap = min(max(gap, 1), (1 << (_BINS - 2)) - 1)
        self.mean += GAP_WEIGHT * (gap - self.mean)
        self.counts[gap.bit_length()] += 1.0
        self.total += 1.0
        if self.total >= LIMIT:
            self.counts = [count / 2 for count in self.counts]
            self.total /= 2
        self.since += 1.0
        if self.since >= max(1.0, REBUILD_SHARE * self.total):
            self.table = self._survival_table()
            self.since = 0.0

    def log_survival(self, age: int) -> float:
        """``log S(age)``: the log of the chance that a live chain's next request comes more
        than ``age`` ticks after its last (0 at age 0, non-increasing). REQUIRES: age < 2**64."""
        if age <= 0:
            return 0.0
        table = self.table
        b = age.bit_length()  # 2**(b-1) <= age < 2**b
        low = 1 << (b - 1)
        return table[b - 1] + (age - low) / low * (table[b] - table[b - 1])

    def _survival_table(self) -> list[float]:
        """``log S(2**b)`` for ``b`` in 0..64 (module docstring). Comprehensions over the bins,
        empty bins left out of the sums (they add 0.0) and no builtin ``max``/``min`` per bin:
        the float operations and their order are a loop's per bin, the same table to the bit,
        in half the instructions (450 k -> 225 k; while fewer than 32 returns are counted,
        every return rebuilds it)."""
        counts, total = self.counts, self.total
        if total > 0:
            seen = [(c, n) for c, n in zip(_CENTRES, counts, strict=True) if n]  # 0s add 0.0
            mu = sum([c * n for c, n in seen]) / total
            var = sum([(c - mu) ** 2 * n for c, n in seen]) / total
            sd = max(math.sqrt(var), 0.5)
        else:
            mu, sd = math.log(self.mean), 1.0
        scale, erfc, log, weight = sd * math.sqrt(2), math.erfc, math.log, total + PRIOR
        # the gaps of bit length <= b are < 2**b: those above it, total less the bins to b
        aboves = itertools.accumulate(counts, operator.sub, initial=total)
        next(aboves)
        shares = [  # max(above, 0.0), spelt out: builtin max and min cost a call each
            ((0.0 if above < 0.0 else above) + PRIOR * (0.5 * erfc((edge - mu) / scale))) / weight
            for above, edge in zip(aboves, _EDGES, strict=True)
        ]
        table = [log(share) if share > 1e-300 else -700.0 for share in shares]
        low = table[0]
        for b in range(1, _BINS):  # rounding never lets it rise
            if low < table[b]:
                table[b] = low
            else:
                low = table[b]
        return table
