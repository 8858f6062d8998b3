"""Tests of kvserver.grants' packed store grant (capability ``packed_store_grant``) without
sockets: round trips through msgpack against the unpacked form, and every malformed,
truncated or oversized packed grant refused with InvalidArgument."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserver import grants, wire
from kvserver.allocator import Extents
from kvserver.errors import InvalidArgument
from kvserver.grants import StoreGrant


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def over_the_wire(obj: Any) -> Any:
    """As the client's ``decode_reply`` sees it: a msgpack round trip under the wire's limits."""
    return wire.unpack_header(msgpack.packb(obj, use_bin_type=True))


def engine_grant(
    keys: list[bytes],
    present: set[bytes] = frozenset(),  # type: ignore[assignment]
    filtered: set[bytes] = frozenset(),  # type: ignore[assignment]
    parts: int = 1,
    extents_per_part: int = 1,
) -> StoreGrant:
    """What the engine answers to ``keys``: each distinct key present, filtered or granted
    (request order, duplicates removed), one location of ``parts`` parts per granted key."""
    unique = list(dict.fromkeys(keys))
    granted = [k for k in unique if k not in present and k not in filtered]
    locations: list[list[Extents]] = [
        [
            tuple((((i * parts + r) * 8 + e) * 4096, 4096) for e in range(extents_per_part))
            for r in range(parts)
        ]
        for i in range(len(granted))
    ]  # fmt: skip
    return StoreGrant(
        7 if granted else 0, 130.0, "ns", granted, locations,
        [k for k in unique if k in present], [k for k in unique if k in filtered], 2,
    )  # fmt: skip


def round_trip(grant: StoreGrant, keys: list[bytes]) -> StoreGrant:
    wired = over_the_wire(grants.packed_store_grant_to_wire(grant, keys, now=100.0))
    return grants.packed_store_grant_from_wire(wired, keys, "ns", now=5.0, granted_by="sid-1")


def unpacked(grant: StoreGrant) -> StoreGrant:
    """The same grant through the unpacked form, for comparison."""
    wired = over_the_wire(grants.grant_to_wire(grant, now=100.0))
    return grants.store_grant_from_wire(wired, now=5.0, granted_by="sid-1")


@pytest.mark.parametrize(
    "present, filtered, repeat, parts, per_part",
    [
        (0, 0, False, 1, 1),  # a decode step: every key granted, one extent each
        (2, 1, True, 1, 1),
        (0, 0, False, 4, 1),  # tensor parallel
        (1, 0, True, 2, 3),  # a fragmented arena: several extents per part
        (6, 2, True, 1, 1),  # nothing new: lease 0, no extents
    ],
)
def test_the_packed_grant_reads_back_as_the_unpacked_one(
    present: int, filtered: int, repeat: bool, parts: int, per_part: int
) -> None:
    keys = [key(i) for i in range(8)]
    if repeat:
        keys += [keys[5], keys[0]]
    grant = engine_grant(keys, set(keys[:present]), set(keys[present : present + filtered]),
                         parts, per_part)  # fmt: skip
    got = round_trip(grant, keys)
    assert got == unpacked(grant)
    assert got.deadline == 35.0 and got.granted_by == "sid-1" and got.num_evicted == 2


def test_a_packed_grant_echoes_no_key_and_is_smaller() -> None:
    keys = [key(i) for i in range(31)]
    grant = engine_grant(keys)
    packed = grants.packed_store_grant_to_wire(grant, keys, now=100.0)
    assert not any(isinstance(v, list) for v in packed.values())
    assert packed["status"] == bytes(31) and packed["counts"] is None
    assert len(packed["extents"]) == 31 * 16
    size = len(msgpack.packb(packed, use_bin_type=True))
    assert size * 2 < len(msgpack.packb(grants.grant_to_wire(grant, 100.0), use_bin_type=True))


@settings(max_examples=200)
@given(
    codes=st.lists(st.sampled_from("gpf"), min_size=0, max_size=24),
    repeats=st.lists(st.integers(0, 23), max_size=6),
    parts=st.integers(1, 4),
    per_part=st.integers(1, 3),
)
def test_round_trip_of_any_answer(
    codes: list[str], repeats: list[int], parts: int, per_part: int
) -> None:
    unique = [key(i) for i in range(len(codes))]
    keys = unique + [unique[i] for i in repeats if i < len(unique)]
    present = {k for k, c in zip(unique, codes, strict=True) if c == "p"}
    filtered = {k for k, c in zip(unique, codes, strict=True) if c == "f"}
    grant = engine_grant(keys, present, filtered, parts, per_part)
    assert round_trip(grant, keys) == unpacked(grant)


# ----------------------------------------------------------------------------- malformed


def valid(parts: int = 1, per_part: int = 1) -> tuple[dict[str, Any], list[bytes]]:
    keys = [key(i) for i in range(4)]
    grant = engine_grant(keys, {keys[1]}, set(), parts, per_part)
    return grants.packed_store_grant_to_wire(grant, keys, now=100.0), keys


def with_(data: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**data, **fields}


GOOD, KEYS = valid()
GOOD_TP, _ = valid(parts=2)
GOOD_FRAG, _ = valid(per_part=2)


@pytest.mark.parametrize(
    "data, keys",
    [
        (None, KEYS),
        ([GOOD], KEYS),
        ({k: v for k, v in GOOD.items() if k != "status"}, KEYS),  # a field missing
        (with_(GOOD, keys=KEYS), KEYS),  # an unknown field (the unpacked form's)
        (grants.grant_to_wire(engine_grant(KEYS), 100.0), KEYS),  # the unpacked form itself
        (with_(GOOD, lease_id=-1), KEYS),
        (with_(GOOD, lease_id="7"), KEYS),
        (with_(GOOD, lease_id=True), KEYS),
        (with_(GOOD, lease_id=1 << 63), KEYS),
        (with_(GOOD, num_evicted=1.0), KEYS),
        (with_(GOOD, expires_in_s="10"), KEYS),
        (with_(GOOD, expires_in_s=float("nan")), KEYS),
        (with_(GOOD, expires_in_s=-1.0), KEYS),
        (with_(GOOD, status=[0, 1, 0, 0]), KEYS),  # not bin
        (with_(GOOD, status=bytes(3)), KEYS),  # a key short (truncated)
        (with_(GOOD, status=bytes(5)), KEYS),  # a key over
        (GOOD, KEYS[:3]),  # for another request
        (with_(GOOD, status=b"\x00\x01\x00\x04"), KEYS),  # an unknown code
        (with_(GOOD, status=b"\x00\x01\x00\x03"), KEYS),  # a repeat of no earlier key
        (with_(GOOD, status=bytes(5)), [*KEYS, KEYS[0]]),  # a repeated key granted twice
        (with_(GOOD, status=b"\x00\x01\x00\x00\x00"), [*KEYS, KEYS[0]]),  # likewise
        (with_(GOOD, parts=0), KEYS),
        (with_(GOOD, parts=2), KEYS),  # the extents are for one part per key
        (with_(GOOD, parts="1"), KEYS),
        (with_(GOOD, extents=GOOD["extents"][:-1]), KEYS),  # truncated
        (with_(GOOD, extents=GOOD["extents"][:-16]), KEYS),  # an extent short
        (with_(GOOD, extents=GOOD["extents"] + bytes(16)), KEYS),  # oversized
        (with_(GOOD, extents=b""), KEYS),
        (with_(GOOD, extents=list(GOOD["extents"])), KEYS),
        (with_(GOOD, status=bytes(4)), KEYS),  # four granted, extents for three
        (with_(GOOD, counts=b"\x01\x00\x00"), KEYS),  # counts truncated
        (with_(GOOD, counts=[1, 1, 1]), KEYS),
        (with_(GOOD, counts=struct.pack("<3I", 1, 0, 2)), KEYS),  # an empty part
        (with_(GOOD, counts=struct.pack("<3I", 1, 1, 2)), KEYS),  # more extents than sent
        (with_(GOOD_FRAG, counts=struct.pack("<3I", 2, 2, 1)), KEYS),  # fewer
        (with_(GOOD_FRAG, counts=None), KEYS),
        (with_(GOOD_FRAG, extents=GOOD_FRAG["extents"][:-8]), KEYS),
        (with_(GOOD_TP, parts=1), KEYS),
        (with_(GOOD_TP, parts=3), KEYS),
        (with_(GOOD_TP, parts=(1 << 62)), KEYS),  # no allocation of that size either
    ],
)
def test_malformed_packed_grants_are_invalid_argument(data: Any, keys: list[bytes]) -> None:
    with pytest.raises(InvalidArgument, match="malformed packed grant"):
        grants.packed_store_grant_from_wire(data, keys, "ns", now=0.0)


def test_the_valid_bases_of_the_malformed_cases_are_accepted() -> None:
    for data in (GOOD, GOOD_TP, GOOD_FRAG):
        got = grants.packed_store_grant_from_wire(over_the_wire(data), KEYS, "ns", now=0.0)
        assert got.keys == [KEYS[0], KEYS[2], KEYS[3]] and got.present == [KEYS[1]]


field_values = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
field_values |= st.binary(max_size=80) | st.lists(st.integers(0, 5), max_size=4)


@settings(max_examples=400)
@given(
    changes=st.dictionaries(
        st.sampled_from([*sorted(GOOD), "keys", "x"]), field_values, max_size=3
    ),
    cut=st.integers(0, 64),
)
def test_any_damaged_packed_grant_is_read_or_refused_with_invalid_argument(
    changes: dict[str, Any], cut: int
) -> None:
    """Fields replaced or added, the blob cut short: a StoreGrant whose locations match its
    keys, or InvalidArgument; never another exception."""
    data = with_(GOOD_TP, **changes)
    if isinstance(data.get("extents"), bytes):
        data["extents"] = data["extents"][: len(data["extents"]) - cut]
    with contextlib.suppress(InvalidArgument):
        got = grants.packed_store_grant_from_wire(data, KEYS, "ns", now=0.0)
        assert len(got.locations) == len(got.keys)
        assert all(len(loc) == data["parts"] for loc in got.locations)
        assert all(len(part) >= 1 for loc in got.locations for part in loc)


# ----------------------------------------------------------------------------- packed load grant


def load_grant(num_keys: int, parts: int = 1, extents_per_part: int = 1) -> grants.LoadGrant:
    """What the engine answers to a ``prepare_load`` of ``num_keys`` keys."""
    store = engine_grant([key(i) for i in range(num_keys)], parts=parts,
                         extents_per_part=extents_per_part)  # fmt: skip
    return grants.LoadGrant(9, 130.0, "ns", store.keys, store.locations)


@pytest.mark.parametrize(("num_keys", "parts", "extents"), [(0, 1, 1), (3, 1, 1), (4, 2, 3)])
def test_a_packed_load_grant_reads_back_as_the_unpacked_one(
    num_keys: int, parts: int, extents: int
) -> None:
    grant = load_grant(num_keys, parts, extents)
    keys = list(grant.keys)
    wired = over_the_wire(grants.packed_load_grant_to_wire(grant, now=100.0))
    assert "keys" not in wired and (wired["counts"] is None) == (extents == 1)
    got = grants.packed_load_grant_from_wire(wired, keys, "ns", now=5.0, granted_by="sid-1")
    plain = over_the_wire(grants.grant_to_wire(grant, now=100.0))
    assert got == grants.load_grant_from_wire(plain, now=5.0, granted_by="sid-1")
    assert got.deadline == pytest.approx(35.0) and got.keys == keys


@pytest.mark.parametrize(
    "spoil",
    [
        lambda d: d.pop("counts"),
        lambda d: d.update(keys=[]),
        lambda d: d.update(lease_id=-1),
        lambda d: d.update(parts=0),
        lambda d: d.update(expires_in_s=float("nan")),
        lambda d: d.update(extents=d["extents"][:-1]),
        lambda d: d.update(extents=d["extents"] + bytes(16)),
        lambda d: d.update(extents=list(d["extents"])),
        lambda d: d.update(counts=struct.pack("<3I", 1, 1, 1)),
    ],
)
def test_a_malformed_packed_load_grant_is_invalid_argument(spoil: Any) -> None:
    grant = load_grant(2)
    wired = over_the_wire(grants.packed_load_grant_to_wire(grant, now=100.0))
    spoil(wired)
    with pytest.raises(InvalidArgument, match="malformed packed grant"):
        grants.packed_load_grant_from_wire(wired, list(grant.keys), "ns", now=5.0)
