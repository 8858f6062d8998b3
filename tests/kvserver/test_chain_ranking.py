"""Tests of ``chain``'s merge of its classes (:meth:`Ranking.choose`): it ranks each class's head
inline, and must choose in exactly the order :meth:`Ranking.rank` gives (``iter(policy)``, ties
queued first), over chains' states and shared keys of every read-rate and readers' mass bucket."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

import pytest

from kvserver.policies.chain import ChainPolicy

from .test_policies import unit


def outside(own: set[str]) -> Callable[[Hashable], bool]:
    """Evictable: not one of the request's own keys."""
    return lambda key: key not in own


def conversations(seed: int, capacity: int) -> ChainPolicy:
    """A policy after 600 requests of short conversations (1-4 turns of 1-12 chunks) over 12
    shared prompts of 4-24 chunks (Zipf-like), 24 live at a time, in a ``capacity``-key cache."""
    rng = random.Random(seed)
    prompts = [[f"p{i}-{j}" for j in range(rng.randint(4, 24))] for i in range(12)]
    live: list[list[object]] = []  # [keys so far, turns left]
    policy, started = ChainPolicy(), 0
    for _ in range(600):
        if len(live) < 24:
            prompt = prompts[min(int(rng.paretovariate(1.0)) - 1, 11)]
            live.append([list(prompt), rng.randint(1, 4)])
            started += 1
        conversation = rng.choice(live)
        keys: list[str] = conversation[0]  # type: ignore[assignment]
        keys += [f"c{started}-{len(keys)}-{j}" for j in range(rng.randint(1, 12))]
        conversation[1] -= 1  # type: ignore[operator]
        if conversation[1] == 0:
            live.remove(conversation)
        hits = 0
        while hits < len(keys) and keys[hits] in policy:
            hits += 1
        policy.lookup(keys, hits)
        missing = [key for key in keys[hits:] if key not in policy]
        need = len(policy) + len(missing) - capacity
        if need <= 0 or policy.evict(need, unit, outside(set(keys)), missing) is not None:
            policy.insert_batch(missing)
    return policy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evict_takes_the_keys_in_rank_order_over_every_class(seed: int) -> None:
    """Evicting all but one of the evictable keys (all of them, or those a predicate leaves)
    takes them in the order ``iter(policy)`` ranks them one by one; asking for one more than
    they cover is refused."""
    for refused in ("", "1", "13"):
        policy = conversations(seed, 300)
        classes = {policy._queues.classes[key] for key in policy}
        assert sum(state[0] < 0 for state in classes) >= 2  # readers' mass buckets merged
        assert sum(state[0] > 0 for state in classes) >= 3  # chains' states

        def evictable(key: object, refused: str = refused) -> bool:
            return str(key)[-1] not in refused

        order = [key for key in policy if evictable(key)]
        assert policy.evict(len(order) + 1, unit, evictable) is None
        assert policy.evict(len(order) - 1, unit, evictable) == order[:-1]
