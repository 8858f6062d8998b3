"""Rebuild by scanning: the header of every slot holding data in an SSD directory's data files.

Runs once at start-up, on an I/O thread of the daemon (``SsdTier.open`` → ``SlotStore.scan``),
alone: no other I/O runs on the store meanwhile. The scan reads on ``workers`` threads of its
own (a 4 KiB read is latency bound): one header block per slot that holds data (holes and
preallocated space are skipped with SEEK_DATA), never a payload.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvserver.ssd.fileio import FileIO, aligned_buffer, storage_error
from kvserver.ssd.format import HEADER_BYTES, ChunkHeader, CorruptChunk, decode_header


class SlotFiles(Protocol):
    """What a scan reads: the data files of a directory (``store.SlotStore`` is one)."""

    @property
    def io(self) -> FileIO: ...

    def data_files(self) -> dict[int, str]: ...

    def fd(self, slot_bytes: int) -> int: ...

    def path(self, slot_bytes: int) -> str: ...


@dataclass(frozen=True, slots=True)
class ScannedSlot:
    slot_bytes: int
    slot: int
    header: ChunkHeader


@dataclass(slots=True)
class ScanResult:
    """What :func:`scan_files` found: valid headers, damaged slots, file extents."""

    chunks: list[ScannedSlot] = field(default_factory=list)
    #: non-blank slots whose header is invalid (torn, flipped, wrong version): to discard.
    invalid: list[tuple[int, int]] = field(default_factory=list)
    #: slots holding disk blocks under an all-zero header (discarded): spare, if listed.
    blank: list[tuple[int, int]] = field(default_factory=list)
    #: slots per data file (its length in slots), by slot size.
    num_slots: dict[int, int] = field(default_factory=dict)
    headers_read: int = 0


def scan_files(store: SlotFiles, workers: int, blank_within: int | None = None) -> ScanResult:
    """See :meth:`SlotStore.scan`. Raises StorageError (path, errno) on an OS error."""
    result = ScanResult()
    jobs: list[tuple[int, int, int]] = []  # (slot_bytes, first slot, end slot)
    for slot_bytes, path in sorted(store.data_files().items()):
        try:
            size = store.io.size(store.fd(slot_bytes))
        except OSError as exc:
            raise storage_error("cannot open a data file", exc, path) from None
        num = -(-size // slot_bytes)
        result.num_slots[slot_bytes] = num
        step = max(256, -(-num // workers))
        jobs += [(slot_bytes, lo, min(num, lo + step)) for lo in range(0, num, step)]
    with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
        for part in pool.map(lambda j: _scan_range(store, j[0], j[1], j[2], blank_within), jobs):
            result.chunks += part.chunks
            result.invalid += part.invalid
            result.blank += part.blank
            result.headers_read += part.headers_read
    return result


def _scan_range(
    store: SlotFiles, slot_bytes: int, lo: int, hi: int, blank_within: int | None
) -> ScanResult:
    out = ScanResult()
    block = aligned_buffer(HEADER_BYTES)
    path = store.path(slot_bytes)
    try:
        fd = store.fd(slot_bytes)
        pos = lo * slot_bytes
        while pos < hi * slot_bytes:
            data = store.io.seek_data(fd, pos)
            if data is None or data >= hi * slot_bytes:
                break
            slot = data // slot_bytes
            pos = (slot + 1) * slot_bytes
            n = store.io.pread_into(fd, block, slot * slot_bytes)
            out.headers_read += 1
            try:
                if n < HEADER_BYTES:
                    raise CorruptChunk("geometry")
                header = decode_header(block)
            except CorruptChunk as bad:
                if bad.reason != "blank":
                    out.invalid.append((slot_bytes, slot))
                elif blank_within is None or (slot + 1) * slot_bytes <= blank_within:
                    out.blank.append((slot_bytes, slot))  # (a huge file of zeros: not listed)
                continue
            if header.slot_bytes != slot_bytes:
                out.invalid.append((slot_bytes, slot))
                continue
            out.chunks.append(ScannedSlot(slot_bytes, slot, header))
    except OSError as exc:
        raise storage_error("cannot scan a data file", exc, path) from None
    return out
