"""KVCacheBlock / FreeBlockQueue / BlockPool: O(1) queue surgery, the null block, reference
counts, prefix-cache publication and LRU eviction of cached free blocks."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserver.errors import InvalidArgument, InvalidState
from kvserver.hashing import BlockHash
from scheduler.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: Iterable[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "big") * 8)


# ------------------------------------------------------------------------------ free queue


def test_queue_keeps_order_and_supports_middle_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3] and len(q) == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.append(blocks[2])
    assert ids(q) == [1, 3, 2]
    assert q.popleft().block_id == 1
    assert ids(q) == [3, 2]


def test_popleft_n_takes_the_head_in_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert ids(q.popleft_n(0)) == []
    assert ids(q.popleft_n(4)) == [0, 1, 2, 3]
    assert ids(q) == [4, 5] and len(q) == 2
    q.append_n(blocks[:2])
    assert ids(q) == [4, 5, 0, 1]
    assert ids(q.popleft_n(4)) == [4, 5, 0, 1]
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(InvalidState):
        q.popleft()
    with pytest.raises(InvalidState):
        q.popleft_n(1)


def test_removing_a_block_not_in_the_queue_is_an_error() -> None:
    block = KVCacheBlock(7)
    q = FreeBlockQueue([])
    with pytest.raises(InvalidState):
        q.remove(block)


# ------------------------------------------------------------------------------ pool


def test_null_block_is_reserved() -> None:
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 3
    assert 0 not in ids(pool.get_new_blocks(3))
    pool.free_blocks([pool.null_block])  # freeing the null block is a no-op
    pool.check_invariants()
    with pytest.raises(InvalidArgument):
        BlockPool(1)


def test_allocation_sets_ref_counts_and_free_returns_them_in_order() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1] and pool.num_free_blocks == 2
    pool.free_blocks(reversed(a))  # a request frees tail first
    assert ids(pool.free_queue) == [4, 5, 3, 2, 1]
    pool.check_invariants()


def test_shared_block_survives_one_free() -> None:
    """Two requests share a prefix-hit block: the first free leaves it allocated."""
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_blocks([block], [h(1)], 0, 1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in ids(pool.free_queue)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.block_id in ids(pool.free_queue)
    with pytest.raises(InvalidState):
        pool.free_blocks([block])


def test_touch_takes_a_cached_free_block_out_of_the_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.cache_blocks(blocks, [h(i) for i in range(4)], 0, 4)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    hit = pool.get_cached_block(h(2))
    assert hit is blocks[2]
    pool.touch([hit])
    assert ids(pool.free_queue) == [1, 2, 4] and hit.ref_cnt == 1
    pool.check_invariants()


def test_lru_eviction_of_cached_free_blocks() -> None:
    """The least recently freed cached block is reclaimed first; its hash leaves the map."""
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    pool.cache_blocks(a, [h(10), h(11)], 0, 2)
    pool.cache_blocks(b, [h(20), h(21)], 0, 2)
    pool.free_blocks(reversed(a))  # a freed first: its tail (h11) is the LRU block
    pool.free_blocks(reversed(b))
    (fresh,) = pool.get_new_blocks(1)
    assert fresh is a[1] and fresh.block_hash is None and fresh.ref_cnt == 1
    assert pool.get_cached_block(h(11)) is None and pool.num_evicted == 1
    assert pool.get_cached_block(h(10)) is a[0]
    assert pool.get_cached_block(h(20)) is b[0]
    pool.check_invariants()


def test_first_block_with_a_hash_wins() -> None:
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    pool.cache_blocks([x], [h(1)], 0, 1)
    pool.cache_blocks([y], [h(1)], 0, 1)
    assert pool.get_cached_block(h(1)) is x and y.block_hash is None
    pool.check_invariants()


def test_uncache_and_reset() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks(blocks, [h(i) for i in range(3)], 0, 3)
    assert pool.uncache(blocks[1:]) == 2
    assert pool.num_cached_blocks == 1
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in blocks)
    pool.check_invariants()


def test_caching_disabled_publishes_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_blocks(blocks, [h(1), h(2)], 0, 2)
    assert pool.num_cached_blocks == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aftc"), st.integers(0, 7)), max_size=60))
def test_random_operations_keep_the_invariants(ops: list[tuple[str, int]]) -> None:
    """allocate / free / touch-a-hit / cache in any order: the invariants always hold."""
    pool = BlockPool(9)
    held: list[list[KVCacheBlock]] = []
    next_hash = 0
    for op, n in ops:
        if op == "a" and n <= pool.num_free_blocks:
            held.append(pool.get_new_blocks(n))
        elif op == "f" and held:
            pool.free_blocks(reversed(held.pop(n % len(held))))
        elif op == "t" and pool.cached:
            block = list(pool.cached.values())[n % len(pool.cached)]
            pool.touch([block])
            held.append([block])
        elif op == "c" and held:
            blocks = held[n % len(held)]
            hashes = [h(next_hash + i) for i in range(len(blocks))]
            next_hash += len(blocks)
            pool.cache_blocks(blocks, hashes, 0, len(blocks))
        pool.check_invariants()
    for blocks in held:
        pool.free_blocks(blocks)
    pool.check_invariants()
    assert pool.num_free_blocks == 8
