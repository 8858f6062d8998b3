"""Tests of kvserver.policies.chain.return_gaps: the learnt survival of the gaps between two
requests of one conversation (``chain``'s ranking by age)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kvserver.policies.chain.return_gaps import LIMIT, PRIOR_GAP, ReturnGaps

AGES = [0, 1, 2, 3, 5, 8, 13, 50, 100, 333, 1_000, 4_097, 10**5, 10**9, (1 << 64) - 1]


def non_increasing(gaps: ReturnGaps) -> bool:
    values = [gaps.log_survival(age) for age in AGES]
    return values[0] == 0.0 and all(b <= a for a, b in itertools.pairwise(values))


def test_before_any_return_the_median_gap_is_the_prior_gap() -> None:
    gaps = ReturnGaps()
    assert gaps.mean == PRIOR_GAP and non_increasing(gaps)
    assert gaps.log_survival(int(PRIOR_GAP)) == pytest.approx(math.log(0.5), abs=0.01)


def test_memoryless_gaps_give_back_the_exponential() -> None:
    """Gaps drawn from an exponential of mean 50: log S(g) is -g / 50 where there are gaps."""
    rng = random.Random(0)
    gaps = ReturnGaps()
    for _ in range(1500):
        gaps.add(max(1, round(rng.expovariate(1 / 50))))
    assert gaps.mean == pytest.approx(50, rel=0.2) and non_increasing(gaps)
    for age in (25, 50, 100, 150):
        assert gaps.log_survival(age) == pytest.approx(-age / 50, abs=0.25)


def test_heavy_tailed_gaps_keep_a_long_idle_chain_alive() -> None:
    """Log-normal gaps (median 20 ticks, sigma 2): after ten mean gaps the exponential of the
    same mean says e**-10; the learnt survival says what the gaps say (a few per cent), and
    beyond the longest gap seen the fitted tail keeps it finite and falling."""
    rng = random.Random(1)
    gaps = ReturnGaps()
    drawn = [max(1, round(rng.lognormvariate(math.log(20), 2.0))) for _ in range(1500)]
    for gap in drawn:
        gaps.add(gap)
    age = round(10 * gaps.mean)
    share = sum(gap >= age for gap in drawn) / len(drawn)
    assert 0.005 < share < 0.1
    assert gaps.log_survival(age) == pytest.approx(math.log(share), abs=0.6)
    assert gaps.log_survival(age) > -5 > -age / gaps.mean
    beyond = 4 * max(drawn)
    assert -700 < gaps.log_survival(beyond) < gaps.log_survival(max(drawn))
    assert non_increasing(gaps)


def test_old_gaps_are_halved_and_the_table_is_a_cache() -> None:
    """The counts are halved at LIMIT returns (recent gaps win); the survival table is built
    on demand and not part of the state (two equal histories compare equal)."""
    first, second = ReturnGaps(), ReturnGaps()
    for _ in range(int(LIMIT) + 10):
        first.add(7)
        second.add(7)
    assert first.total < LIMIT
    first.log_survival(9)
    assert first == second
    for _ in range(int(LIMIT)):
        first.add(3_000)  # the gaps grew: the short ones fade
    assert first.log_survival(1_000) > math.log(0.5)


def _table_by_loop(gaps: ReturnGaps) -> list[float]:
    """The survival table as a plain loop per bin computes it (the reference the faster
    build must equal to the bit: a different rounding would change chain's decisions)."""
    from kvserver.policies.chain.return_gaps import _BINS, _CENTRES, _EDGES, PRIOR

    counts, total = gaps.counts, gaps.total
    if total > 0:
        mu = sum(c * n for c, n in zip(_CENTRES, counts, strict=True)) / total
        var = sum((c - mu) ** 2 * n for c, n in zip(_CENTRES, counts, strict=True)) / total
        sd = max(math.sqrt(var), 0.5)
    else:
        mu, sd = math.log(gaps.mean), 1.0
    table, above, scale = [], total, sd * math.sqrt(2)
    for b in range(_BINS):
        above -= counts[b]
        prior = 0.5 * math.erfc((_EDGES[b] - mu) / scale)
        share = (max(above, 0.0) + PRIOR * prior) / (total + PRIOR)
        table.append(math.log(share) if share > 1e-300 else -700.0)
    for b in range(1, _BINS):
        table[b] = min(table[b], table[b - 1])
    return table


def test_the_table_is_the_plain_loops_to_the_bit() -> None:
    """Gaps of every scale, halvings included: each rebuilt table equals the loop's exactly."""
    rng = random.Random(7)
    for _ in range(20):
        gaps = ReturnGaps()
        assert gaps.table == _table_by_loop(gaps)
        mu, sigma = rng.uniform(0, 8), rng.uniform(0.1, 3)
        for _ in range(rng.randint(1, 3000)):
            gaps.add(max(1, int(rng.lognormvariate(mu, sigma))))
            if gaps.since == 0.0:  # just rebuilt
                assert [x.hex() for x in gaps.table] == [x.hex() for x in _table_by_loop(gaps)]
