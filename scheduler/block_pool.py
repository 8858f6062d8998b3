"""The GPU block pool: block metadata, the O(1) free queue, and the prefix-cache hash map.

Runs in the scheduler process (metadata only; the KV tensors live in the workers). Not
thread-safe: one owner, the :class:`~scheduler.kv_cache_manager.KVCacheManager`.

Invariants (checked by :meth:`BlockPool.check_invariants`, which the tests call after every
operation):

- block 0 is the null block: never allocated, never cached, never in the free queue;
- a block is in the free queue iff ``ref_cnt == 0`` (and it is not the null block);
- ``cached[h] is b`` iff ``b.block_hash == h``: a block carries a hash only while it is the
  map's entry for that hash (two blocks computing the same content: the first one wins, the
  second stays unhashed and is freed as a plain block);
- the free queue is in eviction order: its head is the least recently freed block. Cached
  blocks whose ``ref_cnt`` reached 0 stay in the map as eviction candidates until the queue
  hands them out again (LRU eviction); a prefix hit on one takes it out of the queue (touch).

vLLM V1's block pool is the reference; the free queue is a doubly linked
list threaded through the blocks themselves (two sentinels, no wrapper objects), because a hit
must remove a block from the middle of the queue in O(1), which ``deque`` cannot.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvserver.errors import InvalidArgument, InvalidState
from kvserver.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one GPU block; the free-queue links live here (no wrapper nodes)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; append / popleft / remove are O(1).

    Head = least recently freed (evicted first), tail = most recently freed.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """The least recently freed block. Raises InvalidState when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise InvalidState("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` least recently freed blocks, in order; one relink of the head.

        REQUIRES: ``0 <= n <= num_free_blocks``.
        """
        if n > self.num_free_blocks:
            raise InvalidState("not enough free blocks", want=n, free=self.num_free_blocks)
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue. REQUIRES: it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise InvalidState("block is not in the free queue", block=block.block_id)
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` in order."""
        last = self._tail.prev_free
        assert last is not None
        n = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            n += 1
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += n

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """``num_blocks`` blocks, the free queue and the hash → block map (see module docstring)."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if type(num_blocks) is not int or num_blocks < 2:
            raise InvalidArgument("a block pool needs at least 2 blocks", num_blocks=num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        #: counters (metrics, trace): cached blocks reclaimed for reuse, prefix-hit blocks
        self.num_evicted = 0
        self.num_hit_blocks = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now (free + evictable cached)."""
        return self.free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        usable = self.num_blocks - 1
        return (usable - self.num_free_blocks) / usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """``n`` blocks with ``ref_cnt == 1``, evicting the least recently freed cached ones.

        REQUIRES: ``n <= num_free_blocks`` (check first; InvalidState and nothing changed
        otherwise).
        """
        blocks = self.free_queue.popleft_n(n)
        cached = self.cached
        for block in blocks:
            h = block.block_hash
            if h is not None:
                del cached[h]
                block.block_hash = None
                self.num_evicted += 1
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the queue (O(1))."""
        remove = self.free_queue.remove
        n = 0
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                remove(block)
            block.ref_cnt += 1
            n += 1
        self.num_hit_blocks += n

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the queue in this order
        (pass a request's blocks tail first so its tail is evicted first)."""
        freed = []
        for block in ordered:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
            elif block.ref_cnt < 0:
                raise InvalidState("block freed more often than referenced", block=block.block_id)
        self.free_queue.append_n(freed)

    # ------------------------------------------------------------------ prefix cache

    def cache_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
    ) -> None:
        """Publish ``blocks[start:end]`` under ``block_hashes[start:end]`` (full blocks whose KV
        is, or is being, computed). A hash already mapped to another block keeps that block."""
        if not self.enable_caching:
            return
        cached = self.cached
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            h = block_hashes[i]
            if h not in cached:
                cached[h] = block
                block.block_hash = h

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Withdraw blocks from the map (their KV is not valid, e.g. a failed load); returns
        how many were withdrawn."""
        n = 0
        for block in blocks:
            h = block.block_hash
            if h is not None:
                del self.cached[h]
                block.block_hash = None
                n += 1
        return n

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (the GPU contents are no longer trusted). Blocks in use
        stay allocated; they just stop being prefix-cache hits."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    # ------------------------------------------------------------------ checking

    def check_invariants(self) -> None:
        """Recompute the invariants of the module docstring; AssertionError on a violation."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.free_queue.num_free_blocks
        ids = {b.block_id for b in in_queue}
        assert len(ids) == len(in_queue), "a block is queued twice"
        assert 0 not in ids and self.null_block.is_null and self.null_block.block_hash is None
        for block in self.blocks[1:]:
            assert (block.block_id in ids) == (block.ref_cnt == 0), block
            assert block.ref_cnt >= 0, block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        for h, block in self.cached.items():
            assert block.block_hash == h, block
