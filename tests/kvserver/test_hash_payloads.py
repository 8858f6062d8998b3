"""kvserver/hash_payloads.py: CBOR block payloads encoded in bulk equal cbor2's, byte for byte;
and through BlockHasher, every path (bulk, one H per block, the segment cache) equals the
literal scheme for ids of every width class."""

from __future__ import annotations

import os

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserver.hash_payloads import encode_blocks
from kvserver.hash_segments import GROUP_BLOCKS
from kvserver.hashing import BULK_MIN_BLOCKS, HASH_ALGOS, BlockHasher
from tests.kvserver.test_hashing import reference_hashes

# ids of every width class of canonical CBOR (and so of pickle's BININT1/BININT2/BININT/LONG1):
# 0..23, < 256, < 2**16, < 2**31, < 2**32, and the edges of each
EDGES = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
uint32_ids = st.one_of(
    st.integers(0, 23),
    st.integers(24, 255),
    st.integers(256, 65535),
    st.integers(65536, 2**32 - 1),
    st.sampled_from(EDGES),
)
# beyond 32 bits (no vocabulary, but the API takes any int >= 0): hashed one H per block
any_ids = st.one_of(uint32_ids, st.integers(2**32, 2**64 - 1), st.integers(2**64, 2**80))
names = st.text(max_size=12)  # unicode, empty, and equal strings (pickle memoises those)
lora = st.tuples(st.just("lora"), names, names)
extra_keys = st.one_of(
    st.none(),
    st.tuples(lora),
    st.tuples(st.tuples(st.just("cache_salt"), names)),
    st.tuples(lora, st.tuples(st.just("cache_salt"), names)),
)


def literal_payload(parent: bytes, ids: list[int], keys: object) -> bytes:
    return cbor2.dumps((parent, tuple(ids), keys), canonical=True)


@settings(deadline=None, max_examples=100)
@given(
    block_size=st.one_of(st.integers(1, 30), st.sampled_from([16, 64])),
    num_blocks=st.integers(1, 4),
    data=st.data(),
    digest_size=st.sampled_from([16, 32]),
    first_keys=extra_keys,
    rest_keys=extra_keys,
)
def test_payloads_equal_cbor2_for_every_width(
    block_size: int,
    num_blocks: int,
    data: st.DataObject,
    digest_size: int,
    first_keys: object,
    rest_keys: object,
) -> None:
    ids = data.draw(
        st.lists(uint32_ids, min_size=block_size * num_blocks, max_size=block_size * num_blocks)
    )
    payloads = encode_blocks(
        np.array(ids, dtype=np.uint32), block_size, digest_size, first_keys, rest_keys
    )
    assert len(payloads.starts) == len(payloads.ends) == num_blocks
    for b in range(num_blocks):
        parent = os.urandom(digest_size)
        keys = first_keys if b == 0 else rest_keys
        block = ids[b * block_size : (b + 1) * block_size]
        assert payloads.payload(b, parent) == literal_payload(parent, block, keys)


@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 24, 255, 256, 65536])
def test_array_heads_of_every_width(block_size: int) -> None:
    """The array head's own width (1, 2, 3 bytes) follows the block size."""
    ids = [t % 70000 for t in range(block_size * 2)]
    payloads = encode_blocks(np.array(ids, dtype=np.uint32), block_size, 32, None, None)
    parent = bytes(32)
    assert payloads.payload(1, parent) == literal_payload(parent, ids[block_size:], None)


@settings(deadline=None, max_examples=80)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    block_size=st.integers(1, 6),
    data=st.data(),
    cache_salt=st.one_of(st.none(), names),
    lora_pair=st.one_of(st.none(), st.tuples(names, names)),
    ids=st.sampled_from([uint32_ids, any_ids]),
)
def test_hasher_equals_the_literal_scheme_on_every_path(
    algo: str,
    block_size: int,
    data: st.DataObject,
    cache_salt: str | None,
    lora_pair: tuple[str, str] | None,
    ids: st.SearchStrategy[int],
) -> None:
    """Long enough for the bulk path and whole cached segments, with a partial tail; hashed
    cold, again (from the cache), and extended."""
    count = data.draw(st.integers(0, block_size * (GROUP_BLOCKS + BULK_MIN_BLOCKS) + 3))
    tokens = data.draw(st.lists(ids, min_size=count, max_size=count))
    hasher = BlockHasher(algo, block_size)
    extra = {"cache_salt": cache_salt, "lora": lora_pair}
    want = reference_hashes(algo, tokens, block_size, cache_salt=cache_salt, lora=lora_pair)
    assert hasher.hash_blocks(tokens, **extra) == want
    assert hasher.hash_blocks(tokens, **extra) == want
    if tokens and max(tokens) < 2**32:
        assert hasher.hash_blocks(np.array(tokens, dtype=np.uint32), **extra) == want
    longer = tokens + [7] * (block_size * BULK_MIN_BLOCKS)
    assert hasher.hash_blocks(longer, **extra) == reference_hashes(
        algo, longer, block_size, cache_salt=cache_salt, lora=lora_pair
    )


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_continuation_in_bulk_equals_one_shot(algo: str) -> None:
    """start_block > 0 with the parent given: the rest keys apply from the first block."""
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, 2**32, 16 * 80, dtype=np.uint64)]
    hasher = BlockHasher(algo, 16)
    lora_pair = ("adapter", "/p")
    whole = hasher.hash_blocks(tokens, cache_salt="s", lora=lora_pair)
    cut = 16 * 20
    rest = BlockHasher(algo, 16).hash_blocks(
        tokens[cut:], cache_salt="s", lora=lora_pair, parent=whole[19], start_block=20
    )
    assert rest == whole[20:]
