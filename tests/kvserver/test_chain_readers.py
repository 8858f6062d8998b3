"""Tests of ``chain``'s readers' mass and its adaptive ``bias`` (issue 15, session 10): a shared
prefix is worth at least what the conversations reading it are, and how much its read rate
counts against them is learnt from what misses."""

from __future__ import annotations

import math

import pytest

from kvserver.policies import make_policy
from kvserver.policies.chain import HI, KAPPA_STEP, ChainPolicy
from kvserver.policies.chain.states import shared_class, shared_mass

from .test_policies import serve, unit


def chain_policy() -> ChainPolicy:
    policy = make_policy("chain")
    assert isinstance(policy, ChainPolicy)
    return policy


def idle(policy: ChainPolicy, ticks: int) -> None:
    for _ in range(ticks):
        policy.touch(["nothing"])


def own_ghost_misses(policy: ChainPolicy, chunks: int) -> None:
    """A conversation whose ``chunks`` keys are evicted and that comes back to miss them, as
    in a cache too small for the conversations: each missed chunk lowers ``bias``."""
    name = f"q{chunks}-{len(policy)}"
    keys = [f"{name}-{j}" for j in range(chunks)]
    if len(policy) < chunks:  # ghosts are bounded by the tracked keys: room for these
        serve(policy, [f"filler-{name}-{j}" for j in range(chunks)], 100_000)
    serve(policy, keys, 100_000)
    assert policy.evict(chunks, unit, lambda k: str(k).startswith(f"{name}-")) is not None
    serve(policy, [*keys, f"{name}-next"], 100_000)


def test_shared_class_mass_buckets_round_up_and_none_below_the_floor() -> None:
    """A class's mass is the least power of two at or above the mass (so a shared key never
    ranks below its reader's own keys for the rounding), 0 for no mass."""
    for mass in (2.0**-19, 0.3, 0.5, 1.0, 1.7, 2.0, 3.0, 400.0):
        stands_for = shared_mass(shared_class(3, 0, 100, mass))
        assert mass <= stands_for < 2 * mass
    assert shared_mass(shared_class(3, 0, 100, 0.0)) == 0.0
    assert shared_mass(shared_class(3, 0, 100, 2.0**-21)) == 0.0
    assert shared_class(3, 0, 100, 0.0) == shared_class(3, 0, 100)  # the read-rate bucket alone


def test_a_prompt_read_by_two_chains_holds_both_odds_and_a_reread_replaces_a_share() -> None:
    """Before any outcome every state is at even odds (1). A prompt stored by one conversation
    and read by a second is shared, its readers' mass the first's odds (decayed by the gap's
    survival) plus the second's; when the second reads it again on its next turn, its share
    is replaced, not added to."""
    policy = chain_policy()
    serve(policy, ["sys0", "sys1", "a0", "a1"], 1000)
    assert policy.readers("sys0") == 0.0  # one chain's own key
    serve(policy, ["sys0", "sys1", "b0", "b1"], 1000)
    assert policy.is_shared("sys0") and policy.is_shared("sys1")
    first = policy.readers("sys0")
    survival = math.exp(policy.log_survival(2))  # a's lookup was 2 ticks before b's
    assert first == pytest.approx(1.0 + survival)
    serve(policy, ["sys0", "sys1", "b0", "b1", "b2"], 1000)  # b's second turn, 2 ticks later
    decayed = math.exp(policy.log_survival(2))
    p = policy.return_chance((2, 1))  # b's state now: its second turn, one chunk added
    a_share = (first - 1.0) * decayed  # the mass decayed, less b's first share decayed
    assert policy.readers("sys0") == pytest.approx(a_share + p / (1 - p))
    assert policy.readers("sys0") < first * decayed + p / (1 - p) - 0.5  # not b's twice
    assert not policy.is_shared("b0") and policy.readers("b0") == 0.0


def test_bias_falls_with_a_conversations_own_ghosts_and_rises_with_a_prompts() -> None:
    """``bias`` starts at HI (a shared key ranked as a chain sure to return), falls by
    ``KAPPA_STEP`` with each missed chunk that was the returning conversation's own, rises by
    as much with each that was a shared key's, and stays in [0, HI]."""
    policy = chain_policy()
    assert policy.shared_bias == HI
    own_ghost_misses(policy, 100)
    assert policy.shared_bias == pytest.approx(HI - 100 * KAPPA_STEP)
    for _ in range(25):
        own_ghost_misses(policy, 100)
    assert policy.shared_bias == 0.0
    prompt = [f"p{j}" for j in range(40)]
    serve(policy, [*prompt, "x0"], 100_000)
    serve(policy, [*prompt, "y0"], 100_000)  # shared
    assert policy.evict(40, unit, lambda k: str(k).startswith("p")) is not None
    serve(policy, [*prompt, "z0"], 100_000)  # 40 chunks missed that were shared
    assert policy.shared_bias == pytest.approx(40 * KAPPA_STEP)


def test_once_conversations_lack_room_a_rare_prompt_is_worth_what_its_readers_are() -> None:
    """A prompt stored long ago and rarely read, in a cache where conversations' own chunks
    are what misses (``bias`` 0): once its reader has been idle for a mean gap it leaves
    after that reader's own keys (prefix semantics: they are no use without it) and before
    a fresh conversation's first turn. Before session 10 (``bias`` fixed at HI, no readers'
    mass) the rare prompt outranked every conversation read as recently, so the fresh
    conversation's keys left first, and nothing kept a prompt from leaving before the keys of
    a conversation reading it once its read rate ranked below them."""
    policy = chain_policy()
    rare = [f"r{j}" for j in range(4)]
    serve(policy, [*rare, "y0"], 100_000)  # stored by a conversation long ago
    for _ in range(26):
        own_ghost_misses(policy, 100)
    assert policy.shared_bias == 0.0
    serve(policy, [*rare, "x0", "x1"], 100_000)  # read again by another: shared, x its reader
    assert policy.is_shared("r0") and policy.readers("r0") > 0.0
    idle(policy, round(policy.mean_gap))
    serve(policy, ["c0", "c1", "c2"], 100_000)  # a fresh conversation
    order = list(policy)
    assert order.index("x1") < order.index("x0") < order.index("r3") < order.index("r0")
    assert order.index("r0") < order.index("c2")
