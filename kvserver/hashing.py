"""Chained block hashes as vLLM computes them, and the chunk keys derived from them.

Runs in every process that names KV blocks: the daemon (gRPC Lookup by token ids), the
scheduler-side connector and ``kvserver hash``. Pure computation: no I/O, no logging.
Thread safety: :class:`BlockHasher` is immutable (its results depend on its fields only) and may
be shared by threads. Shared state: each hasher's
:class:`~kvserver.hash_segments.SegmentCache` of already-hashed chain segments, behind a lock.

How. The chain is sequential (each block's payload holds its parent's digest), so one Python
loop computes one digest per block; what a block costs besides the digest is its payload. For
the CBOR algorithms a call of :data:`BULK_MIN_BLOCKS` blocks or more encodes every block's
payload at once with numpy (:mod:`kvserver.hash_payloads`) and the loop splices the parent in;
``sha256`` (pickle) and short calls call ``H`` once per block, the scheme as written.

Reuse of already-hashed prefixes: each hasher keeps a bounded LRU cache of chain segments of
:data:`GROUP_BLOCKS` full blocks (:mod:`kvserver.hash_segments`), a hit the value a
recomputation would give, bit for bit; only whole segments aligned to the call's first block
are cached, so the short incremental calls of a scheduler never touch it.

Scheme (vLLM V1's block hashing), with ``H`` one of :data:`HASH_ALGOS`::

    NONE_HASH = H(seed)
    block_hash[i] = H((parent, tuple(tokens of block i), extra_keys[i]))
        parent = NONE_HASH for block 0, else block_hash[i - 1]
        extra_keys[i] = (("lora", name, path),)        if LoRA, in every block
                      + (("cache_salt", salt),)        if a salt and i == 0
                      or None                          when empty

Only full blocks are hashed; a partial tail is dropped. A stored chunk spans ``chunk_blocks``
consecutive blocks and is keyed by the hash of its last block (:func:`chunk_keys`).

Compatibility contract:
- tests/vectors/block_hashes.json pins every algorithm bit for bit (tests/kvserver/test_hashing.py).
- vLLM derives NONE_HASH from ``PYTHONHASHSEED`` (random when unset). A vLLM replica agrees
  with kvserver only when it runs with ``PYTHONHASHSEED=<seed>`` and the same algorithm and
  block size.
- The extra-keys layout above is the one the project's vectors pin. Upstream vLLM (v1
  ``kv_cache_utils``) puts the bare ``lora_name`` and the bare ``cache_salt`` string into
  extra_keys instead, so requests with LoRA or a cache salt get different keys there.
- "sha256" hashes a pickle and pickle bytes depend on object identity (memoised objects): two
  equal strings that are the same object are written once. Strings in extra keys are interned
  here so that equal values always give equal bytes, whatever objects the caller passed.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NewType, cast

import cbor2
import numpy
import xxhash

from kvserver.errors import InvalidArgument
from kvserver.hash_payloads import Payloads, encode_blocks
from kvserver.hash_segments import CACHE_GROUPS, GROUP_BLOCKS, SegmentCache

BlockHash = NewType("BlockHash", bytes)
"""An opaque block (or chunk) key: the raw digest, 32 bytes for sha256*, 16 for xxhash_cbor."""

HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"

# Pinned, not pickle.HIGHEST_PROTOCOL: vLLM writes HIGHEST_PROTOCOL, which is 5 on Python
# 3.8-3.13. A future Python that raises it would silently change every "sha256" key; with the
# protocol pinned, the vectors test fails loudly instead (and we can decide to follow vLLM).
PICKLE_PROTOCOL = 5

#: fewest blocks the CBOR algorithms hash through the bulk encoder (``hash_payloads``); fewer
#: (a scheduler's next block) cost less with one H call each than the encoder's fixed ~20 us
BULK_MIN_BLOCKS = 16
#: bytes per token id in the packed form that keys the cache and feeds the bulk encoder
_PACKED_ID_SIZE = 4


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_cbor(obj: object) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_HASH_FUNCTIONS: dict[str, Callable[[object], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
    "xxhash_cbor": _xxhash_cbor,
}
_DIGEST_SIZES: dict[str, int] = {"sha256": 32, "sha256_cbor": 32, "xxhash_cbor": 16}


def hash_function(algo: str) -> Callable[[object], bytes]:
    """The function ``H(obj) -> digest`` named ``algo``; InvalidArgument names the choices."""
    try:
        return _HASH_FUNCTIONS[algo]
    except (KeyError, TypeError):
        raise InvalidArgument(
            f"unknown hash algorithm; valid choices: {', '.join(HASH_ALGOS)}", algo=algo
        ) from None


def digest_size(algo: str) -> int:
    """Length in bytes of every hash made with ``algo`` (32, 32, 16)."""
    hash_function(algo)
    return _DIGEST_SIZES[algo]


def none_hash(algo: str, seed: str = DEFAULT_SEED) -> BlockHash:
    """NONE_HASH = H(seed): the parent of block 0. vLLM takes ``seed`` from PYTHONHASHSEED."""
    fn = hash_function(algo)
    if not isinstance(seed, str):
        raise InvalidArgument("seed must be a str (vLLM uses PYTHONHASHSEED)", seed=seed)
    return BlockHash(fn(seed))


def chunk_keys(block_hashes: Sequence[BlockHash], chunk_blocks: int) -> list[BlockHash]:
    """Key of each full chunk of ``chunk_blocks`` blocks: the hash of its last block.

    REQUIRES: ``block_hashes`` starts at block 0 of the request (chunks are aligned to it).
    A partial last chunk gets no key.
    """
    if type(chunk_blocks) is not int or chunk_blocks < 1:
        raise InvalidArgument("chunk_blocks must be an int >= 1", chunk_blocks=chunk_blocks)
    if type(block_hashes) is list:  # a slice, in C
        return block_hashes[chunk_blocks - 1 :: chunk_blocks]
    return [block_hashes[i] for i in range(chunk_blocks - 1, len(block_hashes), chunk_blocks)]


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes token ids into chained block hashes for one (algo, block_size, seed).

    Immutable; NONE_HASH is computed once at construction. Construction raises
    InvalidArgument for an unknown algo, a block_size < 1 or a non-str seed.
    """

    algo: str
    block_size: int
    seed: str = DEFAULT_SEED
    _none_hash: BlockHash = field(init=False, repr=False, compare=False)
    _cache: SegmentCache[BlockHash] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size < 1:
            raise InvalidArgument("block_size must be an int >= 1", block_size=self.block_size)
        object.__setattr__(self, "_none_hash", none_hash(self.algo, self.seed))
        object.__setattr__(self, "_cache", SegmentCache(CACHE_GROUPS))

    @property
    def none_hash(self) -> BlockHash:
        """H(seed), the parent of block 0."""
        return self._none_hash

    @property
    def digest_size(self) -> int:
        return _DIGEST_SIZES[self.algo]

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        parent: BlockHash | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids``, in order (a partial tail is dropped).

        ``token_ids[0]`` is the first token of block ``start_block`` of the request. To extend a
        chain incrementally pass ``parent`` = the hash of block ``start_block - 1``; the result
        equals the matching slice of a one-shot call. ``parent`` is required iff
        ``start_block > 0``. ``cache_salt`` only affects block 0 (an empty salt is no salt, as
        in vLLM); ``lora`` = (name, path) affects every block.

        ``token_ids`` may also be a one-dimensional buffer of unsigned integers (an
        ``array.array``, a numpy array: front ends that decode ids in bulk); its items are
        plain ints >= 0 by construction and are not checked one by one.

        Raises InvalidArgument (nothing computed) for token ids that are not ``int`` >= 0 —
        bool, int subclasses and numpy integers are rejected because they would pickle or
        encode differently — or for an inconsistent parent/start_block.
        """
        tokens, packed_all = _check_tokens(token_ids)
        first_keys, rest_keys = self._extra_keys(cache_salt, lora)
        if type(start_block) is not int or start_block < 0:
            raise InvalidArgument("start_block must be an int >= 0", start_block=start_block)
        if start_block == 0:
            if parent is not None:
                raise InvalidArgument("parent must be None when start_block is 0")
            parent = self._none_hash
        else:
            if not isinstance(parent, bytes) or len(parent) != _DIGEST_SIZES[self.algo]:
                raise InvalidArgument(
                    f"start_block > 0 needs the parent hash ({self.digest_size} bytes)",
                    start_block=start_block,
                    parent=parent,
                )
            first_keys = rest_keys
        num_blocks = len(tokens) // self.block_size
        out: list[BlockHash] = []
        keys, done = first_keys, 0
        cache = self._cache
        seg_bytes = self.block_size * _PACKED_ID_SIZE * GROUP_BLOCKS
        if packed_all is not None and num_blocks >= GROUP_BLOCKS:  # cached whole segments
            out = cache.run(
                parent, keys, rest_keys, packed_all, num_blocks // GROUP_BLOCKS, seg_bytes
            )
            done = len(out)
            if done:
                parent, keys = out[-1], rest_keys
        if done == num_blocks:
            return out
        hashes = self._chain(tokens, packed_all, done, num_blocks, parent, keys, rest_keys)
        if packed_all is not None and len(hashes) >= GROUP_BLOCKS:  # remember new segments
            cache.put_chain(
                parent, keys, rest_keys, packed_all, done // GROUP_BLOCKS, seg_bytes, hashes
            )
        out += hashes
        return out

    def _chain(
        self,
        tokens: Sequence[int],
        packed_all: bytes | None,
        first_block: int,
        end_block: int,
        parent: bytes,
        first_keys: object,
        rest_keys: object,
    ) -> list[BlockHash]:
        """Hashes of blocks ``first_block`` to ``end_block - 1`` of ``tokens``, the first one's
        parent ``parent``: CBOR payloads encoded in bulk (:mod:`kvserver.hash_payloads`), or
        one H call per block (pickle, which ``pickle.dumps`` writes in C; a few blocks; ids
        >= 2**32)."""
        bs = self.block_size
        lo, hi = first_block * bs, end_block * bs
        bulk = self.algo != "sha256" and end_block - first_block >= BULK_MIN_BLOCKS
        if packed_all is None or not bulk:
            return _chain_literal(
                self.algo, tuple(tokens[lo:hi]), bs, parent, first_keys, rest_keys
            )
        ids = numpy.frombuffer(packed_all, dtype=numpy.uint32)[lo:hi]
        payloads = encode_blocks(ids, bs, self.digest_size, first_keys, rest_keys)
        return _chain_payloads(self.algo, payloads, parent)

    def chunk_keys(self, block_hashes: Sequence[BlockHash], chunk_blocks: int) -> list[BlockHash]:
        """See :func:`chunk_keys`."""
        return chunk_keys(block_hashes, chunk_blocks)

    @staticmethod
    def _extra_keys(
        cache_salt: str | None, lora: tuple[str, str] | None
    ) -> tuple[tuple[object, ...] | None, tuple[object, ...] | None]:
        """(extra keys of block 0, extra keys of every later block)."""
        rest: tuple[object, ...] = ()
        if lora is not None:
            if len(lora) != 2 or not all(type(s) is str for s in lora):
                raise InvalidArgument("lora must be a (name, path) pair of str", lora=lora)
            rest = (("lora", sys.intern(lora[0]), sys.intern(lora[1])),)
        first = rest
        if cache_salt is not None:
            if type(cache_salt) is not str:
                raise InvalidArgument("cache_salt must be a str", cache_salt=cache_salt)
            if cache_salt:
                first = (*rest, ("cache_salt", sys.intern(cache_salt)))
        return first or None, rest or None


_UNSIGNED_FORMATS = frozenset("BHILQ")


def _check_tokens(token_ids: Sequence[int]) -> tuple[Sequence[int], bytes | None]:
    """(the token ids as a tuple or an ``array('I')``, packed as native 4-byte unsigned ints
    or None if one is >= 2**32); InvalidArgument names the first bad id.

    A buffer of unsigned ints (see ``hash_blocks``) is taken as it is; anything else is
    checked item by item (plain ``int``, >= 0).
    """
    if type(token_ids) is not tuple and type(token_ids) is not list:
        try:
            view = memoryview(token_ids)  # type: ignore[arg-type]
        except TypeError:
            view = None
        if view is not None and view.ndim == 1 and view.format.lstrip("@=") in _UNSIGNED_FORMATS:
            if view.format.lstrip("@=") == "I" and view.itemsize == 4:
                ids = array("I")
                ids.frombytes(view.cast("B") if view.c_contiguous else view.tobytes())
                return ids, ids.tobytes()
            values = tuple(view.tolist())
            return values, _pack(values)
    try:
        tokens = token_ids if type(token_ids) is tuple else tuple(token_ids)
    except TypeError:
        raise InvalidArgument(
            "token_ids must be a sequence of ints", type=type(token_ids).__name__
        ) from None
    if not {int}.issuperset(map(type, tokens)):
        for index, token in enumerate(tokens):
            if type(token) is not int:
                raise InvalidArgument(
                    "token ids must be plain ints",
                    index=index,
                    token=token,
                    type=type(token).__name__,
                )
    packed = _pack(tokens)  # in range [0, 2**32): no id is negative
    if packed is None and tokens and min(tokens) < 0:
        index = next(i for i, t in enumerate(tokens) if t < 0)
        raise InvalidArgument("token ids must be >= 0", index=index, token=tokens[index])
    return tokens, packed


def _pack(tokens: tuple[int, ...]) -> bytes | None:
    """The ids as native 4-byte unsigned ints, or None if one is out of [0, 2**32)."""
    try:
        return array("I", tokens).tobytes()
    except OverflowError:
        return None


def _chain_payloads(algo: str, payloads: Payloads, parent: bytes) -> list[BlockHash]:
    """The CBOR chain over payloads encoded in bulk: one digest per block, parent spliced in."""
    data, head, starts, ends = payloads
    out: list[bytes] = []
    append = out.append
    prev = parent
    if algo == "xxhash_cbor":
        xxh = xxhash.xxh3_128_digest
        for start, end in zip(starts, ends, strict=True):
            prev = xxh(head + prev + data[start:end])
            append(prev)
    else:
        sha256 = hashlib.sha256
        for start, end in zip(starts, ends, strict=True):
            prev = sha256(head + prev + data[start:end]).digest()
            append(prev)
    return cast("list[BlockHash]", out)


def _chain_literal(
    algo: str,
    tokens: tuple[int, ...],
    block_size: int,
    parent: bytes,
    first_keys: object,
    rest_keys: object,
) -> list[BlockHash]:
    """The scheme as written, one H((parent, block, keys)) per block: any ids, no set-up.
    For "sha256" (the pickle is written in C) H is inlined: its whole call, ~1 us a block."""
    if not tokens:
        return []
    if algo == "sha256":
        dumps, sha256, protocol = pickle.dumps, hashlib.sha256, PICKLE_PROTOCOL
        prev = sha256(dumps((parent, tokens[:block_size], first_keys), protocol)).digest()
        out = [prev]
        append = out.append
        for start in range(block_size, len(tokens) - block_size + 1, block_size):
            block = tokens[start : start + block_size]
            prev = sha256(dumps((prev, block, rest_keys), protocol)).digest()
            append(prev)
        return cast("list[BlockHash]", out)
    fn = _HASH_FUNCTIONS[algo]
    out = []
    keys = first_keys
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = fn((parent, tokens[start : start + block_size], keys))
        keys = rest_keys
        out.append(parent)
    return cast("list[BlockHash]", out)
