"""kvserver/ssd/format.py: chunk headers round-trip, every damaged header is refused with the
check that caught it, payload checksums catch a single flipped bit, directory metadata files."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvserver.errors import StorageError
from kvserver.ssd import format as fmt
from kvserver.ssd.fileio import aligned_buffer
from kvserver.ssd.format import ChunkHeader, CorruptChunk


def header(**over: object) -> ChunkHeader:
    fields: dict[str, object] = {
        "ns_id": "0123456789abcdef",
        "key": bytes(range(32)),
        "seq": 7,
        "slot_bytes": fmt.slot_bytes_for(2 * 5000),
        "part_bytes": 5000,
        "num_parts": 2,
        "checksum": 0x1234_5678_9ABC_DEF0_1122_3344_5566_7788,
    }
    fields.update(over)
    return ChunkHeader(**fields)  # type: ignore[arg-type]


def encoded(h: ChunkHeader) -> memoryview:
    buf = aligned_buffer(fmt.HEADER_BYTES)
    fmt.encode_header(h, buf)
    return buf


def test_slot_geometry_is_block_aligned() -> None:
    assert fmt.HEADER_BYTES % fmt.BLOCK == 0 and fmt.HEADER_USED <= fmt.HEADER_BYTES
    assert fmt.slot_bytes_for(1) == 2 * fmt.BLOCK
    assert fmt.slot_bytes_for(fmt.BLOCK) == 2 * fmt.BLOCK
    assert fmt.slot_bytes_for(fmt.BLOCK + 1) == 3 * fmt.BLOCK


def test_header_round_trip() -> None:
    h = header()
    block = encoded(h)
    assert fmt.decode_header(block) == h
    assert not any(block[fmt.HEADER_USED :]), "the unused part of the block is zero"


@given(
    key=st.binary(min_size=1, max_size=fmt.MAX_KEY_BYTES),
    seq=st.integers(1, fmt.MAX_SEQ),
    part=st.integers(1, 1 << 30),
    parts=st.integers(1, 64),
    checksum=st.integers(0, 2**128 - 1),
)
def test_any_header_round_trips(key: bytes, seq: int, part: int, parts: int, checksum: int) -> None:
    h = header(
        key=key,
        seq=seq,
        part_bytes=part,
        num_parts=parts,
        slot_bytes=fmt.slot_bytes_for(part * parts),
        checksum=checksum,
    )
    assert fmt.decode_header(encoded(h)) == h


@pytest.mark.parametrize("seq", [0, fmt.MAX_SEQ + 1, 2**64 - 1])
def test_a_sequence_number_out_of_range_is_refused(seq: int) -> None:
    """A rebuilt index continues after the largest sequence number found: one near 2**64
    (forged: both checksums right) would leave none that fits for the next write."""
    with pytest.raises(StorageError, match="sequence number"):
        encoded(header(seq=seq))
    block = encoded(header())
    block[16:24] = seq.to_bytes(8, "little")  # the seq field, then a valid header checksum
    body = bytes(block[: fmt.HEADER_USED - 8])
    block[fmt.HEADER_USED - 8 : fmt.HEADER_USED] = xxhash.xxh3_64_intdigest(body).to_bytes(
        8, "little"
    )
    with pytest.raises(CorruptChunk) as bad:
        fmt.decode_header(block)
    assert bad.value.reason == "geometry"


def test_blank_block_is_an_empty_slot() -> None:
    with pytest.raises(CorruptChunk) as err:
        fmt.decode_header(bytes(fmt.HEADER_BYTES))
    assert err.value.reason == "blank"


@pytest.mark.parametrize("pos", range(0, fmt.HEADER_USED, 3))
def test_every_flipped_header_byte_is_detected(pos: int) -> None:
    """A bit flipped anywhere in the used header bytes never decodes as a valid header."""
    block = encoded(header())
    block[pos] ^= 0x10
    with pytest.raises(CorruptChunk) as err:
        fmt.decode_header(block)
    assert err.value.reason in {"magic", "version", "header_checksum"}
    assert isinstance(err.value, StorageError) and err.value.code == "storage_error"


def test_torn_header_is_detected() -> None:
    """Only the first 512 bytes of a header block reached the disk (a torn write)."""
    block = encoded(header())
    torn = bytes(block[:100]) + bytes(fmt.HEADER_BYTES - 100)
    with pytest.raises(CorruptChunk) as err:
        fmt.decode_header(torn)
    assert err.value.reason == "header_checksum"


def test_other_version_is_refused() -> None:
    block = encoded(header())
    block[8] = fmt.FORMAT_VERSION + 1
    with pytest.raises(CorruptChunk) as err:
        fmt.decode_header(block)
    assert err.value.reason == "version"


def test_inconsistent_geometry_is_not_encoded() -> None:
    with pytest.raises(StorageError):
        encoded(header(slot_bytes=fmt.slot_bytes_for(10_000) + fmt.BLOCK))
    with pytest.raises(StorageError):
        encoded(header(key=bytes(fmt.MAX_KEY_BYTES + 1)))


def test_payload_checksum_catches_one_flipped_bit() -> None:
    payload = bytearray(range(256)) * 40
    h = header(checksum=fmt.payload_checksum(bytes(payload)), part_bytes=5120, num_parts=2)
    fmt.verify_payload(h, memoryview(payload))
    payload[4321] ^= 0x01
    with pytest.raises(CorruptChunk) as err:
        fmt.verify_payload(h, memoryview(payload))
    assert err.value.reason == "payload_checksum"


def test_data_file_names() -> None:
    name = fmt.data_file_name(8192)
    assert fmt.parse_data_file_name(name) == 8192
    for bad in (
        "slots-8193.dat",
        "slots-4096.dat",
        "slots-x.dat",
        "LOCK",
        "slots-8192.tmp",
        "slots-08192.dat",  # would alias slots-8192.dat (the store opens that one)
        "slots-\u0668\u0661\u0669\u0662.dat",  # 8192 in Arabic-Indic digits: int() takes them
    ):
        assert fmt.parse_data_file_name(bad) is None


def test_metadata_files_round_trip_and_refuse_others() -> None:
    fmt.check_format_file(fmt.encode_format_file())
    for bad in (b"", b"{}", b'{"format": "other", "version": 1}', b'{"format":"kvserver-ssd"}'):
        with pytest.raises(StorageError):
            fmt.check_format_file(bad)
    with pytest.raises(StorageError):
        fmt.check_format_file(b'{"format": "kvserver-ssd", "version": 99}')
    specs = [{"model": "m", "block_size": 16}]
    assert fmt.decode_namespaces(fmt.encode_namespaces(specs)) == specs
    with pytest.raises(StorageError):
        fmt.decode_namespaces(b"not json")
