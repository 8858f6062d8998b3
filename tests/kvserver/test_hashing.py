"""kvserver/hashing.py: vLLM-compatible chained block hashes and chunk keys."""

from __future__ import annotations

import enum
import json
import random
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserver import hash_segments
from kvserver.errors import InvalidArgument
from kvserver.hash_segments import GROUP_BLOCKS, SegmentCache
from kvserver.hashing import (
    DEFAULT_SEED,
    HASH_ALGOS,
    BlockHash,
    BlockHasher,
    chunk_keys,
    digest_size,
    hash_function,
    none_hash,
)

#: facts about vLLM's block hashing, kept in the repository (tests/vectors/README.md)
VECTORS_FILE = Path(__file__).resolve().parents[1] / "vectors" / "block_hashes.json"


# ------------------------------------------------------------------------------ builders


def load_vectors() -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = json.loads(VECTORS_FILE.read_text())["vectors"]
    return vectors


VECTORS = load_vectors()


def vector_params() -> list[Any]:
    return [pytest.param(v, id=f"{v['algo']}-{v['name']}") for v in VECTORS]


def hash_vector(vector: dict[str, Any]) -> list[BlockHash]:
    hasher = BlockHasher(vector["algo"], vector["block_size"], vector["seed"])
    lora = tuple(vector["lora"]) if vector.get("lora") else None
    return hasher.hash_blocks(vector["tokens"], cache_salt=vector.get("cache_salt"), lora=lora)


def reference_hashes(
    algo: str,
    tokens: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_SEED,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[bytes]:
    """kvserver/hashing.py's scheme spelled out literally: one H call per full block."""
    h = hash_function(algo)
    parent = h(seed)
    out = []
    for i in range(len(tokens) // block_size):
        keys: list[tuple[str, ...]] = []
        if lora is not None:
            keys.append(("lora", *lora))
        if i == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = h((parent, block, tuple(keys) or None))
        out.append(parent)
    return out


def counting(n: int) -> list[int]:
    return list(range(n))


# Every width of canonical CBOR uint, on both sides of each boundary.
CBOR_EDGES = [0, 23, 24, 255, 256, 65535, 65536, 131071, 131072, 2**18 - 1]
token_ids = st.one_of(st.integers(0, 300), st.integers(0, 2**18 - 1), st.sampled_from(CBOR_EDGES))
algos = st.sampled_from(HASH_ALGOS)
salts = st.one_of(st.none(), st.text(max_size=8))
loras = st.one_of(st.none(), st.tuples(st.text(max_size=6), st.text(max_size=6)))


# ------------------------------------------------------------------------------- vectors


@pytest.mark.parametrize("vector", vector_params())
def test_reproduces_vector_bit_for_bit(vector: dict[str, Any]) -> None:
    hasher = BlockHasher(vector["algo"], vector["block_size"], vector["seed"])
    assert none_hash(vector["algo"], vector["seed"]).hex() == vector["none_hash"]
    assert hasher.none_hash.hex() == vector["none_hash"]
    assert [h.hex() for h in hash_vector(vector)] == vector["block_hashes"]


def test_vectors_cover_every_algorithm() -> None:
    assert len(VECTORS) >= 18
    assert {v["algo"] for v in VECTORS} == set(HASH_ALGOS)


@pytest.mark.parametrize("vector", vector_params())
def test_reference_scheme_matches_vector(vector: dict[str, Any]) -> None:
    """The literal oracle used by the property tests below is itself pinned by the vectors."""
    lora = tuple(vector["lora"]) if vector.get("lora") else None
    got = reference_hashes(
        vector["algo"],
        vector["tokens"],
        vector["block_size"],
        seed=vector["seed"],
        cache_salt=vector.get("cache_salt"),
        lora=lora,
    )
    assert [h.hex() for h in got] == vector["block_hashes"]


# ------------------------------------------------------------------------------ chaining


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_partial_tail_is_dropped(algo: str) -> None:
    hasher = BlockHasher(algo, 16)
    assert hasher.hash_blocks(counting(47)) == hasher.hash_blocks(counting(32))
    assert len(hasher.hash_blocks(counting(47))) == 2
    assert hasher.hash_blocks(counting(15)) == []
    assert hasher.hash_blocks([]) == []


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_digest_sizes(algo: str) -> None:
    hasher = BlockHasher(algo, 4)
    expected = {"sha256": 32, "sha256_cbor": 32, "xxhash_cbor": 16}[algo]
    assert digest_size(algo) == hasher.digest_size == expected
    assert {len(h) for h in hasher.hash_blocks(counting(12))} == {expected}
    assert len(hasher.none_hash) == expected


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_incremental_hashing_equals_one_shot(algo: str) -> None:
    hasher = BlockHasher(algo, 4)
    tokens = counting(50)
    extra: dict[str, Any] = {"cache_salt": "tenant-a", "lora": ("sql", "/adapters/sql")}
    one_shot = hasher.hash_blocks(tokens, **extra)
    first = hasher.hash_blocks(tokens[:8], **extra)
    second = hasher.hash_blocks(tokens[8:30], parent=first[-1], start_block=2, **extra)
    third = hasher.hash_blocks(tokens[28:], parent=second[-1], start_block=7, **extra)
    assert first + second + third == one_shot
    assert len(one_shot) == 12


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_cache_salt_only_applies_to_block_zero(algo: str) -> None:
    """A continuation (start_block > 0) ignores the salt: it is already in the parent chain."""
    hasher = BlockHasher(algo, 4)
    parent = hasher.hash_blocks(counting(4))[0]
    salted = hasher.hash_blocks(counting(8), parent=parent, start_block=1, cache_salt="s")
    plain = hasher.hash_blocks(counting(8), parent=parent, start_block=1)
    assert salted == plain


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_lora_applies_to_continued_blocks(algo: str) -> None:
    hasher = BlockHasher(algo, 4)
    parent = hasher.hash_blocks(counting(4))[0]
    with_lora = hasher.hash_blocks(counting(8), parent=parent, start_block=1, lora=("a", "/a"))
    plain = hasher.hash_blocks(counting(8), parent=parent, start_block=1)
    assert all(a != b for a, b in zip(with_lora, plain, strict=True))


@pytest.mark.parametrize(
    ("parent", "start_block"),
    [(b"\x00" * 32, 0), (None, 1), (b"\x00" * 31, 1), ("00" * 32, 1), (None, -1), (None, True)],
)
def test_inconsistent_parent_or_start_block_rejected(parent: Any, start_block: Any) -> None:
    hasher = BlockHasher("sha256", 4)
    with pytest.raises(InvalidArgument):
        hasher.hash_blocks(counting(8), parent=parent, start_block=start_block)


def test_same_strings_hash_the_same_whatever_the_objects() -> None:
    """Regression: pickle memoises by identity, so an interned salt equal to a tag ("lora") or
    a LoRA name that is the same object as its path must not change the "sha256" bytes."""
    hasher = BlockHasher("sha256", 4)
    fresh_lora = "".join(["lo", "ra"])
    fresh_x = "".join(["x", "y"])
    assert fresh_lora is not sys.intern("lora")
    interned = hasher.hash_blocks(counting(8), cache_salt="lora", lora=("xy", "xy"))
    fresh = hasher.hash_blocks(counting(8), cache_salt=fresh_lora, lora=(fresh_x, "xy"))
    assert interned == fresh


# ---------------------------------------------------------------------------- properties


@settings(deadline=None)
@given(
    algo=algos,
    block_size=st.integers(1, 9),
    tokens=st.lists(token_ids, max_size=60),
    cut=st.integers(0, 60),
    cache_salt=salts,
    lora=loras,
)
def test_prefix_closure(
    algo: str,
    block_size: int,
    tokens: list[int],
    cut: int,
    cache_salt: str | None,
    lora: tuple[str, str] | None,
) -> None:
    """The hashes of a prefix are a prefix of the hashes: what makes prefix lookup work."""
    hasher = BlockHasher(algo, block_size)
    full = hasher.hash_blocks(tokens, cache_salt=cache_salt, lora=lora)
    prefix = hasher.hash_blocks(tokens[:cut], cache_salt=cache_salt, lora=lora)
    assert prefix == full[: min(cut, len(tokens)) // block_size]


@settings(deadline=None)
@given(
    algo=algos,
    block_size=st.integers(1, 9),
    tokens=st.lists(token_ids, max_size=60),
    cache_salt=salts,
    lora=loras,
)
def test_matches_literal_scheme(
    algo: str,
    block_size: int,
    tokens: list[int],
    cache_salt: str | None,
    lora: tuple[str, str] | None,
) -> None:
    """The fast paths (CBOR payloads in bulk, the segment cache) equal H applied block by block."""
    hasher = BlockHasher(algo, block_size)
    got = hasher.hash_blocks(tokens, cache_salt=cache_salt, lora=lora)
    assert got == reference_hashes(algo, tokens, block_size, cache_salt=cache_salt, lora=lora)


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_every_integer_width_boundary(algo: str, block_size: int) -> None:
    """Each token on both sides of each CBOR width boundary, at each position in a block."""
    edges = sorted({max(0, t + d) for t in CBOR_EDGES for d in (-1, 0, 1)} - {2**18})
    tokens = [t for i in range(block_size) for t in [*edges[i:], *edges[:i]]]
    got = BlockHasher(algo, block_size).hash_blocks(tokens)
    assert got == reference_hashes(algo, tokens, block_size)
    assert len(got) == len(tokens) // block_size


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("big", [2**18, 2**32 - 1, 2**32, 2**64 - 1, 2**64, 2**70])
def test_tokens_beyond_32_bits_and_at_the_edges(algo: str, big: int) -> None:
    tokens = [1, big, 300, 70000, big, 5, 0, 2]
    assert BlockHasher(algo, 2).hash_blocks(tokens) == reference_hashes(algo, tokens, 2)


@settings(deadline=None)
@given(algo=algos, tokens=st.lists(token_ids, min_size=12, max_size=40), salt=st.text(min_size=1))
def test_cache_salt_changes_every_block(algo: str, tokens: list[int], salt: str) -> None:
    hasher = BlockHasher(algo, 4)
    plain = hasher.hash_blocks(tokens)
    salted = hasher.hash_blocks(tokens, cache_salt=salt)
    other = hasher.hash_blocks(tokens, cache_salt=salt + "!")
    assert all(a != b != c != a for a, b, c in zip(plain, salted, other, strict=True))


@settings(deadline=None)
@given(algo=algos, tokens=st.lists(token_ids, min_size=12, max_size=40))
def test_lora_changes_every_block(algo: str, tokens: list[int]) -> None:
    hasher = BlockHasher(algo, 4)
    plain = hasher.hash_blocks(tokens)
    lora_a = hasher.hash_blocks(tokens, lora=("a", "/p"))
    lora_b = hasher.hash_blocks(tokens, lora=("b", "/p"))
    assert all(x != y != z != x for x, y, z in zip(plain, lora_a, lora_b, strict=True))


def test_empty_cache_salt_is_no_salt() -> None:
    hasher = BlockHasher("sha256_cbor", 4)
    assert hasher.hash_blocks(counting(8), cache_salt="") == hasher.hash_blocks(counting(8))


def test_seed_changes_every_block() -> None:
    a = BlockHasher("sha256", 4, seed="1").hash_blocks(counting(12))
    b = BlockHasher("sha256", 4, seed="2").hash_blocks(counting(12))
    assert all(x != y for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------- chunk keys


def test_chunk_keys_pick_the_last_block_of_each_full_chunk() -> None:
    hashes = [BlockHash(bytes([i])) for i in range(7)]
    assert chunk_keys(hashes, 3) == [hashes[2], hashes[5]]
    assert chunk_keys(hashes, 1) == hashes
    assert chunk_keys(hashes, 8) == []
    assert BlockHasher("sha256", 4).chunk_keys(hashes, 7) == [hashes[6]]


@pytest.mark.parametrize("chunk_blocks", [0, -1, True, 2.0])
def test_chunk_keys_rejects_bad_chunk_size(chunk_blocks: Any) -> None:
    with pytest.raises(InvalidArgument, match="chunk_blocks"):
        chunk_keys([BlockHash(b"x")], chunk_blocks)


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call",
    [
        lambda: hash_function("md5"),
        lambda: digest_size("md5"),
        lambda: none_hash("md5"),
        lambda: BlockHasher("md5", 16),
    ],
    ids=["hash_function", "digest_size", "none_hash", "BlockHasher"],
)
def test_unknown_algo_names_the_valid_choices(call: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        call()
    assert all(algo in str(info.value) for algo in HASH_ALGOS)
    assert "md5" in str(info.value)


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("tokens", "index"),
    [
        ([1, True, 3], 1),
        ([1, 2, -1], 2),
        ([1.0], 0),
        (["1"], 0),
        ([None], 0),
        ([0, Color.RED], 1),
        ("1234", 0),
    ],
    ids=["bool", "negative", "float", "str", "none", "int-subclass", "string"],
)
def test_invalid_tokens_rejected_with_their_index(tokens: Any, index: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"index={index}\b"):
        BlockHasher("sha256", 1).hash_blocks(tokens)


def test_non_sequence_tokens_rejected() -> None:
    with pytest.raises(InvalidArgument, match="sequence"):
        BlockHasher("sha256", 1).hash_blocks(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": -4},
        {"block_size": True},
        {"block_size": "16"},
        {"block_size": 16, "seed": 0},
        {"block_size": 16, "seed": None},
    ],
)
def test_bad_hasher_config_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        BlockHasher("sha256", **kwargs)


@pytest.mark.parametrize(
    "extra",
    [{"lora": ("only-name",)}, {"lora": ("a", 1)}, {"cache_salt": 5}, {"cache_salt": b"s"}],
)
def test_bad_extra_keys_rejected(extra: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        BlockHasher("sha256", 4).hash_blocks(counting(8), **extra)


# ------------------------------------------------------------------- cached chain segments


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("extra", [{}, {"cache_salt": "s"}, {"lora": ("a", "/p")}])
def test_long_prompts_match_the_reference_cold_and_cached(algo: str, extra: Any) -> None:
    """Prompts spanning several cached segments (and a tail) hash as the literal scheme says,
    the first time and again from the cache, and an extended prompt reuses its prefix."""
    block_size = 4
    rng = random.Random(algo)
    tokens = [rng.choice(CBOR_EDGES) for _ in range(block_size * (2 * GROUP_BLOCKS + 5) + 3)]
    want = reference_hashes(algo, tokens, block_size, **extra)
    hasher = BlockHasher(algo, block_size)
    assert hasher.hash_blocks(tokens, **extra) == want
    assert len(hasher._cache) == 2
    assert hasher.hash_blocks(tokens, **extra) == want  # from the cache
    longer = tokens + [7] * (block_size * GROUP_BLOCKS)
    assert hasher.hash_blocks(longer, **extra) == reference_hashes(
        algo, longer, block_size, **extra
    )
    assert len(hasher._cache) == 3
    other = BlockHasher(algo, block_size, seed="other")
    assert other.hash_blocks(tokens, **extra) != want  # the parent is part of the key


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_cached_segments_do_not_cross_extra_keys_or_start_block(algo: str) -> None:
    """The same tokens under another salt, LoRA or parent never come from another's segment."""
    block_size = 2
    tokens = list(range(block_size * GROUP_BLOCKS))
    hasher = BlockHasher(algo, block_size)
    plain = hasher.hash_blocks(tokens)
    salted = hasher.hash_blocks(tokens, cache_salt="x")
    lora = hasher.hash_blocks(tokens, lora=("n", "p"))
    assert salted == reference_hashes(algo, tokens, block_size, cache_salt="x")
    assert lora == reference_hashes(algo, tokens, block_size, lora=("n", "p"))
    # the same tokens as blocks 32.. of a longer prompt: the parent differs
    continued = hasher.hash_blocks(tokens, parent=plain[-1], start_block=GROUP_BLOCKS)
    assert continued == hasher.hash_blocks(tokens + tokens)[GROUP_BLOCKS:]
    assert len({tuple(plain), tuple(salted), tuple(lora), tuple(continued)}) == 4


def test_segment_cache_is_bounded_lru() -> None:
    hasher = BlockHasher("xxhash_cbor", 1)
    object.__setattr__(hasher, "_cache", SegmentCache(2))
    prompts = [[p] * GROUP_BLOCKS for p in range(3)]
    results = [hasher.hash_blocks(p) for p in prompts]
    assert len(hasher._cache) == 2
    assert [hasher.hash_blocks(p) for p in prompts] == results
    assert len(hasher._cache) == 2


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
def test_segments_whose_ids_collide_in_the_cache_key_are_never_confused(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is keyed by a 64-bit digest of a segment's ids, and an entry keeps the ids:
    prompts whose segments all collide (a constant digest, which xxh3 cannot be made to give
    here) share one entry per parent, and each still gets its own hashes, bit for bit."""
    monkeypatch.setattr(hash_segments, "_segment_digest", lambda ids: 7)
    block_size = 2
    hasher = BlockHasher(algo, block_size)
    rng = random.Random(5)
    a = [rng.randrange(2**20) for _ in range(block_size * 3 * GROUP_BLOCKS)]
    b = a[: block_size * GROUP_BLOCKS] + [t + 1 for t in a[block_size * GROUP_BLOCKS :]]
    for tokens in (a, b, a, b[:-3], a + b):
        assert hasher.hash_blocks(tokens) == reference_hashes(algo, tokens, block_size)
    assert 0 < len(hasher._cache) < 8  # colliding segments replaced one another


def test_ids_beyond_32_bits_are_hashed_without_the_cache() -> None:
    tokens = [2**40] * GROUP_BLOCKS
    hasher = BlockHasher("sha256_cbor", 1)
    assert hasher.hash_blocks(tokens) == reference_hashes("sha256_cbor", tokens, 1)
    assert len(hasher._cache) == 0


@pytest.mark.parametrize("typecode", ["B", "H", "I", "L", "i", "q"])
def test_arrays_of_ids_hash_like_lists(typecode: str) -> None:
    """Front ends may pass decoded ids as an ``array``; unsigned ones skip the item checks."""
    tokens = [0, 1, 23, 24, 255] * 20
    hasher = BlockHasher("sha256_cbor", 4)
    assert hasher.hash_blocks(array(typecode, tokens)) == reference_hashes("sha256_cbor", tokens, 4)
    if typecode in "iq":
        with pytest.raises(InvalidArgument, match=">= 0"):
            hasher.hash_blocks(array(typecode, [*tokens, -1]))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64"])
def test_numpy_unsigned_arrays_hash_like_lists(dtype: str) -> None:
    """What the gRPC front end passes (protobuf's repeated uint32 field, decoded in bulk)."""
    np = pytest.importorskip("numpy")
    tokens = [0, 1, 23, 24, 255] * 20 + list(range(100))
    want = reference_hashes("sha256_cbor", tokens, 4)
    hasher = BlockHasher("sha256_cbor", 4)
    assert hasher.hash_blocks(np.array(tokens, dtype=dtype)) == want
    strided = np.array([t for pair in zip(tokens, tokens, strict=True) for t in pair], dtype)
    assert hasher.hash_blocks(strided[::2]) == want  # not contiguous
    with pytest.raises(InvalidArgument, match="plain ints"):
        hasher.hash_blocks(np.array(tokens, dtype="int64"))  # numpy integers, one by one
    with pytest.raises(InvalidArgument, match="plain ints"):
        hasher.hash_blocks(np.array([tokens[:4], tokens[4:8]], dtype=dtype))  # 2-D
