"""Scores for routers: per host, the leading run of a prompt's chunks it holds, weighted by
tier (the pattern of llm-d's ``GetPodScores``). Pure: no I/O.

``score = sum over tiers of weight[tier] * tokens of the run in that tier``; a host holding
the first 10 chunks of 16 tokens in DRAM (weight 1) and 6 more on SSD (weight 0.5) scores
160 + 48 = 208. Hosts are ranked by score, then by longer run, then by host id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvserver.cluster.schema import TIERS, HostInfo


@dataclass(frozen=True, slots=True)
class HostRun:
    """The leading run of a query's chunk keys that ``host`` holds per the fleet index.

    ``tiers`` splits it: ``{"dram": a, "ssd": b}`` with ``a + b == hit_chunks`` (the first
    ``a`` chunks... in DRAM, a chunk in both tiers counts as DRAM).
    """

    host: HostInfo
    hit_chunks: int
    tiers: dict[str, int]


@dataclass(frozen=True, slots=True)
class HostScore:
    host: HostInfo
    hit_chunks: int
    hit_tokens: int
    #: tokens of the run per tier, fastest first.
    tier_tokens: dict[str, int]
    score: float


def score_runs(
    runs: Sequence[HostRun], chunk_tokens: int, weights: Mapping[str, float]
) -> list[HostScore]:
    """One :class:`HostScore` per run, best first (module docstring)."""
    out = []
    for run in runs:
        tokens = {t: run.tiers.get(t, 0) * chunk_tokens for t in TIERS}
        score = sum(weights.get(t, 0.0) * n for t, n in tokens.items())
        hit_tokens = run.hit_chunks * chunk_tokens
        out.append(HostScore(run.host, run.hit_chunks, hit_tokens, tokens, score))
    out.sort(key=lambda s: (-s.score, -s.hit_chunks, s.host.host_id))
    return out
