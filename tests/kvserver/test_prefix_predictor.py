"""The prefix policy's reuse predictor: its batch updates (``learn_unread`` for an eviction's
unread victims, ``learn_reused`` for a touch's first reads) give exactly the state of the same
outcomes learnt one by one, halvings included; and a touch learns each new key's first read
once."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from kvserver.policies import reuse_predictor
from kvserver.policies.prefix import PrefixPolicy
from kvserver.policies.reuse_predictor import ReusePredictor

SIGS = st.tuples(st.integers(0, 6), st.integers(0, 6))


@given(st.lists(st.tuples(SIGS, st.integers(1, 2 * reuse_predictor.HALF_LIFE + 3)), max_size=6),
       st.booleans())  # fmt: skip
def test_batch_learning_equals_learning_one_by_one(runs: list[tuple[tuple[int, int], int]],
                                                   reused: bool) -> None:  # fmt: skip
    one, batch = ReusePredictor(), ReusePredictor()
    for sig, n in runs:
        one.learn((0, 1), reused=not reused)  # an earlier outcome of another kind
        batch.learn((0, 1), reused=not reused)
        for _ in range(n):
            one.learn(sig, reused=reused)
        (batch.learn_reused if reused else batch.learn_unread)({sig: n})
    assert one == batch  # the counts, halvings included, exactly (floats compared equal)


def test_a_touch_learns_each_new_keys_first_read_once() -> None:
    policy = PrefixPolicy()
    keys = [(0, i) for i in range(6)]
    policy.insert_batch(keys)
    sigs = [policy._pending[k] for k in keys]
    expected = ReusePredictor()
    for sig, n in Counter(sigs).items():
        for _ in range(n):
            expected.learn(sig, reused=True)
    policy.touch(keys)
    policy.touch(keys)  # read again: no longer pending, nothing more learnt
    assert policy._predictor == expected
    assert not any(k in policy._pending for k in keys)
