"""KVCacheManager: prefix-cache lookup, the allocate_slots layout (computed | hits | external |
new), check-then-act on a short pool, delayed caching for async loads, freeing tail first."""

from __future__ import annotations

from kvserver.hashing import BlockHasher
from scheduler.block_pool import BlockPool
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request

BS = 4
HASHER = BlockHasher("sha256_cbor", BS)


def manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    pool = BlockPool(num_blocks, enable_caching=caching)
    return KVCacheManager(pool, BS, max_model_len=(num_blocks - 1) * BS, enable_caching=caching)


def req(req_id: str, n: int, start: int = 0, **kw: object) -> Request:
    return Request(req_id, list(range(start, start + n)), max_tokens=8, hasher=HASHER, **kw)  # type: ignore[arg-type]


def test_block_hashes_come_from_the_kvserver_hasher() -> None:
    r = req("a", 10)
    assert r.block_hashes == HASHER.hash_blocks(list(range(10)))
    for t in (10, 11):
        r.append_output_token(t)
    assert r.block_hashes == HASHER.hash_blocks(list(range(12)))
    salted = req("b", 8, cache_salt="tenant")
    assert salted.block_hashes == HASHER.hash_blocks(list(range(8)), cache_salt="tenant")
    assert salted.block_hashes[0] != r.block_hashes[0]


def test_allocate_and_cache_full_blocks() -> None:
    kv = manager()
    a = req("a", 10)
    new = kv.allocate_slots(a, 10)
    assert new is not None and len(new) == 3
    assert kv.get_block_ids("a") == [1, 2, 3]
    # two full blocks are published, the partial third is not
    assert kv.pool.num_cached_blocks == 2
    assert kv.num_cached_blocks["a"] == 2
    kv.pool.check_invariants()


def test_prefix_hit_is_capped_below_the_prompt_length() -> None:
    """A fully cached prompt still computes its last token (the step needs logits)."""
    kv = manager()
    a = req("a", 12)
    kv.allocate_slots(a, 12)
    b = req("b", 12)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in hits] == [1, 2]
    c = req("c", 13)
    hits, n = kv.get_computed_blocks(c)
    assert n == 12
    d = req("d", 12, start=1)  # different first block: the chain misses from block 0
    assert kv.get_computed_blocks(d) == ([], 0)


def test_hits_are_shared_and_counted_when_free() -> None:
    kv = manager(num_blocks=6)  # 5 usable
    a = req("a", 12)
    kv.allocate_slots(a, 12)
    kv.free(a)
    assert kv.num_free_blocks == 5 and kv.pool.num_cached_blocks == 3
    b = req("b", 16)
    hits, n = kv.get_computed_blocks(b)
    assert n == 12
    # 3 free hits + 1 fresh block = 4 taken from the free queue
    assert kv.num_blocks_needed(b, 4, hits) == 4
    new = kv.allocate_slots(b, 4, new_computed_blocks=hits)
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("b")[:3] == [h.block_id for h in hits]
    assert kv.num_free_blocks == 1
    kv.pool.check_invariants()


def test_short_pool_returns_none_and_changes_nothing() -> None:
    kv = manager(num_blocks=4)  # 3 usable
    kv.max_model_len = 64
    a = req("a", 8)
    kv.allocate_slots(a, 8)
    kv.free(a)
    b = req("b", 20)
    hits, _ = kv.get_computed_blocks(b)
    free_before = [x.block_id for x in kv.pool.free_queue]
    assert kv.allocate_slots(b, 12, new_computed_blocks=hits) is None
    assert [x.block_id for x in kv.pool.free_queue] == free_before
    assert not kv.has_blocks("b") and all(x.ref_cnt == 0 for x in hits)
    kv.pool.check_invariants()


def test_external_tokens_get_blocks_and_delayed_caching() -> None:
    """| hits (8) | external (8) | new (0) |: blocks for all 16, nothing new published."""
    kv = manager()
    a = req("a", 8)
    kv.allocate_slots(a, 8)
    kv.free(a)
    b = req("b", 20)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    new = kv.allocate_slots(
        b, 0, new_computed_blocks=hits, num_external_computed_tokens=8, delay_cache_blocks=True
    )
    assert new is not None and len(new) == 2 and len(kv.get_block_ids("b")) == 4
    assert kv.pool.num_cached_blocks == 2  # only a's
    kv.cache_blocks(b, 16)  # the load landed
    assert kv.pool.num_cached_blocks == 4
    kv.uncache_from(b, 3)
    assert kv.pool.num_cached_blocks == 3 and kv.num_cached_blocks["b"] == 3
    kv.pool.check_invariants()


def test_decode_allocates_a_block_only_at_a_boundary() -> None:
    kv = manager()
    a = req("a", 8)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    a.append_output_token(1)
    new = kv.allocate_slots(a, 1)
    assert new is not None and len(new) == 1
    a.num_computed_tokens = 9
    a.append_output_token(2)
    assert kv.allocate_slots(a, 1) == []


def test_free_releases_tail_first() -> None:
    kv = manager(num_blocks=5)
    a = req("a", 16)
    kv.allocate_slots(a, 16)
    kv.free(a)
    assert [x.block_id for x in kv.pool.free_queue] == [4, 3, 2, 1]
    assert not kv.has_blocks("a")


def test_caching_disabled() -> None:
    kv = manager(caching=False)
    a = req("a", 12)
    kv.allocate_slots(a, 12)
    assert kv.get_computed_blocks(req("b", 16)) == ([], 0)
    assert kv.pool.num_cached_blocks == 0
