"""Which GPU blocks each request holds: prefix-cache lookup, slot allocation, freeing.

Runs in the scheduler process; the scheduler is its only caller. Not thread-safe.

A request's blocks are append-only: new blocks are added at the end, existing entries never move
(workers keep block tables). Slot layout of one :meth:`KVCacheManager.allocate_slots` call
(as vLLM V1's ``allocate_slots()``)::

    | computed | new local hits | external (kvserver) | new tokens |
    |<- already held ->|                              |<- computed this step ->|
                       |<-------------- to be allocated now ------------------>|

Check, then act: :meth:`allocate_slots` first works out how many blocks it needs — counting
prefix-hit blocks that sit in the free queue, since taking them shrinks it — and returns
``None`` with nothing changed when the pool cannot supply them (the scheduler then preempts or
stops admitting). Only then does it touch hits, take fresh blocks and publish hashes.

Caching: full blocks whose KV is computed by the end of the scheduled step are published in
the pool's hash map right away (so a request admitted in a later step hits them), except for
asynchronous loads, which are published only once the load has landed (:meth:`cache_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserver.errors import InvalidState
from scheduler.block_pool import BlockPool, KVCacheBlock
from scheduler.request import Request


class KVCacheManager:
    """Per-request block lists over one :class:`BlockPool`."""

    def __init__(
        self, pool: BlockPool, block_size: int, max_model_len: int, *, enable_caching: bool = True
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching and pool.enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        #: per request: how many leading blocks are already published in the hash map
        self.num_cached_blocks: dict[str, int] = {}

    # ------------------------------------------------------------------ queries

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks from block 0, and the tokens they cover.

        At most ``num_tokens - 1`` tokens hit, so at least one token is computed and the step
        produces logits. Read-only: the hits are referenced only by :meth:`allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.pool.cached.get
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break  # chained hashes: a miss here means a miss for every later block
            hits.append(block)
        return hits, len(hits) * self.block_size

    def num_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_external_computed_tokens: int = 0,
    ) -> int:
        """Free-queue blocks :meth:`allocate_slots` would consume (fresh + hits now free)."""
        held = self.req_to_blocks.get(request.request_id)
        num_held = len(held) if held else 0
        total_tokens = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_external_computed_tokens
            + num_new_tokens
        )
        total_tokens = min(total_tokens, self.max_model_len)
        num_required = -(-total_tokens // self.block_size)
        fresh = max(0, num_required - num_held - len(new_computed_blocks))
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return fresh + evictable_hits

    # ------------------------------------------------------------------ mutation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Blocks for ``num_new_tokens`` more tokens after the computed, hit and external
        ones; returns the newly allocated blocks, or ``None`` (nothing changed) when the pool is
        short. ``new_computed_blocks`` are prefix hits from :meth:`get_computed_blocks`; only a
        request that holds no blocks yet may pass them.
        """
        need = self.num_blocks_needed(
            request, num_new_tokens, new_computed_blocks, num_external_computed_tokens
        )
        if need > self.pool.num_free_blocks:
            return None
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = 0
        if new_computed_blocks:
            if blocks:
                raise InvalidState(
                    "prefix hits for a request that already holds blocks", req=req_id
                )
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # hits are published by definition
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
        total_tokens = min(
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_external_computed_tokens
            + num_new_tokens,
            self.max_model_len,
        )
        num_fresh = -(-total_tokens // self.block_size) - len(blocks)
        new_blocks = self.pool.get_new_blocks(num_fresh) if num_fresh > 0 else []
        blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(total_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks covering its first ``num_tokens`` tokens."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        start = self.num_cached_blocks[req_id]
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if end > start:
            self.pool.cache_blocks(blocks, request.block_hashes, start, end)
            self.num_cached_blocks[req_id] = end

    def uncache_from(self, request: Request, first_block: int) -> None:
        """Withdraw the request's blocks from index ``first_block`` on from the hash map
        (their KV is invalid: a failed load). REQUIRES: those blocks are not shared."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id, [])
        self.pool.uncache(blocks[first_block:])
        if req_id in self.num_cached_blocks:
            self.num_cached_blocks[req_id] = min(self.num_cached_blocks[req_id], first_block)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a worker lost its KV)."""
        self.pool.reset_prefix_cache()
        for req_id in self.num_cached_blocks:
            self.num_cached_blocks[req_id] = 0
