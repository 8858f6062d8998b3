"""Slot files of the SSD tier: positional chunk I/O, O_DIRECT detection, rebuild by scanning.

Runs on the daemon's I/O threads (never on the event loop). Thread-safety: after :meth:`open`,
``write_chunk`` / ``read_chunk`` / ``discard`` may run concurrently from several threads on
*different* slots (positional I/O on shared descriptors; lazily opened files are guarded by a
lock); the caller (the tier, via the pure :class:`~kvserver.ssd.index.SsdIndex`) guarantees
that no two operations touch one slot at once. ``open``/``scan``/``close`` run alone.

Crash safety (the whole argument; the format is in ``format.py`` and docs/ssd_format.md):

1. A slot is written in two system calls: the whole slot with a zeroed header block (the
   payload), then the header block. The header holds the payload checksum, so a header that
   decodes and passes its own checksum describes a payload that was completely written before
   it (a SIGKILL between the two leaves the zero header: an empty slot).
2. A slot is only reused after :meth:`discard` has zeroed its header block, so a slot being
   rewritten never carries a valid header of an older chunk.
3. A torn header write fails the header checksum and the slot reads as invalid.
4. Every read checks the header against what the index expects and the payload checksum, so
   bytes damaged later (bit rot, a stray writer) are detected and never returned.

Space: a data file is preallocated (fallocate) ahead of the slots being written, in steps of
``ALLOCATE_STEP``, because concurrent O_DIRECT writes into allocated blocks run in parallel
while writes that extend a file or fill holes are serialised by the filesystem (about twice
the bandwidth with 4 threads). Discarded slots keep their blocks (a cache of fixed budget);
:meth:`truncate` returns the unused tail of a file at start-up.

Rebuild (:meth:`scan`) reads one header block per slot that holds data (holes are skipped with
SEEK_DATA), never the payloads, on several threads (a 4 KiB read is latency bound).

O_DIRECT: with ``direct="auto"`` :meth:`open` probes the directory (open with O_DIRECT, write
and read back one aligned block). If the filesystem refuses (EINVAL: some tmpfs, overlay and
network filesystems) the store falls back to buffered I/O through the page cache, logs it and
reports ``io_mode == "buffered"``; the format and the crash argument are the same.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvserver.errors import StorageError
from kvserver.ssd.fileio import FileIO, aligned_buffer
from kvserver.ssd.format import (
    BLOCK,
    FORMAT_FILE,
    HEADER_BYTES,
    LOCK_FILE,
    NAMESPACES_FILE,
    PROBE_FILE,
    ChunkHeader,
    CorruptChunk,
    check_format_file,
    data_file_name,
    decode_header,
    decode_namespaces,
    encode_format_file,
    encode_header,
    encode_namespaces,
    parse_data_file_name,
    payload_checksum,
    verify_payload,
)

logger = logging.getLogger(__name__)

_ZERO_BLOCK = bytes(HEADER_BYTES)
#: a data file is preallocated this far ahead of its last slot (at least one slot).
ALLOCATE_STEP = 64 << 20


def storage_error(what: str, exc: OSError, path: str) -> StorageError:
    """``exc`` as a StorageError carrying the path, errno and its symbolic name."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, str(code))
    return StorageError(f"{what}: {exc.strerror or exc} ({name})", path=path, errno=code)


@dataclass(frozen=True, slots=True)
class ScannedSlot:
    slot_bytes: int
    slot: int
    header: ChunkHeader


@dataclass(slots=True)
class ScanResult:
    """What :meth:`SlotStore.scan` found: valid headers, damaged slots, file extents."""

    chunks: list[ScannedSlot] = field(default_factory=list)
    #: non-blank slots whose header is invalid (torn, flipped, wrong version): to discard.
    invalid: list[tuple[int, int]] = field(default_factory=list)
    #: slots per data file (its length in slots), by slot size.
    num_slots: dict[int, int] = field(default_factory=dict)
    headers_read: int = 0


class SlotStore:
    """The data files of one SSD directory; see the module docstring."""

    def __init__(self, directory: str, *, fileio: FileIO | None = None, direct: str = "auto"):
        self.directory = os.path.abspath(directory)
        self.io = fileio or FileIO()
        self._want_direct = direct != "off"
        self.direct = False
        self._lock_fd = -1
        self._fds: dict[int, int] = {}
        self._fds_lock = threading.Lock()
        #: bytes known allocated per data file (-1: the filesystem cannot preallocate)
        self._allocated: dict[int, int] = {}
        self._alloc_lock = threading.Lock()

    # ------------------------------------------------------------------ lifetime

    @property
    def io_mode(self) -> str:
        return "direct" if self.direct else "buffered"

    def open(self) -> None:
        """Create/lock the directory, check its format, decide O_DIRECT. Raises StorageError
        (with path and errno) if the directory cannot be used; then nothing stays open."""
        io, d = self.io, self.directory
        try:
            io.makedirs(d)
            self._lock_fd = io.open(os.path.join(d, LOCK_FILE), os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise storage_error("cannot open the SSD directory", exc, d) from None
        try:
            io.lock(self._lock_fd)
        except OSError:
            self.close()
            raise StorageError("SSD directory is in use by another daemon", path=d) from None
        try:
            self._check_format()
            self.direct = self._want_direct and self._probe_direct()
        except BaseException:
            self.close()
            raise

    def _check_format(self) -> None:
        path = os.path.join(self.directory, FORMAT_FILE)
        try:
            check_format_file(self.io.read_file(path))
            return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error("cannot read the FORMAT file", exc, path) from None
        try:
            self.io.write_file_atomic(path, encode_format_file())
        except OSError as exc:
            raise storage_error("cannot write the FORMAT file", exc, path) from None

    def _probe_direct(self) -> bool:
        """True if O_DIRECT works here (aligned write + read back of one block)."""
        io, path = self.io, os.path.join(self.directory, PROBE_FILE)
        if not io.O_DIRECT:
            return False
        try:
            fd = io.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | io.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise storage_error("cannot create a file in the SSD directory", exc, path) from exc
            logger.info("O_DIRECT refused by the filesystem of %s: buffered I/O", self.directory)
            return False
        try:
            buf = aligned_buffer(BLOCK)
            buf[:8] = b"kvprobe!"
            io.pwrite(fd, buf, 0)
            back = aligned_buffer(BLOCK)
            io.pread_into(fd, back, 0)
            ok = bytes(back[:8]) == b"kvprobe!"
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise storage_error("cannot write to the SSD directory", exc, path) from None
            logger.info("O_DIRECT I/O fails on %s (EINVAL): buffered I/O", self.directory)
            ok = False
        finally:
            io.close(fd)
            with contextlib.suppress(OSError):
                io.unlink(path)
        return ok

    def close(self) -> None:
        """Close every file and release the directory lock. Idempotent."""
        with self._fds_lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            self.io.close(fd)
        if self._lock_fd >= 0:
            self.io.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------------ files

    def _path(self, slot_bytes: int) -> str:
        return os.path.join(self.directory, data_file_name(slot_bytes))

    def _fd(self, slot_bytes: int) -> int:
        fd = self._fds.get(slot_bytes)
        if fd is not None:
            return fd
        with self._fds_lock:
            fd = self._fds.get(slot_bytes)
            if fd is None:
                flags = os.O_RDWR | os.O_CREAT | (self.io.O_DIRECT if self.direct else 0)
                fd = self.io.open(self._path(slot_bytes), flags)
                self._fds[slot_bytes] = fd
            return fd

    def data_files(self) -> dict[int, str]:
        """Existing data files by slot size."""
        out: dict[int, str] = {}
        try:
            names = self.io.listdir(self.directory)
        except OSError as exc:
            raise storage_error("cannot list the SSD directory", exc, self.directory) from None
        for name in names:
            size = parse_data_file_name(name)
            if size is not None:
                out[size] = os.path.join(self.directory, name)
        return out

    # ------------------------------------------------------------------ chunk I/O

    def write_chunk(self, slot_bytes: int, slot: int, meta: ChunkHeader, buf: memoryview) -> None:
        """Write one chunk into a free slot: the slot with a zero header, then the header
        (crash rule 1).

        ``buf`` is a slot-sized aligned buffer whose payload area (from HEADER_BYTES) holds the
        parts; ``meta.checksum`` is ignored and computed here. REQUIRES: the slot was
        discarded or never written (crash rule 2). Raises StorageError on any OS error; its
        context ``slot_touched`` is False when the slot was not written at all (the space
        could not be allocated), so it needs no discard.
        """
        payload = meta.payload_bytes
        buf[:HEADER_BYTES] = _ZERO_BLOCK
        buf[HEADER_BYTES + payload : slot_bytes] = bytes(slot_bytes - HEADER_BYTES - payload)
        checksum = payload_checksum(buf[HEADER_BYTES : HEADER_BYTES + payload])
        header = ChunkHeader(
            meta.ns_id, meta.key, meta.seq, slot_bytes, meta.part_bytes, meta.num_parts, checksum
        )
        path, base = self._path(slot_bytes), slot * slot_bytes
        touched = False
        try:
            fd = self._fd(slot_bytes)
            self._preallocate(fd, slot_bytes, base + slot_bytes)
            touched = True
            # one write allocates the whole slot (filling a hole block by block is slow)
            self._pwrite_all(fd, buf[:slot_bytes], base)
            encode_header(header, buf)
            self._pwrite_all(fd, buf[:HEADER_BYTES], base)
        except OSError as exc:
            err = storage_error("cannot write a chunk", exc, path)
            err.context["slot_touched"] = touched  # False: nothing reached the slot
            raise err from None

    def _preallocate(self, fd: int, slot_bytes: int, end: int) -> None:
        """Make sure ``[0, end)`` of the file is allocated, growing it by ALLOCATE_STEP."""
        known = self._allocated.get(slot_bytes, 0)
        if known < 0 or end <= known:
            return
        with self._alloc_lock:
            known = self._allocated.get(slot_bytes, 0)
            if known < 0 or end <= known:
                return
            known = max(known, self.io.size(fd))
            if end > known:
                step = max(slot_bytes, ALLOCATE_STEP // slot_bytes * slot_bytes)
                target = max(end, known + step)
                try:
                    supported = self.io.allocate(fd, known, target - known)
                except OSError as exc:  # no room for a whole step: just this slot, or fail
                    if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                        raise
                    target = end
                    supported = self.io.allocate(fd, known, target - known)
                if not supported:
                    self._allocated[slot_bytes] = -1
                    return
                known = target
            self._allocated[slot_bytes] = known

    def _pwrite_all(self, fd: int, view: memoryview, offset: int) -> None:
        while view:
            n = self.io.pwrite(fd, view, offset)
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view, offset = view[n:], offset + n

    def read_chunk(
        self, slot_bytes: int, slot: int, expect: tuple[str, bytes, int], buf: memoryview
    ) -> ChunkHeader:
        """Read and verify one chunk into ``buf`` (slot-sized, aligned); the payload is then at
        ``buf[HEADER_BYTES:HEADER_BYTES + header.payload_bytes]``.

        ``expect`` is (ns_id, key, seq) from the index. Raises :class:`CorruptChunk` if the
        header is invalid, names another chunk or the payload checksum fails; StorageError on
        an OS error.
        """
        path = self._path(slot_bytes)
        try:
            n = self.io.pread_into(self._fd(slot_bytes), buf[:slot_bytes], slot * slot_bytes)
        except OSError as exc:
            raise storage_error("cannot read a chunk", exc, path) from None
        if n < HEADER_BYTES:
            raise CorruptChunk("geometry", "slot is truncated", path=path, slot=slot)
        header = decode_header(buf[:HEADER_BYTES])
        if (header.ns_id, header.key, header.seq) != expect or header.slot_bytes != slot_bytes:
            raise CorruptChunk("mismatch", "slot holds another chunk", path=path, slot=slot)
        if n < HEADER_BYTES + header.payload_bytes:
            raise CorruptChunk("geometry", "slot is truncated", path=path, slot=slot)
        verify_payload(header, buf[HEADER_BYTES:])
        return header

    def discard(self, slot_bytes: int, slot: int) -> None:
        """Invalidate a slot so it can be reused (crash rule 2): zero its header block."""
        path = self._path(slot_bytes)
        try:
            self._pwrite_all(self._fd(slot_bytes), aligned_buffer(HEADER_BYTES), slot * slot_bytes)
        except OSError as exc:
            raise storage_error("cannot discard a slot", exc, path) from None

    def truncate(self, slot_bytes: int, num_slots: int) -> None:
        """Cut a data file to ``num_slots`` slots; a file cut to 0 is removed. REQUIRES: no
        I/O in flight on the file (start-up)."""
        path = self._path(slot_bytes)
        try:
            with self._alloc_lock:
                self._allocated.pop(slot_bytes, None)
            if num_slots:
                self.io.truncate(self._fd(slot_bytes), num_slots * slot_bytes)
                return
            with self._fds_lock:
                fd = self._fds.pop(slot_bytes, None)
            if fd is not None:
                self.io.close(fd)
            self.io.unlink(path)
        except OSError as exc:
            raise storage_error("cannot truncate a data file", exc, path) from None

    # ------------------------------------------------------------------ rebuild

    def scan(self, workers: int = 8) -> ScanResult:
        """Read the header of every slot holding data, in every data file (not the payloads),
        on ``workers`` threads. Blank slots are left out; slots with an invalid header are
        listed in ``invalid``. Results are in (file, slot) order."""
        result = ScanResult()
        jobs: list[tuple[int, int, int]] = []  # (slot_bytes, first slot, end slot)
        for slot_bytes, path in sorted(self.data_files().items()):
            try:
                size = self.io.size(self._fd(slot_bytes))
            except OSError as exc:
                raise storage_error("cannot open a data file", exc, path) from None
            num = -(-size // slot_bytes)
            result.num_slots[slot_bytes] = num
            step = max(256, -(-num // workers))
            jobs += [(slot_bytes, lo, min(num, lo + step)) for lo in range(0, num, step)]
        with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
            for part in pool.map(lambda job: self._scan_range(*job), jobs):
                result.chunks += part.chunks
                result.invalid += part.invalid
                result.headers_read += part.headers_read
        return result

    def _scan_range(self, slot_bytes: int, lo: int, hi: int) -> ScanResult:
        out = ScanResult()
        block = aligned_buffer(HEADER_BYTES)
        path = self._path(slot_bytes)
        try:
            fd = self._fd(slot_bytes)
            pos = lo * slot_bytes
            while pos < hi * slot_bytes:
                data = self.io.seek_data(fd, pos)
                if data is None or data >= hi * slot_bytes:
                    break
                slot = data // slot_bytes
                pos = (slot + 1) * slot_bytes
                n = self.io.pread_into(fd, block, slot * slot_bytes)
                out.headers_read += 1
                try:
                    if n < HEADER_BYTES:
                        raise CorruptChunk("geometry")
                    header = decode_header(block)
                except CorruptChunk as bad:
                    if bad.reason != "blank":
                        out.invalid.append((slot_bytes, slot))
                    continue
                if header.slot_bytes != slot_bytes:
                    out.invalid.append((slot_bytes, slot))
                    continue
                out.chunks.append(ScannedSlot(slot_bytes, slot, header))
        except OSError as exc:
            raise storage_error("cannot scan a data file", exc, path) from None
        return out

    # ------------------------------------------------------------------ namespaces

    def load_namespaces(self) -> list[dict[str, Any]]:
        """The namespace specs saved with the data ([] if none were saved yet)."""
        path = os.path.join(self.directory, NAMESPACES_FILE)
        try:
            return decode_namespaces(self.io.read_file(path))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise storage_error("cannot read the namespaces file", exc, path) from None

    def save_namespaces(self, specs: list[dict[str, Any]]) -> None:
        """Replace the namespaces file atomically (temp + fsync + rename + fsync dir)."""
        path = os.path.join(self.directory, NAMESPACES_FILE)
        try:
            self.io.write_file_atomic(path, encode_namespaces(specs))
        except OSError as exc:
            raise storage_error("cannot write the namespaces file", exc, path) from None
