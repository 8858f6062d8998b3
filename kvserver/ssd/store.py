"""Slot files of the SSD tier: positional chunk I/O, O_DIRECT detection, rebuild by scanning.

Runs on the daemon's I/O threads (never on the event loop). Thread-safety: after :meth:`open`,
``write_chunks`` / ``read_chunks`` / ``discard_slots`` may run concurrently from several
threads on *different* slots (positional I/O on shared descriptors; lazily opened files are
guarded by a lock); the caller (the tier, via the pure :class:`~kvserver.ssd.index.SsdIndex`)
guarantees that no two operations touch one slot at once. ``open``/``scan``/``close`` run
alone.

Crash safety (the whole argument; the format is in ``format.py`` and docs/ssd_format.md):

1. A slot is written in two steps: the whole slot with a zeroed header block (the payload;
   consecutive slots of one batch go down in one ``pwritev``), then, once that call returned,
   the header block. The header holds the payload checksum, so a header that decodes and
   passes its own checksum describes a payload that was completely written before it (a
   SIGKILL between the two leaves the zero header: an empty slot).
2. A slot is only reused after :meth:`discard` has zeroed its header block, so a slot being
   rewritten never carries a valid header of an older chunk.
3. A torn header write fails the header checksum and the slot reads as invalid.
4. Every read checks the header against what the index expects and the payload checksum, so
   bytes damaged later (bit rot, a stray writer) are detected and never returned.

Space: a data file is preallocated (fallocate) ahead of the slots being written, in steps of
``ALLOCATE_STEP``, because concurrent O_DIRECT writes into allocated blocks run in parallel
while writes that extend a file or fill holes are serialised by the filesystem (about twice
the bandwidth with 4 threads). Discarded slots keep their blocks while the tier is within its
budget, so a slot is mostly reused in place; :meth:`release_slots` returns the blocks of free
slots the tier no longer needs (punched holes: they read as zeros, an empty slot), and
:meth:`truncate` cuts the unused tail of a file at start-up.

Rebuild (:meth:`scan`, in ``scan.py``) reads one header block per slot that holds data (holes
are skipped with SEEK_DATA), never the payloads, on several threads.

The directory's own files (its lock, FORMAT, the O_DIRECT probe with ``direct="auto"``, the
saved namespaces) are :class:`~kvserver.ssd.directory.SsdDirectory`'s, which the store owns;
without O_DIRECT the store does buffered I/O through the page cache and reports
``io_mode == "buffered"``.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvserver.errors import StorageError
from kvserver.ssd.directory import SsdDirectory
from kvserver.ssd.fileio import FileIO, aligned_buffer, storage_error
from kvserver.ssd.format import (
    HEADER_BYTES,
    ChunkHeader,
    CorruptChunk,
    check_slot,
    data_file_name,
    encode_header,
    parse_data_file_name,
    prepare_slot,
)
from kvserver.ssd.scan import ScanResult, scan_files

#: an aligned zero header block (discards write it; nothing ever writes into it).
_ZERO_ALIGNED = aligned_buffer(HEADER_BYTES)
#: a data file is preallocated this far ahead of its last slot (at least one slot).
ALLOCATE_STEP = 64 << 20
#: most slots written by one pwritev (well under IOV_MAX).
MAX_RUN_SLOTS = 64


class ChunkWrite(NamedTuple):
    """One chunk for :meth:`SlotStore.write_chunks`: its slot, header fields, slot buffer."""

    slot: int
    meta: ChunkHeader
    buf: memoryview


class ChunkRead(NamedTuple):
    """One chunk for :meth:`SlotStore.read_chunks`: its slot, the (ns_id, key, seq) the index
    expects there, and a slot-sized aligned buffer to read into."""

    slot: int
    expect: tuple[str, bytes, int]
    buf: memoryview


class SlotStore:
    """The data files of one SSD directory; see the module docstring."""

    def __init__(
        self,
        directory: str,
        *,
        fileio: FileIO | None = None,
        direct: str = "auto",
        allocate_step: int = ALLOCATE_STEP,
    ):
        self.directory = os.path.abspath(directory)
        #: a data file is preallocated this far ahead (the tier caps it by its capacity)
        self.allocate_step = allocate_step
        self.io = fileio or FileIO()
        self._want_direct = direct != "off"
        self.direct = False
        self._dir = SsdDirectory(self.directory, self.io)
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
        """Create/lock the directory, check its format, decide O_DIRECT
        (:meth:`SsdDirectory.open`). Raises StorageError (with path and errno) if the directory
        cannot be used; then nothing stays open."""
        self.direct = self._dir.open(self._want_direct)

    def close(self) -> None:
        """Close every file and release the directory lock. Idempotent."""
        with self._fds_lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            self.io.close(fd)
        self._dir.close()

    # ------------------------------------------------------------------ files

    def path(self, slot_bytes: int) -> str:
        """The data file of slots of ``slot_bytes``."""
        return os.path.join(self.directory, data_file_name(slot_bytes))

    def fd(self, slot_bytes: int) -> int:
        """The open descriptor of :meth:`path` (opened, and created, on first use)."""
        fd = self._fds.get(slot_bytes)
        if fd is not None:
            return fd
        with self._fds_lock:
            fd = self._fds.get(slot_bytes)
            if fd is None:
                flags = os.O_RDWR | os.O_CREAT | (self.io.O_DIRECT if self.direct else 0)
                fd = self.io.open(self.path(slot_bytes), flags)
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
        """Write one chunk: :meth:`write_chunks` of one, raising its error."""
        (err,) = self.write_chunks(slot_bytes, [ChunkWrite(slot, meta, buf)])
        if err is not None:
            raise err

    def write_chunks(
        self, slot_bytes: int, writes: Sequence[ChunkWrite]
    ) -> list[StorageError | None]:
        """Write chunks into free slots of one data file (crash rule 1): each run of
        consecutive slots in one ``pwritev`` of the whole slots with zeroed header blocks,
        then each chunk's header block once that call returned.

        Each ``buf`` is a slot-sized aligned buffer whose payload area (from HEADER_BYTES)
        holds the parts; ``meta.checksum`` is ignored and computed here. REQUIRES: every slot
        was discarded or never written (crash rule 2), no slot twice. Returns one entry per
        write, in order: None, or the StorageError (path, errno) that failed it; its context
        ``slot_touched`` is False when the slot was not written at all (the space could not
        be allocated), so it needs no discard. A failed run does not stop the others.
        """
        if not writes:
            return []
        path = self.path(slot_bytes)
        headers = [prepare_slot(w.buf, slot_bytes, w.meta) for w in writes]
        errors: list[StorageError | None] = [None] * len(writes)
        try:
            fd = self.fd(slot_bytes)
            self._preallocate(fd, slot_bytes, (max(w.slot for w in writes) + 1) * slot_bytes)
        except OSError as exc:
            return [_write_error(exc, path, touched=False) for _ in writes]
        for run in _runs([w.slot for w in writes]):
            views = [writes[i].buf[:slot_bytes] for i in run]
            try:
                # one call per run allocates its slots (filling holes block by block is slow)
                self._pwritev_all(fd, views, writes[run[0]].slot * slot_bytes)
            except OSError as exc:
                for i in run:
                    errors[i] = _write_error(exc, path, touched=True)
                continue
            for i in run:
                w = writes[i]
                try:
                    encode_header(headers[i], w.buf)  # StorageError: a key that does not fit
                    self._pwrite_all(fd, w.buf[:HEADER_BYTES], w.slot * slot_bytes)
                except OSError as exc:
                    errors[i] = _write_error(exc, path, touched=True)
                except StorageError as exc:
                    exc.context["slot_touched"] = True
                    errors[i] = exc
        return errors

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
                step = max(slot_bytes, self.allocate_step // slot_bytes * slot_bytes)
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

    def _pwritev_all(self, fd: int, views: list[memoryview], offset: int) -> None:
        while views:
            n = self.io.pwritev(fd, views, offset)
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            offset += n
            while views and n >= views[0].nbytes:  # a short write (rare): go on after it
                n -= views[0].nbytes
                views = views[1:]
            if n:
                views[0] = views[0][n:]

    def read_chunk(
        self, slot_bytes: int, slot: int, expect: tuple[str, bytes, int], buf: memoryview
    ) -> ChunkHeader:
        """Read and verify one chunk: :meth:`read_chunks` of one, raising its error."""
        (got,) = self.read_chunks(slot_bytes, [ChunkRead(slot, expect, buf)])
        if isinstance(got, StorageError):
            raise got
        return got

    def read_chunks(
        self, slot_bytes: int, reads: Sequence[ChunkRead]
    ) -> list[ChunkHeader | StorageError]:
        """Read and verify chunks of one data file, each into its ``buf`` (slot-sized,
        aligned; the payload is then at ``buf[HEADER_BYTES:HEADER_BYTES + payload_bytes]``);
        each run of consecutive slots in one system call.

        ``expect`` is (ns_id, key, seq) from the index. One result per read, in order: the
        verified header, a :class:`CorruptChunk` if the header is invalid, names another chunk
        or the payload checksum fails, or a StorageError (path, errno) on an OS error.
        """
        path = self.path(slot_bytes)
        out: list[ChunkHeader | StorageError] = [StorageError("not read")] * len(reads)
        for run in _runs([r.slot for r in reads]):
            views = [reads[i].buf[:slot_bytes] for i in run]
            base = reads[run[0]].slot * slot_bytes
            try:
                fd = self.fd(slot_bytes)
                if len(views) == 1:
                    n = self.io.pread_into(fd, views[0], base)
                else:
                    n = self.io.preadv_into(fd, views, base)
            except OSError as exc:
                for i in run:
                    out[i] = storage_error("cannot read a chunk", exc, path)
                continue
            for k, i in enumerate(run):
                got = max(0, min(slot_bytes, n - k * slot_bytes))
                r = reads[i]
                try:
                    out[i] = check_slot(r.buf, slot_bytes, got, r.expect, path=path, slot=r.slot)
                except CorruptChunk as bad:
                    out[i] = bad
        return out

    def discard(self, slot_bytes: int, slot: int) -> None:
        """Invalidate a slot so it can be reused (crash rule 2): zero its header block."""
        (err,) = self.discard_slots([(slot_bytes, slot)])
        if err is not None:
            raise err

    def discard_slots(self, slots: Sequence[tuple[int, int]]) -> list[StorageError | None]:
        """:meth:`discard` of each (slot_bytes, slot); one result per slot, in order: None or
        the StorageError that failed it (the others are still discarded)."""
        errors: list[StorageError | None] = []
        for slot_bytes, slot in slots:
            try:
                self._pwrite_all(self.fd(slot_bytes), _ZERO_ALIGNED, slot * slot_bytes)
                errors.append(None)
            except OSError as exc:
                errors.append(storage_error("cannot discard a slot", exc, self.path(slot_bytes)))
        return errors

    def release_slots(self, slot_bytes: int, slots: Sequence[int]) -> list[StorageError | None]:
        """Return the disk blocks of free slots to the filesystem (:meth:`FileIO.punch`; each
        run of consecutive slots in one call): they then read as zeros, an empty slot. One
        result per slot, in order: None, or the StorageError that kept its blocks (errno
        EOPNOTSUPP where the filesystem cannot punch holes). REQUIRES: the slots were
        discarded and nothing reads or writes them meanwhile."""
        path = self.path(slot_bytes)
        out: list[StorageError | None] = [None] * len(slots)
        for run in _runs(slots):
            try:
                first = slots[run[0]] * slot_bytes
                if self.io.punch(self.fd(slot_bytes), first, len(run) * slot_bytes):
                    continue
                exc = OSError(errno.EOPNOTSUPP, "the filesystem cannot punch holes")
            except OSError as error:
                exc = error
            for i in run:
                out[i] = storage_error("cannot release a slot's disk space", exc, path)
        return out

    def truncate(self, slot_bytes: int, num_slots: int) -> None:
        """Cut a data file to ``num_slots`` slots; a file cut to 0 is removed. REQUIRES: no
        I/O in flight on the file (start-up)."""
        path = self.path(slot_bytes)
        try:
            with self._alloc_lock:
                self._allocated.pop(slot_bytes, None)
            if num_slots:
                self.io.truncate(self.fd(slot_bytes), num_slots * slot_bytes)
                return
            with self._fds_lock:
                fd = self._fds.pop(slot_bytes, None)
            if fd is not None:
                self.io.close(fd)
            self.io.unlink(path)
        except OSError as exc:
            raise storage_error("cannot truncate a data file", exc, path) from None

    # ------------------------------------------------------------------ rebuild

    def scan(self, workers: int = 8, blank_within: int | None = None) -> ScanResult:
        """Read the header of every slot holding data, in every data file (not the payloads),
        on ``workers`` threads (``scan.py``). Blank slots are left out; slots with an invalid
        header are listed in ``invalid``; blank slots holding disk blocks in ``blank``, those
        within the first ``blank_within`` bytes of their file only (None: all). Results are in
        (file, slot) order."""
        return scan_files(self, workers, blank_within)

    # ------------------------------------------------------------------ namespaces

    def load_namespaces(self) -> list[dict[str, Any]]:
        """The namespace specs saved with the data ([] if none were saved yet)."""
        return self._dir.load_namespaces()

    def save_namespaces(self, specs: list[dict[str, Any]]) -> None:
        """Replace the namespaces file atomically (temp + fsync + rename + fsync dir)."""
        self._dir.save_namespaces(specs)

    def directory_lost(self) -> str:
        """Why the directory's path no longer leads to the directory opened, or ""
        (:meth:`SsdDirectory.lost`)."""
        return self._dir.lost()


def _runs(slots: Sequence[int]) -> list[list[int]]:
    """Indexes of ``slots`` grouped into runs of consecutive slots (at most MAX_RUN_SLOTS)."""
    runs: list[list[int]] = []
    for i in sorted(range(len(slots)), key=slots.__getitem__):
        run = runs[-1] if runs else None
        if run and len(run) < MAX_RUN_SLOTS and slots[run[-1]] + 1 == slots[i]:
            run.append(i)
        else:
            runs.append([i])
    return runs


def _write_error(exc: OSError, path: str, *, touched: bool) -> StorageError:
    err = storage_error("cannot write a chunk", exc, path)
    err.context["slot_touched"] = touched  # False: nothing reached the slot
    return err
