"""Tests of kvserver.policies: the shared contract, run against every registered policy, plus
ARC's scan resistance compared with LRU."""

from __future__ import annotations

import copy
import math
from collections.abc import Hashable, Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvserver.errors import InvalidArgument
from kvserver.policies import POLICIES, EvictionPolicy, make_policy, policy_names
from kvserver.policies.arc import ARCPolicy
from kvserver.policies.chain import KAPPA_STEP, ChainPolicy
from kvserver.policies.prefix import PrefixPolicy

ALL = sorted(POLICIES)


def unit(_key: Hashable) -> int:
    return 1


def always(_key: Hashable) -> bool:
    return True


def filled(name: str, keys: Iterable[Hashable]) -> EvictionPolicy:
    policy = make_policy(name)
    for key in keys:
        policy.insert(key)
    return policy


def snapshot(policy: EvictionPolicy) -> Any:
    """Everything the policy holds (OrderedDicts compare with their order); ``declined``
    reports the last ``evict``, it is not state."""
    return copy.deepcopy({k: v for k, v in vars(policy).items() if k != "declined"})


class BoundedCache:
    """A cache of ``capacity`` unit-cost entries driven by ``policy``: hits are touched, misses
    inserted after evicting one victim when full."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity

    def access(self, key: Hashable) -> bool:
        if key in self.policy:
            self.policy.touch([key])
            return True
        if len(self.policy) >= self.capacity:
            assert self.policy.evict(1, unit, always) is not None
        self.policy.insert(key)
        return False


# ---------------------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert policy_names() == sorted(POLICIES) == ["arc", "chain", "lru", "prefix"]
    for name, cls in POLICIES.items():
        assert cls.name == name
        assert isinstance(make_policy(name), cls)


def test_unknown_policy_lists_choices() -> None:
    with pytest.raises(InvalidArgument) as info:
        make_policy("fifo")
    message = str(info.value)
    assert "fifo" in message
    for name in POLICIES:
        assert name in message


# ---------------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", ALL)
def test_insert_remove_len_contains_iter(name: str) -> None:
    policy = filled(name, range(5))
    assert len(policy) == 5
    assert list(policy) == [0, 1, 2, 3, 4]
    assert 3 in policy and 7 not in policy
    policy.remove(3)
    policy.remove(99)  # untracked: no-op
    assert 3 not in policy
    assert list(policy) == [0, 1, 2, 4]
    assert len(policy) == 4


@pytest.mark.parametrize("name", ALL)
def test_touch_first_key_ends_most_recent(name: str) -> None:
    policy = filled(name, range(5))
    policy.touch([3, 1, 42])  # 42 is untracked and ignored
    assert list(policy) == [0, 2, 4, 1, 3]
    assert policy.evict(5, unit, always) == [0, 2, 4, 1, 3]
    assert len(policy) == 0


@pytest.mark.parametrize("name", ALL)
def test_evict_oldest_first_when_fresh(name: str) -> None:
    policy = filled(name, range(10))
    assert policy.evict(3, unit, always) == [0, 1, 2]
    assert list(policy) == list(range(3, 10))
    assert 0 not in policy


@pytest.mark.parametrize("name", ALL)
def test_evict_skips_non_evictable(name: str) -> None:
    policy = filled(name, range(6))
    pinned = {0, 2, 3}
    assert policy.evict(2, unit, lambda k: k not in pinned) == [1, 4]
    assert list(policy) == [0, 2, 3, 5]


@pytest.mark.parametrize("name", ALL)
def test_evict_is_atomic(name: str) -> None:
    """Not enough evictable cost: None, and nothing changed (ARC ghosts and target included)."""
    policy = filled(name, range(8))
    policy.touch([1, 5])
    assert policy.evict(2, unit, always) is not None  # ARC: ghosts exist now
    policy.insert(0)  # ARC: ghost hit adapts p and lands in T2
    before, order = snapshot(policy), list(policy)
    assert policy.evict(5, unit, lambda k: k in {3, 4, 5}) is None
    assert policy.evict(100, unit, always) is None
    assert snapshot(policy) == before
    assert list(policy) == order


@pytest.mark.parametrize("name", ALL)
def test_evict_cost_weighted(name: str) -> None:
    costs = {"a": 1, "b": 3, "c": 2, "d": 4}
    policy = filled(name, costs)
    victims = policy.evict(5, costs.__getitem__, always)
    assert victims == ["a", "b", "c"]
    assert list(policy) == ["d"]
    assert policy.evict(5, costs.__getitem__, always) is None
    assert policy.evict(4, costs.__getitem__, always) == ["d"]


@pytest.mark.parametrize("name", ALL)
def test_evict_nothing_needed(name: str) -> None:
    policy = filled(name, range(3))
    assert policy.evict(0, unit, always) == []
    assert policy.evict(-4, unit, always) == []
    assert make_policy(name).evict(0, unit, always) == []
    assert list(policy) == [0, 1, 2]


# ---------------------------------------------------------------------------- stateful


class PolicyMachine(RuleBasedStateMachine):
    """Random insert/remove/touch/evict against a model set of tracked keys."""

    policy_name = ""

    def __init__(self) -> None:
        super().__init__()
        self.policy = make_policy(self.policy_name)
        self.model: set[int] = set()

    @staticmethod
    def cost(key: Hashable) -> int:
        assert isinstance(key, int)
        return 1 + key % 3

    @rule(key=st.integers(0, 30))
    def insert(self, key: int) -> None:
        if key not in self.model:
            self.policy.insert(key)
            self.model.add(key)

    @rule(keys=st.lists(st.integers(0, 30), max_size=8, unique=True))
    def insert_batch(self, keys: list[int]) -> None:
        new = [key for key in keys if key not in self.model]
        self.policy.insert_batch(new)
        self.model.update(new)

    @rule(keys=st.lists(st.integers(0, 30), max_size=10, unique=True))
    def lookup(self, keys: list[int]) -> None:
        """A request's chain: its leading run of tracked keys are the hits (as the engine)."""
        hits = 0
        while hits < len(keys) and keys[hits] in self.model:
            hits += 1
        self.policy.lookup(keys, hits)

    @rule(key=st.integers(0, 30))
    def remove(self, key: int) -> None:
        self.policy.remove(key)
        self.model.discard(key)

    @rule(keys=st.lists(st.integers(0, 30), max_size=8))
    def touch(self, keys: list[int]) -> None:
        self.policy.touch(keys)

    @rule(
        need=st.integers(-1, 25),
        pinned=st.frozensets(st.integers(0, 30), max_size=10),
        incoming=st.lists(st.integers(31, 40), max_size=4, unique=True),
    )
    def evict(self, need: int, pinned: frozenset[int], incoming: list[int]) -> None:
        """Evict, sometimes for a store of new keys (``incoming``, never tracked here): only
        a policy that ``admits`` may decline such a store, and then nothing changes."""
        available = sum(self.cost(k) for k in self.model if k not in pinned)
        before = snapshot(self.policy)
        victims = self.policy.evict(need, self.cost, lambda k: k not in pinned, incoming)
        if victims is None:
            declined = self.policy.admits and bool(incoming) and 0 < need <= available
            assert need > available or declined
            assert self.policy.declined == declined  # room could be made: it declined
            assert snapshot(self.policy) == before
            return
        assert not self.policy.declined
        assert need <= available or need <= 0
        assert len(set(victims)) == len(victims)
        assert set(victims) <= self.model
        assert not set(victims) & pinned
        costs = [self.cost(k) for k in victims]
        if need <= 0:
            assert victims == []
        else:
            assert sum(costs) >= need > sum(costs[:-1])  # no more victims than needed
        self.model -= set(victims)

    @invariant()
    def tracked_set_matches_model(self) -> None:
        order = list(self.policy)
        assert len(order) == len(set(order)) == len(self.policy)
        assert set(order) == self.model
        assert all(k in self.policy for k in self.model)

    @invariant()
    def arc_lists_consistent(self) -> None:
        policy = self.policy
        if not isinstance(policy, ARCPolicy):
            return
        lists = [set(policy._t1), set(policy._t2), set(policy._b1), set(policy._b2)]
        assert sum(map(len, lists)) == len(set().union(*lists))
        assert policy.target_t1_size >= 0.0


@pytest.mark.parametrize("name", ALL)
def test_stateful_against_model(name: str) -> None:
    machine = type(f"PolicyMachine_{name}", (PolicyMachine,), {"policy_name": name})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=150,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# ---------------------------------------------------------------------------- ARC specifics


def run_scan(name: str, hot: list[int], scan: Iterable[int], capacity: int) -> EvictionPolicy:
    """Warm a working set (inserted, then used twice), then stream a one-pass scan."""
    cache = BoundedCache(make_policy(name), capacity)
    for _ in range(3):
        for key in hot:
            cache.access(key)
    for key in scan:
        cache.access(key)
    return cache.policy


def test_arc_is_scan_resistant_lru_is_not() -> None:
    """A frequent working set of 8 survives a 100-key one-pass scan in ARC, not in LRU."""
    hot = list(range(8))
    scan = range(1000, 1100)
    arc = run_scan("arc", hot, scan, capacity=16)
    lru = run_scan("lru", hot, scan, capacity=16)
    assert all(k in arc for k in hot)
    assert not any(k in lru for k in hot)
    assert len(arc) == len(lru) == 16


def test_arc_ghost_hit_returns_as_frequent_and_raises_target() -> None:
    policy = filled("arc", range(4))
    assert policy.evict(1, unit, always) == [0]
    assert isinstance(policy, ARCPolicy)
    assert policy.num_ghosts == 1 and policy.target_t1_size == 0
    policy.insert(0)
    assert policy.target_t1_size == 1 and policy.num_frequent == 1 and policy.num_ghosts == 0
    assert list(policy) == [1, 2, 0, 3]  # T1 while |T1| > p=1, then T2, then the rest of T1


def test_arc_ghost_lists_bounded_by_resident_count() -> None:
    cache = BoundedCache(make_policy("arc"), capacity=10)
    for key in range(1000):
        cache.access(key)
    policy = cache.policy
    assert isinstance(policy, ARCPolicy)
    assert len(policy) == 10 and policy.num_ghosts <= 10


# ---------------------------------------------------------------------------- prefix specifics


def test_prefix_batch_tail_leaves_before_head() -> None:
    """A stored chain loses its deepest chunk first, so what stays is still a usable prefix."""
    policy = make_policy("prefix")
    policy.insert_batch(["a0", "a1", "a2"])
    policy.insert_batch(["b0", "b1"])
    assert policy.evict(2, unit, always) == ["a2", "a1"]
    assert list(policy) == ["a0", "b1", "b0"]  # batch by batch, each tail first


def test_prefix_batch_order_is_lru_order_for_single_inserts() -> None:
    """Without batches the policy orders like LRU (the shared contract tests rely on it)."""
    policy = filled("prefix", range(4))
    policy.touch([2, 0])
    assert list(policy) == [1, 3, 0, 2]  # as LRU: the first key touched ends most recent


def test_prefix_shared_head_survives_a_long_one_off_document() -> None:
    """A system prompt read by many conversations outlives a 100-chunk document scan that
    flushes it from LRU."""
    head = [f"sys{i}" for i in range(8)]
    results = {}
    for name in ("lru", "prefix"):
        policy, size, capacity = make_policy(name), 0, 40
        for conversation in range(4):
            chain = head + [f"c{conversation}-{i}" for i in range(4)]
            hits = 0
            while hits < len(chain) and chain[hits] in policy:
                hits += 1
            policy.touch(chain[:hits])
            new = chain[hits:]
            policy.insert_batch(new)
            size += len(new)
        document = [f"doc{i}" for i in range(100)]
        for start in range(0, len(document), 10):  # stored in batches of 10
            batch = document[start : start + 10]
            victims = policy.evict(size + len(batch) - capacity, unit, always)
            assert victims is not None
            size -= len(victims)
            policy.insert_batch(batch)
            size += len(batch)
        results[name] = sum(key in policy for key in head)
    assert results == {"lru": 0, "prefix": len(head)}


def test_prefix_ghost_keeps_use_count_and_ghosts_stay_bounded() -> None:
    policy = make_policy("prefix")
    assert isinstance(policy, PrefixPolicy)
    policy.insert_batch(["hot", "a"])
    for i in range(5):
        policy.touch(["hot", f"x{i}"])  # read by five different chains: a shared prefix
    assert policy.is_shared("hot")
    policy.insert_batch(["f0", "f1", "f2"])
    assert policy.evict(1, unit, lambda k: k == "hot") == ["hot"]
    assert policy.num_ghosts == 1
    policy.insert("hot")  # it returns: resumes from its use count, above every fresh key
    policy.insert("new")
    assert list(policy)[-1] == "hot" and policy.is_shared("hot")
    assert policy.evict(5, unit, always) == ["a", "f2", "f1", "f0", "new"]
    assert policy.num_ghosts == 1  # bounded by the (now one) tracked key
    cache = BoundedCache(make_policy("prefix"), capacity=10)
    for key in range(1000):
        cache.access(key)
    assert isinstance(cache.policy, PrefixPolicy)
    assert len(cache.policy) == 10 and cache.policy.num_ghosts <= 10


def test_prefix_learns_that_long_batches_are_not_read_again() -> None:
    """Chunks of long one-off batches that left unread lower the credit of the next long
    batch below that of a short batch, whose chunks were read again."""
    policy = make_policy("prefix")
    assert isinstance(policy, PrefixPolicy)
    long_sig = policy.predictor.signature(40, 64)
    short_sig = policy.predictor.signature(1, 2)
    before = policy.predictor.rate(long_sig)
    for round_ in range(20):
        short = [f"s{round_}-0", f"s{round_}-1"]
        policy.insert_batch(short)
        policy.touch(short)  # a chat's next turn re-reads it
        policy.insert_batch([f"d{round_}-{i}" for i in range(64)])
        victims = policy.evict(64, unit, lambda k: str(k).startswith("d"))
        assert victims is not None and len(victims) == 64
    assert policy.predictor.rate(long_sig) < before / 2
    assert policy.predictor.rate(long_sig) < policy.predictor.rate(short_sig) / 2
    policy.insert_batch(["S0", "S1"])
    policy.insert_batch([f"D{i}" for i in range(64)])
    order = list(policy)
    # even the document's head (prior credit 1.0, above S1's 0.98) now leaves before S1
    assert order.index("D0") < order.index("S1")


def test_prefix_shared_prefix_by_uses_private_chain_by_recency() -> None:
    """A prefix that two chains branch from is valued by its uses; a chain read many times on
    its own (one conversation) gains nothing from its count and ages in LRU order, so a
    conversation that was just extended outlives an old one that was read often."""
    policy = make_policy("prefix")
    assert isinstance(policy, PrefixPolicy)
    policy.insert_batch(["sys", "a0", "a1"])
    for _ in range(6):
        policy.touch(["sys", "a0", "a1"])  # conversation a, read six times
    policy.insert_batch(["b0"])  # conversation b's first turn after the shared prompt ...
    policy.touch(["sys", "b0"])  # ... read once: "sys" has two children now
    assert policy.is_shared("sys")
    assert not policy.is_shared("a0") and not policy.is_shared("b0")
    order = list(policy)
    assert order.index("a1") < order.index("a0") < order.index("b0") < order.index("sys")


# ---------------------------------------------------------------------------- chain specifics


def serve(policy: EvictionPolicy, keys: list[str], capacity: int) -> int:
    """One request the way the engine serves it: a planning lookup with the whole chain, then
    the missing keys stored as one batch after evicting what the cache lacks (never the
    request's own keys). Returns the hits (the leading run of tracked keys)."""
    hits = 0
    while hits < len(keys) and keys[hits] in policy:
        hits += 1
    policy.lookup(keys, hits)
    missing = [key for key in keys[hits:] if key not in policy]
    need = len(policy) + len(missing) - capacity
    if need > 0:
        own = set(keys)
        assert policy.evict(need, unit, lambda k: k not in own) is not None
    policy.insert_batch(missing)
    return hits


def turn(conversation: str, number: int) -> list[str]:
    """A conversation's request at turn ``number``: a shared prompt, then 4 chunks a turn."""
    return ["sys"] + [f"{conversation}-{i}" for i in range(4 * number)]


def test_chain_learns_that_second_turns_end_and_keeps_the_conversation_that_returns() -> None:
    """Every conversation has two turns of the same size. Once that is learnt, a first turn
    outlives the second turns stored after it (they will not be read again): ``chain`` serves
    the conversation's return from the cache, where recency (LRU, ARC) and the batch shape
    (``prefix``: every batch looks alike) have evicted it."""
    hits = {}
    for name in ALL:
        policy, capacity = make_policy(name), 24
        for i in range(40):
            serve(policy, turn(f"c{i}", 1), capacity)
            if i:
                serve(policy, turn(f"c{i - 1}", 2), capacity)
        serve(policy, turn("A", 1), capacity)
        for i in range(3):  # three whole conversations after A's first turn
            serve(policy, turn(f"x{i}", 1), capacity)
            serve(policy, turn(f"x{i}", 2), capacity)
        hits[name] = serve(policy, turn("A", 2), capacity)
    assert hits == {"arc": 1, "chain": 5, "lru": 1, "prefix": 1}  # "sys" alone, or all of A


def test_chain_follows_a_conversation_through_lookups_and_evictions() -> None:
    """A lookup continues the chain whose tail is among its keys, the keys it missed join that
    chain when stored, a key two chains read is shared, and a conversation whose chunks were
    all evicted is still recognised when it returns."""
    policy = make_policy("chain")
    assert isinstance(policy, ChainPolicy)
    serve(policy, turn("a", 1), 100)
    assert policy.turns("a-3") == 1 and policy.turns("sys") == 1
    serve(policy, turn("a", 2), 100)
    assert policy.turns("a-0") == policy.turns("a-7") == 2
    serve(policy, turn("b", 1), 100)
    assert policy.is_shared("sys") and policy.turns("sys") is None
    assert policy.turns("b-0") == 1 and not policy.is_shared("a-0")
    gone = policy.evict(12, unit, lambda k: k != "sys")
    assert gone is not None and "a-0" not in policy and "b-0" not in policy
    assert serve(policy, turn("a", 3), 100) == 1  # only "sys" was left ...
    assert policy.turns("a-11") == 3  # ... yet its third turn continues the chain
    policy.lookup(turn("a", 3), 13)  # the same request looked up again: no fourth turn
    assert serve(policy, turn("a", 3), 100) == 13 and policy.turns("a-11") == 3


def serve_admitting(policy: EvictionPolicy, keys: list[str], capacity: int) -> bool:
    """:func:`serve`, with the missing keys shown to ``evict`` (``incoming``) as the engine
    shows them to a policy that ``admits``. Returns whether they were stored."""
    hits = 0
    while hits < len(keys) and keys[hits] in policy:
        hits += 1
    policy.lookup(keys, hits)
    missing = [key for key in keys[hits:] if key not in policy]
    need = len(policy) + len(missing) - capacity
    if need > 0:
        own = set(keys)
        if policy.evict(need, unit, lambda k: k not in own, missing) is None:
            return False
    policy.insert_batch(missing)
    return True


def test_chain_declines_one_off_documents_and_keeps_the_conversations() -> None:
    """Four conversations that keep returning, and documents (the shared prompt, then 40
    chunks nobody reads again) between their turns: once ``chain`` has seen documents leave
    unread, a document's store that would displace the conversations is declined (``evict``
    told its keys returns None and changes nothing), the same eviction not told what it is
    for goes ahead, and the conversations' next turns are stored."""
    policy, capacity = make_policy("chain"), 64
    assert policy.admits and not make_policy("prefix").admits

    def conversation(c: int, length: int) -> list[str]:
        return ["sys"] + [f"c{c}-{j}" for j in range(length)]

    for r in range(6):
        for c in range(4):
            assert serve_admitting(policy, conversation(c, 2 * (r + 1)), capacity)
            if c % 2:
                serve_admitting(policy, ["sys"] + [f"d{r}{c}-{j}" for j in range(40)], capacity)
    assert isinstance(policy, ChainPolicy) and policy.return_chance((1, 6)) < 0.05
    for key in [key for key in policy if str(key).startswith("d")]:
        policy.remove(key)  # the last document's leftovers (as if rolled back)
    doc = ["sys"] + [f"late-{j}" for j in range(40)]
    policy.lookup(doc, 1)
    need = len(policy) + 40 - 48  # a smaller cache: the document must displace 16 keys
    assert need > 0
    before = snapshot(policy)
    assert policy.evict(need, unit, lambda k: k != "sys", doc[1:]) is None
    assert policy.declined and snapshot(policy) == before
    assert policy.evict(need, unit, lambda k: k != "sys") is not None
    assert not policy.declined
    assert all(serve_admitting(policy, conversation(c, 14), capacity) for c in range(4))
    fresh = make_policy("chain")  # nothing learnt: at even odds the newest keys rank first
    assert serve_admitting(fresh, conversation(0, 8), 64)
    assert serve_admitting(fresh, doc, 48) and "c0-0" in fresh and "c0-7" not in fresh


def test_chain_touch_and_plain_inserts_order_like_lru() -> None:
    """Without lookups (the SSD tier, plain inserts) every key of one batch size is in one
    state, so the order is LRU's; a load (``touch``) of a chain no lookup followed is its
    return: the state's return chance rises above the prior's even odds."""
    policy = filled("chain", range(6))
    assert isinstance(policy, ChainPolicy)
    assert policy.return_chance((1, 1)) == pytest.approx(0.5)
    policy.touch([4, 1])
    assert list(policy) == [0, 2, 3, 5, 1, 4]
    assert policy.return_chance((1, 1)) > 0.5


def put_get(policy: EvictionPolicy, keys: list[str], capacity: int) -> bool:
    """A plain client's put (no lookup: ``evict`` told the new keys, as the engine tells an
    admitting policy). Returns whether they were stored."""
    need = len(policy) + len(keys) - capacity
    if need > 0 and policy.evict(need, unit, lambda k: True, keys) is None:
        return False
    policy.insert_batch(keys)
    return True


def test_chain_counts_a_plain_clients_load_as_a_return_and_admits_its_puts() -> None:
    """A client that never looks anything up (put/get, gRPC): each put is a chain of its own
    and a get of it (``touch``) is its return, so puts that are read back learn high odds,
    not the zero of a chain only ever evicted; ``chain`` then declines none of the puts, as
    many as LRU stores (before: its puts' states learnt p near 0 from evictions alone and
    about half of them were declined)."""
    policy, capacity = make_policy("chain"), 48
    assert isinstance(policy, ChainPolicy)
    puts: list[list[str]] = []
    for i in range(300):
        keys = [f"p{i}-{j}" for j in range(1 + i % 7)]
        assert put_get(policy, keys, capacity), i
        puts.append(keys)
        if i >= 2:  # a get of a recent put: its resident keys are loaded
            policy.touch([key for key in puts[i - 2] if key in policy])
    assert policy.return_chance((1, 3)) > 0.5
    assert not policy.declined


def test_chain_declines_a_plain_clients_put_only_on_evidence() -> None:
    """Admission needs ``MIN_OUTCOMES`` outcomes of the incoming state's own (and a margin of
    ``MARGIN`` log-odds): a client's puts that are read back, and 200-chunk documents that are
    never read. The first document evicted unread is one outcome: the second document is
    stored (before: declined on that one outcome); once two were seen to leave unread the
    next one is declined, and nothing changes."""
    policy, capacity = make_policy("chain"), 300
    assert isinstance(policy, ChainPolicy)
    stored = []
    for i in range(400):  # 20 puts of 8 chunks read in turn (a get; a put again if missed)
        keys = [f"s{i % 20}-{j}" for j in range(8)]
        policy.touch([key for key in keys if key in policy])
        assert put_get(policy, [key for key in keys if key not in policy], capacity)
        if i % 60 == 59:
            for key in [key for key in policy if str(key).startswith("d")]:
                policy.remove(key)  # a document's leftovers (as if dropped): what the next
                # one would displace is the puts read in turn
            stored.append(put_get(policy, [f"d{i}-{j}" for j in range(200)], capacity))
    assert stored == [True, True, False, False, False, False]
    for key in [key for key in policy if str(key).startswith("d")]:
        policy.remove(key)
    need = len(policy) + 200 - capacity
    before = snapshot(policy)
    assert need > 0
    assert policy.evict(need, unit, lambda k: True, [f"late-{j}" for j in range(200)]) is None
    assert policy.declined and snapshot(policy) == before


def test_chain_shared_keys_age_less_once_prompts_are_what_misses() -> None:
    """``kappa`` (how much a shared key's age counts) falls with each missed chunk that was a
    shared key evicted earlier, rises with each that was the returning conversation's own,
    and stays in [0, 1]; at 0 a shared prompt no longer falls behind a conversation's keys as
    time passes (it is ranked by its read rate), while at 1 it ages as they do."""
    prompt = [f"p{j}" for j in range(40)]
    policy = make_policy("chain")
    assert isinstance(policy, ChainPolicy) and policy.shared_aging == 1.0
    serve(policy, [f"f{j}" for j in range(60)], 200)  # room for the prompt's 40 ghosts
    for cycle in range(10):
        serve(policy, [*prompt, f"a{cycle}"], 200)
        serve(policy, [*prompt, f"b{cycle}"], 200)  # a second chain reads it: shared
        assert all(policy.is_shared(key) for key in prompt)
        if cycle == 0:  # before any miss, one conversation goes and comes back
            serve(policy, ["q0", "q1", "q2"], 200)
            assert policy.evict(3, unit, lambda k: str(k).startswith("q")) is not None
            serve(policy, ["q0", "q1", "q2", "q3"], 200)  # its own ghosts: kappa stays at 1
            assert policy.shared_aging == 1.0
        assert policy.evict(40, unit, lambda k: str(k).startswith("p")) is not None
        before = policy.shared_aging
        serve(policy, [*prompt, f"c{cycle}"], 200)  # 40 chunks missed that were shared
        assert policy.shared_aging == pytest.approx(max(before - 40 * KAPPA_STEP, 0.0))
    assert policy.shared_aging == 0.0

    def prompt_outranks_fresh_keys(chain: ChainPolicy) -> bool:
        """After 10,000 ticks without a read of the prompt, whether it would leave after a
        conversation's first turn stored now."""
        for _ in range(10_000):
            chain.touch(["nothing"])
        serve(chain, [f"z{j}" for j in range(8)], 200)
        order = list(chain)
        return order.index("p0") > order.index("z0")

    aging = make_policy("chain")  # kappa 1: the prompt read as often, no misses
    assert isinstance(aging, ChainPolicy)
    serve(aging, [f"f{j}" for j in range(60)], 200)
    for cycle in range(10):
        serve(aging, [*prompt, f"a{cycle}"], 200)
        serve(aging, [*prompt, f"b{cycle}"], 200)
    assert aging.shared_aging == 1.0 and not prompt_outranks_fresh_keys(aging)
    assert prompt_outranks_fresh_keys(policy)  # kappa 0: ranked by its read rate alone
    # a conversation's own ghosts raise kappa again
    serve(policy, ["w0", "w1", "w2", "w3"], 200)
    assert policy.evict(4, unit, lambda k: str(k).startswith("w")) is not None
    serve(policy, ["w0", "w1", "w2", "w3", "w4"], 200)
    assert policy.shared_aging == pytest.approx(4 * KAPPA_STEP)


def test_chain_keeps_a_long_idle_conversation_when_its_users_answer_late() -> None:
    """Conversations of two turns whose users mostly answer at once and one in five after
    3,000 ticks, and documents nobody reads again: a conversation idle for 2,000 ticks (many
    mean gaps) outranks a document stored after it, since one in five came back after
    longer; the memoryless rule (odds falling as ``exp(-age / mean gap)``) ranked it below."""
    policy, capacity = make_policy("chain"), 1000
    assert isinstance(policy, ChainPolicy)

    def idle(ticks: int) -> None:
        for _ in range(ticks):
            policy.touch(["nothing"])

    for i in range(40):
        serve(policy, [f"c{i}-{j}" for j in range(4)], capacity)
        idle(3000 if i % 5 == 0 else 10)
        serve(policy, [f"c{i}-{j}" for j in range(8)], capacity)
        assert policy.evict(8, unit, lambda k, i=i: str(k).startswith(f"c{i}-")) is not None
    for d in range(12):
        serve(policy, [f"d{d}-{j}" for j in range(40)], capacity)
        assert policy.evict(40, unit, lambda k: str(k).startswith("d")) is not None
    serve(policy, [f"A-{j}" for j in range(4)], capacity)
    idle(2000)
    serve(policy, [f"D-{j}" for j in range(40)], capacity)
    order = list(policy)
    assert max(order.index(f"D-{j}") for j in range(40)) < order.index("A-3")
    conversation, document = (
        math.log(p / (1 - p)) for p in (policy.return_chance((1, 3)), policy.return_chance((1, 6)))
    )
    assert conversation - 2001 / policy.mean_gap < document  # the memoryless rule's order
    assert policy.log_survival(2001) > math.log(0.05)
