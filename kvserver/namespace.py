"""Namespaces: everything that makes KV bytes incompatible.

Two requests may share a stored chunk only if they agree on the model, the KV dtype, the
layer/head layout, tokens per block, blocks per chunk, the hash algorithm and its seed, and the
tensor-parallel world size. A :class:`NamespaceSpec` captures exactly those; its :attr:`ns_id` is
a digest of the canonical encoding of every field, so the same spec registered by any client on
any host yields the same id, and any difference yields a different one. Entries are never shared
across namespaces (the storage index is keyed by ``(namespace, chunk_key)``).

A chunk is stored as one *part* per TP rank; :attr:`NamespaceSpec.part_bytes` is the size of one
part (this rank's KV heads, every layer, ``chunk_blocks`` GPU blocks). Layouts that the formula
does not describe (MLA latents, hybrid models) pass ``part_bytes_override``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import cbor2

from kvserver.errors import InvalidArgument

#: bytes per element of every KV dtype we accept (torch names).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: keep in sync with kvserver.hashing.HASH_ALGOS (checked by a test).
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash_cbor")
KEY_SIZES: dict[str, int] = {"sha256": 32, "sha256_cbor": 32, "xxhash_cbor": 16}

MAX_MODEL_NAME = 512
MAX_PART_BYTES = 1 << 34  # 16 GiB: anything larger is a unit error, not a real chunk.
#: largest value of a spec's integer fields (but ``part_bytes_override``), the gRPC API's
#: ``uint32``, and of ``chunk_tokens`` (``block_size * chunk_blocks``): so every registered
#: spec can be told back over every API, and token counts (``hit_tokens``: up to 2^21 chunks
#: of ``chunk_tokens``) fit the wire's 64-bit integers. Larger ones were registered, then
#: their replies could not be encoded (``register_namespace``'s, a ``lookup``'s: no reply).
MAX_FIELD_INT = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """The parameters that make KV bytes compatible. Validated on construction."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    chunk_blocks: int = 1
    hash_algo: str = "sha256_cbor"
    #: NONE_HASH seed of the hash chain (vLLM: the value of PYTHONHASHSEED).
    hash_seed: str = "vllm-none-hash"
    tp_world_size: int = 1
    kv_factor: int = 2
    part_bytes_override: int = 0
    #: free-form label kept for operators (not part of identity).
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model or len(self.model) > MAX_MODEL_NAME:
            raise InvalidArgument("model must be a non-empty string of <= 512 chars")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPE_SIZES)}")
        if not isinstance(self.hash_seed, str) or len(self.hash_seed) > MAX_MODEL_NAME:
            raise InvalidArgument("hash_seed must be a string of <= 512 chars")
        if not isinstance(self.hash_algo, str) or self.hash_algo not in HASH_ALGOS:
            raise InvalidArgument(
                f"unknown hash_algo {self.hash_algo!r}; valid: {', '.join(HASH_ALGOS)}"
            )
        for name in (
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "chunk_blocks",
            "tp_world_size",
            "kv_factor",
        ):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_FIELD_INT:
                raise InvalidArgument(
                    f"{name} must be an integer in 1..{MAX_FIELD_INT}", value=value
                )
        if self.kv_factor not in (1, 2):
            raise InvalidArgument("kv_factor must be 2 (K and V) or 1 (MLA latent)")
        heads, tp = self.num_kv_heads, self.tp_world_size
        if heads % tp != 0 and tp % heads != 0:
            raise InvalidArgument(
                "num_kv_heads and tp_world_size must divide one another",
                num_kv_heads=heads,
                tp_world_size=tp,
            )
        if not isinstance(self.label, str) or len(self.label) > MAX_MODEL_NAME:
            raise InvalidArgument("label must be a string of <= 512 chars")
        if type(self.part_bytes_override) is not int or self.part_bytes_override < 0:
            raise InvalidArgument("part_bytes_override must be an integer >= 0")
        if self.chunk_tokens > MAX_FIELD_INT:
            raise InvalidArgument(
                f"block_size * chunk_blocks (tokens per chunk) must be at most {MAX_FIELD_INT}",
                chunk_tokens=self.chunk_tokens,
            )
        if not 0 < self.part_bytes <= MAX_PART_BYTES:
            raise InvalidArgument("part size out of range", part_bytes=self.part_bytes)

    # ------------------------------------------------------------------ derived values

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads held by one TP rank (heads are replicated when tp > num_kv_heads)."""
        return max(1, self.num_kv_heads // self.tp_world_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one GPU block on one rank, all layers."""
        return (
            self.num_layers
            * self.kv_factor
            * self.kv_heads_per_rank
            * self.head_dim
            * self.block_size
            * DTYPE_SIZES[self.dtype]
        )

    @property
    def part_bytes(self) -> int:
        """Bytes of one stored part (one TP rank's share of one chunk)."""
        return self.part_bytes_override or self.block_bytes * self.chunk_blocks

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.chunk_blocks

    @property
    def key_size(self) -> int:
        """Length in bytes of every chunk key of this namespace."""
        return KEY_SIZES[self.hash_algo]

    @property
    def ns_id(self) -> str:
        """Stable id: 16 hex chars of sha256 over the canonical CBOR of the identity fields
        (computed once per distinct spec: :func:`_ns_id` is memoised)."""
        return _ns_id(self)

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> NamespaceSpec:
        """Build from an untrusted mapping (wire, config file); unknown fields are errors."""
        if not isinstance(data, dict):
            raise InvalidArgument("namespace must be a mapping")
        allowed = set(cls.__dataclass_fields__)
        unknown = set(data) - allowed
        if unknown:
            raise InvalidArgument(
                f"unknown namespace fields: {', '.join(sorted(map(str, unknown)))}"
            )
        try:
            return cls(**data)
        except TypeError as exc:  # missing required fields
            raise InvalidArgument(f"bad namespace: {exc}") from None


@functools.lru_cache(maxsize=1024)
def _ns_id(spec: NamespaceSpec) -> str:
    """``spec.ns_id``, memoised: the daemon asks it several times per request (a peer fetch of
    32 MiB asked it five times, ~0.08 ms each: ``asdict``, CBOR, sha256). Keyed by the spec's
    identity fields (``label`` is not compared), the ones the id is made of."""
    ident = {k: v for k, v in asdict(spec).items() if k != "label"}
    return hashlib.sha256(cbor2.dumps(ident, canonical=True)).hexdigest()[:16]
