"""Tests of kvserver.namespace: identity (ns_id), part size arithmetic, validation, from_dict."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvserver import hashing
from kvserver.errors import InvalidArgument
from kvserver.namespace import (
    DTYPE_SIZES,
    HASH_ALGOS,
    KEY_SIZES,
    MAX_FIELD_INT,
    MAX_PART_BYTES,
    NamespaceSpec,
)
from tests.kvserver.builders import make_spec

#: a different valid value for every identity field (make_spec's defaults otherwise).
ALTERNATIVES: dict[str, Any] = {
    "model": "test/other-model",
    "dtype": "bfloat16",
    "num_layers": 3,
    "num_kv_heads": 4,
    "head_dim": 32,
    "block_size": 32,
    "chunk_blocks": 2,
    "hash_algo": "xxhash_cbor",
    "hash_seed": "another-seed",
    "tp_world_size": 2,
    "kv_factor": 1,
    "part_bytes_override": 12345,
}

IDENTITY_FIELDS = sorted(f.name for f in dataclasses.fields(NamespaceSpec) if f.name != "label")


# ---------------------------------------------------------------------------- identity


def test_alternatives_cover_every_identity_field() -> None:
    """A new NamespaceSpec field must be added to ALTERNATIVES (and so to identity tests)."""
    assert sorted(ALTERNATIVES) == IDENTITY_FIELDS


def test_ns_id_is_stable() -> None:
    spec = make_spec()
    assert spec.ns_id == make_spec().ns_id == NamespaceSpec.from_dict(spec.to_dict()).ns_id
    assert len(spec.ns_id) == 16 and int(spec.ns_id, 16) >= 0
    # Golden value: ns_id is persisted (SSD index) and shared across hosts. If this changes,
    # every stored chunk becomes unreachable; change it only together with a format version.
    assert spec.ns_id == "e132cfed89c977a3"


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_ns_id_sensitive_to_every_identity_field(name: str) -> None:
    base = make_spec()
    other = dataclasses.replace(base, **{name: ALTERNATIVES[name]})
    assert getattr(other, name) != getattr(base, name)
    assert other.ns_id != base.ns_id
    assert other != base


def test_label_is_not_identity() -> None:
    plain, labelled = make_spec(), make_spec(label="prod replica")
    assert plain.ns_id == labelled.ns_id
    assert plain == labelled
    assert labelled.to_dict()["label"] == "prod replica"


# ---------------------------------------------------------------------------- part size


def test_part_bytes_formula() -> None:
    spec = make_spec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, chunk_blocks=4)
    assert spec.kv_heads_per_rank == 8
    assert spec.block_bytes == 32 * 2 * 8 * 128 * 16 * 2
    assert spec.part_bytes == spec.block_bytes * 4
    assert spec.chunk_tokens == 64


def test_tp_splits_heads() -> None:
    spec = make_spec(num_kv_heads=8, tp_world_size=4)
    assert spec.kv_heads_per_rank == 2
    assert spec.part_bytes == make_spec(num_kv_heads=8).part_bytes // 4


@pytest.mark.parametrize(("heads", "tp"), [(2, 4), (1, 8), (4, 4)])
def test_tp_larger_than_heads_replicates(heads: int, tp: int) -> None:
    spec = make_spec(num_kv_heads=heads, tp_world_size=tp)
    assert spec.kv_heads_per_rank == 1
    assert spec.part_bytes == make_spec(num_kv_heads=1).part_bytes


@pytest.mark.parametrize(("dtype", "size"), sorted(DTYPE_SIZES.items()))
def test_dtype_size(dtype: str, size: int) -> None:
    assert make_spec(dtype=dtype).part_bytes == 2 * 2 * 2 * 16 * 16 * size


def test_kv_factor_one_halves_part() -> None:
    assert make_spec(kv_factor=1).part_bytes * 2 == make_spec().part_bytes


def test_override_replaces_formula() -> None:
    spec = make_spec(part_bytes_override=5000, chunk_blocks=4, tp_world_size=2)
    assert spec.part_bytes == 5000


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_key_size_matches_hash_digest(algo: str) -> None:
    assert make_spec(hash_algo=algo).key_size == KEY_SIZES[algo] == hashing.digest_size(algo)


def test_hash_algos_in_sync_with_hashing() -> None:
    assert HASH_ALGOS == hashing.HASH_ALGOS
    assert set(KEY_SIZES) == set(HASH_ALGOS)
    assert make_spec().hash_seed == hashing.DEFAULT_SEED


# ---------------------------------------------------------------------------- validation

INVALID: list[tuple[str, Any]] = [
    ("model", ""),
    ("model", None),
    ("model", 7),
    ("model", "m" * 513),
    ("dtype", "float64"),
    ("dtype", ""),
    ("dtype", None),
    ("dtype", ["float16"]),  # unhashable
    ("hash_algo", "md5"),
    ("hash_algo", None),
    ("hash_algo", ["sha256"]),
    ("hash_seed", None),
    ("hash_seed", 0),
    ("hash_seed", "s" * 513),
    *[
        (name, bad)
        for name in (
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "chunk_blocks",
            "tp_world_size",
            "kv_factor",
        )
        for bad in (0, -1, True, 2.0, "2", None)
    ],
    *[
        (name, MAX_FIELD_INT + 1)  # beyond the gRPC API's uint32 (part size overridden)
        for name in ("num_layers", "head_dim", "block_size", "chunk_blocks")
    ],
    ("kv_factor", 3),
    ("tp_world_size", 3),  # 2 heads, 3 ranks: neither divides the other
    ("part_bytes_override", -1),
    ("part_bytes_override", True),
    ("part_bytes_override", 1.5),
    ("part_bytes_override", None),
    ("part_bytes_override", MAX_PART_BYTES + 1),
    ("num_layers", 1 << 30),  # formula part size beyond MAX_PART_BYTES
    ("label", None),
    ("label", ["x"]),
    ("label", "l" * 513),
]


def test_largest_field_values_fit_every_wire() -> None:
    """Each integer field at its largest (the part size overridden): the tokens of 2^21
    chunks (a request's most) still fit the 64-bit integers of msgpack and the gRPC API."""
    spec = make_spec(block_size=MAX_FIELD_INT, num_layers=MAX_FIELD_INT, part_bytes_override=4096)
    assert spec.chunk_tokens == MAX_FIELD_INT and (1 << 21) * spec.chunk_tokens < 1 << 64
    with pytest.raises(InvalidArgument, match="tokens per chunk"):
        make_spec(block_size=MAX_FIELD_INT, chunk_blocks=2, part_bytes_override=4096)


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r:.20}" for n, v in INVALID])
def test_invalid_parameter_rejected(name: str, value: Any) -> None:
    with pytest.raises(InvalidArgument):
        make_spec(**{name: value})
    data = make_spec().to_dict()
    data[name] = value
    with pytest.raises(InvalidArgument):
        NamespaceSpec.from_dict(data)


def test_unhashable_dtype_is_invalid_argument() -> None:
    """dtype=["float16"] (e.g. from a JSON config) raised TypeError from the dict lookup."""
    with pytest.raises(InvalidArgument, match="dtype"):
        NamespaceSpec.from_dict({**make_spec().to_dict(), "dtype": ["float16"]})


def test_label_must_be_a_short_string() -> None:
    """label was not validated: any object (a list, a 1 MB string) was kept and persisted."""
    for label in (None, ["x"], "l" * 513):
        with pytest.raises(InvalidArgument, match="label"):
            make_spec(label=label)
    assert make_spec(label="l" * 512).label == "l" * 512


def test_heads_tp_error_names_both() -> None:
    with pytest.raises(InvalidArgument) as info:
        make_spec(num_kv_heads=6, tp_world_size=4)
    assert info.value.context == {"num_kv_heads": 6, "tp_world_size": 4}


def test_unknown_dtype_lists_choices() -> None:
    with pytest.raises(InvalidArgument) as info:
        make_spec(dtype="float64")
    assert "bfloat16" in str(info.value)


# ---------------------------------------------------------------------------- from_dict


def test_to_dict_from_dict_round_trip() -> None:
    spec = make_spec(tp_world_size=2, chunk_blocks=4, label="x", hash_algo="sha256")
    again = NamespaceSpec.from_dict(spec.to_dict())
    assert again == spec and again.label == "x" and again.ns_id == spec.ns_id


def test_from_dict_rejects_unknown_fields() -> None:
    data = make_spec().to_dict()
    data["num_layer"] = 2
    with pytest.raises(InvalidArgument, match="num_layer"):
        NamespaceSpec.from_dict(data)


def test_from_dict_rejects_non_string_field_names() -> None:
    data: dict[Any, Any] = make_spec().to_dict()
    data[1] = 2
    with pytest.raises(InvalidArgument):
        NamespaceSpec.from_dict(data)


@pytest.mark.parametrize("missing", ["model", "dtype", "num_layers", "head_dim", "block_size"])
def test_from_dict_rejects_missing_fields(missing: str) -> None:
    data = make_spec().to_dict()
    del data[missing]
    with pytest.raises(InvalidArgument, match=missing):
        NamespaceSpec.from_dict(data)


def test_from_dict_defaults_optional_fields() -> None:
    required = {
        k: v
        for k, v in make_spec().to_dict().items()
        if k in {"model", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size"}
    }
    assert NamespaceSpec.from_dict(required) == make_spec()


@pytest.mark.parametrize("data", [None, [], "spec", 3, [("model", "m")], b"{}"])
def test_from_dict_rejects_non_mappings(data: Any) -> None:
    with pytest.raises(InvalidArgument):
        NamespaceSpec.from_dict(data)
