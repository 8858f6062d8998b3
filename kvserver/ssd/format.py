"""The SSD tier's on-disk format: every constant, the chunk header, checksums, file names.

The one module that knows the byte layout (described for humans in ``docs/ssd_format.md``);
the store (``store.py``) reads and writes through it, the tests and the benchmark parse files
with it. Pure functions over buffers: no I/O, no state, safe from any thread.

A data file ``slots-<slot_bytes>.dat`` is an array of fixed-size slots; one slot holds one
logical chunk (every TP part)::

    slot  = header block (HEADER_BYTES) | payload (parts concatenated, rank order) | zero pad
    slot_bytes = HEADER_BYTES + align_up(num_parts * part_bytes, BLOCK)

The header carries the format version, the namespace id, the chunk key, the geometry, a write
sequence number, an xxh3-128 checksum of the payload and an xxh3-64 checksum of the header
itself. An all-zero header block (a hole, or a slot invalidated before reuse) is an empty slot.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from kvserver.errors import StorageError

#: format version of chunk headers and of the directory (FORMAT file).
FORMAT_VERSION = 1
#: first bytes of every valid chunk header.
MAGIC = b"KVSRVSSD"
#: I/O alignment: offsets, lengths and buffer addresses of O_DIRECT I/O are multiples of it
#: (4 KiB covers devices with 512 B and 4 KiB logical blocks).
BLOCK = 4096
#: the header occupies one whole block, so the payload that follows is aligned too.
HEADER_BYTES = BLOCK
#: longest chunk key (the wire allows 64 bytes; sha256 keys are 32, xxhash keys 16).
MAX_KEY_BYTES = 64
#: namespace ids are 16 hex characters (kvserver.namespace.NamespaceSpec.ns_id).
NS_ID_BYTES = 16
#: largest valid sequence number. A rebuilt index continues after the largest one it finds,
#: so a (forged) header near 2**64 would leave no number that fits the 8-byte field for the
#: next write: such a header is invalid (``geometry``). 2**63 writes never run out.
MAX_SEQ = (1 << 63) - 1

#: directory entries
LOCK_FILE = "LOCK"
FORMAT_FILE = "FORMAT"
NAMESPACES_FILE = "namespaces.json"
PROBE_FILE = ".probe"
DATA_PREFIX = "slots-"
DATA_SUFFIX = ".dat"

# magic, version, header_len, flags, seq, slot_bytes, payload_bytes, part_bytes, num_parts,
# key_len, reserved, ns_id, key, payload checksum (xxh3-128, little endian)
_BODY = struct.Struct("<8sHHIQQQQIHH16s64s16s")
_CHECK = struct.Struct("<Q")  # header checksum (xxh3-64 of the body)
HEADER_USED = _BODY.size + _CHECK.size  # 160 bytes; the rest of the block is zero
_HEADER_PAD = bytes(HEADER_BYTES - HEADER_USED)
_ZERO_BLOCK = memoryview(bytes(HEADER_BYTES))


class CorruptChunk(StorageError):
    """A slot's bytes are not a valid chunk; ``reason`` says which check failed.

    Reasons: ``blank`` (an empty slot, not an error on its own), ``magic``, ``version``,
    ``header_checksum``, ``geometry``, ``mismatch`` (a valid header of another chunk),
    ``payload_checksum``.
    """

    def __init__(self, reason: str, message: str = "", **context: Any) -> None:
        super().__init__(message or f"corrupt chunk: {reason}", reason=reason, **context)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """The decoded header of one slot. ``checksum`` is the payload's xxh3-128 digest."""

    ns_id: str
    key: bytes
    seq: int
    slot_bytes: int
    part_bytes: int
    num_parts: int
    checksum: int

    @property
    def payload_bytes(self) -> int:
        return self.part_bytes * self.num_parts


def align_up(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


def slot_bytes_for(payload_bytes: int) -> int:
    """Size of the slot that holds a chunk of ``payload_bytes`` (header + aligned payload)."""
    return HEADER_BYTES + align_up(payload_bytes)


def data_file_name(slot_bytes: int) -> str:
    return f"{DATA_PREFIX}{slot_bytes}{DATA_SUFFIX}"


def parse_data_file_name(name: str) -> int | None:
    """The slot size encoded in a data file name, or None if ``name`` is not a data file
    (only the name :func:`data_file_name` gives: the store opens that one)."""
    if not (name.startswith(DATA_PREFIX) and name.endswith(DATA_SUFFIX)):
        return None
    digits = name[len(DATA_PREFIX) : -len(DATA_SUFFIX)]
    if not (digits.isascii() and digits.isdigit()):
        return None
    size = int(digits)
    if size <= HEADER_BYTES or size % BLOCK or data_file_name(size) != name:
        return None  # "slots-08192.dat" would alias the file the store opens for 8192
    return size


def payload_checksum(payload: memoryview | bytes) -> int:
    """xxh3-128 of the payload bytes (the parts concatenated, without padding)."""
    return int(xxhash.xxh3_128_intdigest(payload))


def encode_header(h: ChunkHeader, out: memoryview) -> None:
    """Write ``h`` into ``out[:HEADER_BYTES]`` (the rest of the block is zeroed).

    REQUIRES: the geometry is consistent (checked: StorageError otherwise).
    """
    if len(h.key) > MAX_KEY_BYTES or len(h.ns_id) != NS_ID_BYTES or not 0 < h.seq <= MAX_SEQ:
        raise StorageError(
            "chunk key, namespace id or sequence number does not fit the header", key=h.key
        )
    if slot_bytes_for(h.payload_bytes) != h.slot_bytes:
        raise StorageError("slot size does not match the payload", slot_bytes=h.slot_bytes)
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_USED,
        0,
        h.seq,
        h.slot_bytes,
        h.payload_bytes,
        h.part_bytes,
        h.num_parts,
        len(h.key),
        0,
        h.ns_id.encode("ascii"),
        h.key,
        h.checksum.to_bytes(16, "little"),
    )
    block = out[:HEADER_BYTES]
    block[: _BODY.size] = body
    block[_BODY.size : HEADER_USED] = _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    block[HEADER_USED:] = _HEADER_PAD


def decode_header(block: memoryview | bytes) -> ChunkHeader:
    """Parse and check a header block; raises :class:`CorruptChunk` (``reason="blank"`` for
    an empty slot). Checks: magic, version, header checksum, geometry (including a sequence
    number in 1..MAX_SEQ)."""
    view = memoryview(block)[:HEADER_USED]
    if len(view) < HEADER_USED:
        raise CorruptChunk("geometry", "short header block")
    if view[:8] != MAGIC:
        if not any(view):
            raise CorruptChunk("blank")
        raise CorruptChunk("magic")
    (
        _magic,
        version,
        header_len,
        _flags,
        seq,
        slot_bytes,
        payload_bytes,
        part_bytes,
        num_parts,
        key_len,
        _reserved,
        ns_raw,
        key_raw,
        checksum_raw,
    ) = _BODY.unpack(view[: _BODY.size])
    if version != FORMAT_VERSION:
        raise CorruptChunk("version", f"unsupported chunk header version {version}")
    (stored,) = _CHECK.unpack(view[_BODY.size : HEADER_USED])
    if stored != xxhash.xxh3_64_intdigest(view[: _BODY.size]):
        raise CorruptChunk("header_checksum")
    if (
        header_len != HEADER_USED
        or not 0 < seq <= MAX_SEQ
        or not 0 < key_len <= MAX_KEY_BYTES
        or num_parts < 1
        or part_bytes < 1
        or payload_bytes != part_bytes * num_parts
        or slot_bytes != slot_bytes_for(payload_bytes)
    ):
        raise CorruptChunk("geometry")
    try:
        ns_id = ns_raw.decode("ascii")
    except UnicodeDecodeError:
        raise CorruptChunk("geometry", "namespace id is not ASCII") from None
    return ChunkHeader(
        ns_id=ns_id,
        key=bytes(key_raw[:key_len]),
        seq=seq,
        slot_bytes=slot_bytes,
        part_bytes=part_bytes,
        num_parts=num_parts,
        checksum=int.from_bytes(checksum_raw, "little"),
    )


def verify_payload(h: ChunkHeader, payload: memoryview) -> None:
    """Raise :class:`CorruptChunk` (``payload_checksum``) unless the payload matches."""
    if payload_checksum(payload[: h.payload_bytes]) != h.checksum:
        raise CorruptChunk("payload_checksum", ns=h.ns_id, key=h.key)


def prepare_slot(buf: memoryview, slot_bytes: int, meta: ChunkHeader) -> ChunkHeader:
    """Make ``buf`` (a slot whose payload area holds the parts) ready for its first write:
    zero its header block and its padding. Returns ``meta`` with the slot size and the
    payload checksum, the header to write once the slot is on disk."""
    payload = meta.payload_bytes
    buf[:HEADER_BYTES] = _ZERO_BLOCK
    buf[HEADER_BYTES + payload : slot_bytes] = _ZERO_BLOCK[: slot_bytes - HEADER_BYTES - payload]
    checksum = payload_checksum(buf[HEADER_BYTES : HEADER_BYTES + payload])
    return ChunkHeader(
        meta.ns_id, meta.key, meta.seq, slot_bytes, meta.part_bytes, meta.num_parts, checksum
    )


def check_slot(
    buf: memoryview,
    slot_bytes: int,
    nbytes: int,
    expect: tuple[str, bytes, int],
    **context: Any,
) -> ChunkHeader:
    """Check a slot read into ``buf`` (``nbytes`` of it were read): a valid header naming the
    (ns_id, key, seq) the index ``expect``s in a slot of this size, a complete payload that
    matches its checksum. Raises :class:`CorruptChunk` (with ``context``) otherwise."""
    if nbytes < HEADER_BYTES:
        raise CorruptChunk("geometry", "slot is truncated", **context)
    header = decode_header(buf[:HEADER_BYTES])
    if (header.ns_id, header.key, header.seq) != expect or header.slot_bytes != slot_bytes:
        raise CorruptChunk("mismatch", "slot holds another chunk", **context)
    if nbytes < HEADER_BYTES + header.payload_bytes:
        raise CorruptChunk("geometry", "slot is truncated", **context)
    verify_payload(header, buf[HEADER_BYTES:])
    return header


# ---------------------------------------------------------------------- directory metadata


def encode_format_file() -> bytes:
    return json.dumps({"format": "kvserver-ssd", "version": FORMAT_VERSION}).encode() + b"\n"


def check_format_file(data: bytes) -> None:
    """Raise StorageError unless ``data`` names a directory format this build can read."""
    try:
        obj = json.loads(data)
        ok = obj["format"] == "kvserver-ssd"
        version = int(obj["version"])
    except (ValueError, KeyError, TypeError, OverflowError):  # Overflow: "version": 1e999
        raise StorageError("not a kvserver SSD directory (bad FORMAT file)") from None
    if not ok or version != FORMAT_VERSION:
        raise StorageError("unsupported SSD directory format", version=version)


def encode_namespaces(specs: list[dict[str, Any]]) -> bytes:
    """The namespaces file: the full specs (``NamespaceSpec.to_dict()``), versioned."""
    doc = {"version": FORMAT_VERSION, "namespaces": specs}
    return json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n"


def decode_namespaces(data: bytes) -> list[dict[str, Any]]:
    try:
        doc = json.loads(data)
        if doc["version"] != FORMAT_VERSION or not isinstance(doc["namespaces"], list):
            raise ValueError("version")
    except (ValueError, KeyError, TypeError):
        raise StorageError("unreadable namespaces file") from None
    return [s for s in doc["namespaces"] if isinstance(s, dict)]
