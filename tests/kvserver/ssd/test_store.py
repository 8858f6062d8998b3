"""kvserver/ssd/store.py: byte-exact chunk I/O, rebuild by header scan only, crash and fault cases
injected through the FileIO seam (torn writes, a crash between payload and header, ENOSPC,
EIO, a filesystem without O_DIRECT), truncation, the directory lock and namespaces file."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.errors import StorageError
from kvserver.ssd import format as fmt
from kvserver.ssd.fileio import FileIO, aligned_buffer
from kvserver.ssd.format import ChunkHeader, CorruptChunk
from kvserver.ssd.slots import slack_bytes_for
from kvserver.ssd.store import SlotStore
from tests.kvserver.builders import make_keys, pattern
from tests.kvserver.ssd.faults import Crash, FaultyIO

NS = "0123456789abcdef"
PART = 5000  # not a multiple of the block: the padding path is exercised


@pytest.fixture
def io() -> FaultyIO:
    return FaultyIO()


@pytest.fixture
def store(tmp_path: Path, io: FaultyIO) -> Iterator[SlotStore]:
    s = SlotStore(str(tmp_path / "ssd"), fileio=io)
    s.open()
    yield s
    s.close()


def chunk(key: bytes, seq: int, tp: int = 2) -> tuple[ChunkHeader, memoryview]:
    """Header fields and a slot buffer holding the pattern payload of ``key``."""
    slot_bytes = fmt.slot_bytes_for(PART * tp)
    buf = aligned_buffer(slot_bytes)
    for rank in range(tp):
        start = fmt.HEADER_BYTES + rank * PART
        buf[start : start + PART] = pattern(key, rank, PART)
    return ChunkHeader(NS, key, seq, slot_bytes, PART, tp, 0), buf


def write(store: SlotStore, slot: int, key: bytes, seq: int, tp: int = 2) -> ChunkHeader:
    meta, buf = chunk(key, seq, tp)
    store.write_chunk(meta.slot_bytes, slot, meta, buf)
    return meta


def read(store: SlotStore, slot: int, key: bytes, seq: int, tp: int = 2) -> list[bytes]:
    slot_bytes = fmt.slot_bytes_for(PART * tp)
    buf = aligned_buffer(slot_bytes)
    h = store.read_chunk(slot_bytes, slot, (NS, key, seq), buf)
    base = fmt.HEADER_BYTES
    return [bytes(buf[base + r * PART : base + (r + 1) * PART]) for r in range(h.num_parts)]


def data_path(store: SlotStore, tp: int = 2) -> str:
    return os.path.join(store.directory, fmt.data_file_name(fmt.slot_bytes_for(PART * tp)))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tp", [1, 2])
def test_write_read_byte_exact(store: SlotStore, tp: int) -> None:
    keys = make_keys(5)
    for slot, key in enumerate(keys):
        write(store, slot, key, seq=slot + 1, tp=tp)
    for slot, key in enumerate(keys):
        assert read(store, slot, key, slot + 1, tp) == [pattern(key, r, PART) for r in range(tp)]


def test_direct_io_is_detected_where_supported(store: SlotStore, tmp_path: Path) -> None:
    """This machine's /tmp filesystem takes O_DIRECT; a store with direct='off' does not use it."""
    assert store.io_mode == "direct" or not FileIO.O_DIRECT
    off = SlotStore(str(tmp_path / "off"), direct="off")
    off.open()
    try:
        assert off.io_mode == "buffered"
        write(off, 0, b"k" * 32, 1)
        assert read(off, 0, b"k" * 32, 1)[1] == pattern(b"k" * 32, 1, PART)
    finally:
        off.close()


def test_falls_back_to_buffered_when_the_filesystem_refuses_o_direct(tmp_path: Path) -> None:
    """A filesystem that answers EINVAL to O_DIRECT (some tmpfs, overlayfs): buffered I/O."""
    io = FaultyIO()
    io.no_direct = True
    s = SlotStore(str(tmp_path / "ssd"), fileio=io)
    s.open()
    try:
        assert s.io_mode == "buffered"
        key = make_keys(1)[0]
        write(s, 3, key, 9)
        assert read(s, 3, key, 9) == [pattern(key, r, PART) for r in range(2)]
    finally:
        s.close()


# ----------------------------------------------------------------------------- rebuild


@pytest.mark.parametrize("workers", [1, 3])
def test_scan_reads_headers_only(store: SlotStore, io: FaultyIO, workers: int) -> None:
    keys = make_keys(600)
    slot_bytes = fmt.slot_bytes_for(2 * PART)
    for slot, key in enumerate(keys):
        write(store, slot, key, slot + 1)
    for slot in range(0, 600, 2):
        store.discard(slot_bytes, slot)
    io.bytes_read = 0
    result = store.scan(workers)
    assert [c.header.key for c in result.chunks] == keys[1::2]  # in slot order
    assert result.invalid == [] and result.num_slots[slot_bytes] >= 600  # + preallocated
    assert result.headers_read == 600
    assert io.bytes_read == 600 * fmt.HEADER_BYTES  # not one payload byte


def test_scan_skips_holes(store: SlotStore, io: FaultyIO) -> None:
    """Slots never written (preallocated, or a file extended by a write far out) hold no data:
    their headers are not even read."""
    key = make_keys(1)[0]
    write(store, 300, key, 1)
    result = store.scan()
    assert [c.slot for c in result.chunks] == [300]
    assert result.headers_read < 10


def test_truncate_cuts_and_removes_files(store: SlotStore) -> None:
    slot_bytes = fmt.slot_bytes_for(2 * PART)
    keys = make_keys(4)
    for slot, key in enumerate(keys):
        write(store, slot, key, slot + 1)
    store.truncate(slot_bytes, 2)
    assert os.path.getsize(data_path(store)) == 2 * slot_bytes
    assert [c.header.key for c in store.scan().chunks] == keys[:2]
    store.truncate(slot_bytes, 0)
    assert not os.path.exists(data_path(store)) and store.scan().chunks == []
    write(store, 0, keys[0], 9)  # the file comes back on the next write
    assert read(store, 0, keys[0], 9)[0] == pattern(keys[0], 0, PART)


def test_invalid_headers_are_reported(store: SlotStore) -> None:
    keys = make_keys(3)
    for slot, key in enumerate(keys):
        write(store, slot, key, slot + 1)
    slot_bytes = fmt.slot_bytes_for(2 * PART)
    flip(data_path(store), 1 * slot_bytes + 40)  # the seq field of slot 1
    result = store.scan()
    assert [c.header.key for c in result.chunks] == [keys[0], keys[2]]
    assert result.invalid == [(slot_bytes, 1)]


# ----------------------------------------------------------------------------- crash cases


@pytest.mark.parametrize(
    ("crash_on_write", "torn"),
    [
        (1, 0),  # before any payload byte
        (1, 8192),  # mid-payload (torn)
        (2, 0),  # payload complete, header never written
        (2, 100),  # header torn after 100 bytes
    ],
)
def test_a_crash_mid_write_never_leaves_a_valid_chunk(
    tmp_path: Path, crash_on_write: int, torn: int
) -> None:
    """The process dies during a write: after a restart the slot is not a chunk, so nothing
    wrong can ever be served from it; it is reported invalid (and discarded) or blank."""
    io = FaultyIO()
    s = SlotStore(str(tmp_path / "ssd"), fileio=io)
    s.open()
    key_a, key_b = make_keys(2)
    write(s, 0, key_a, 1)
    s.discard(fmt.slot_bytes_for(2 * PART), 0)  # slot 0 is reused for key_b below
    io.crash_on_write, io.torn = io.writes + crash_on_write, torn
    with pytest.raises(Crash):
        write(s, 0, key_b, 2)
    s.close()
    again = SlotStore(str(tmp_path / "ssd"))
    again.open()
    try:
        result = again.scan()
        assert result.chunks == []
        assert result.invalid in ([], [(fmt.slot_bytes_for(2 * PART), 0)])
    finally:
        again.close()


def test_reusing_a_slot_zeroes_its_header_first(tmp_path: Path) -> None:
    """Discard zeroes the header: a crash mid-rewrite of the slot cannot leave the OLD chunk's
    header in front of a half-new payload."""
    io = FaultyIO()
    s = SlotStore(str(tmp_path / "ssd"), fileio=io)
    s.open()
    try:
        key_a, key_b = make_keys(2)
        write(s, 0, key_a, 1)
        s.discard(fmt.slot_bytes_for(2 * PART), 0)
        assert s.scan().chunks == []
        io.crash_on_write, io.torn = io.writes + 1, 4096
        with pytest.raises(Crash):
            write(s, 0, key_b, 2)
        assert s.scan().chunks == []
    finally:
        s.close()


# ----------------------------------------------------------------------------- corruption


def test_flipped_payload_byte_is_detected_on_read(store: SlotStore) -> None:
    key = make_keys(1)[0]
    write(store, 0, key, 1)
    flip(data_path(store), fmt.HEADER_BYTES + PART + 17)
    with pytest.raises(CorruptChunk) as err:
        read(store, 0, key, 1)
    assert err.value.reason == "payload_checksum"


def test_a_slot_holding_another_chunk_is_refused(store: SlotStore) -> None:
    key, other = make_keys(2)
    write(store, 0, key, 5)
    with pytest.raises(CorruptChunk) as err:
        read(store, 0, key, 4)  # the index expected an older write
    assert err.value.reason == "mismatch"
    with pytest.raises(CorruptChunk):
        read(store, 0, other, 5)
    with pytest.raises(CorruptChunk) as err:
        read(store, 7, key, 5)  # preallocated, never written
    assert err.value.reason == "blank"
    with pytest.raises(CorruptChunk) as err:
        read(store, 1 << 20, key, 5)  # beyond the end of the file
    assert err.value.reason == "geometry"


# ----------------------------------------------------------------------------- OS errors


def test_enospc_is_a_storage_error_with_path_and_errno(store: SlotStore, io: FaultyIO) -> None:
    io.write_errno = errno.ENOSPC
    with pytest.raises(StorageError) as err:
        write(store, 0, make_keys(1)[0], 1)
    assert err.value.context["errno"] == errno.ENOSPC
    assert err.value.context["path"] == data_path(store)
    assert "ENOSPC" in str(err.value)
    write(store, 0, make_keys(1)[0], 2)  # space is back: writes work again


def test_a_nearly_full_disk_still_takes_what_fits(tmp_path: Path) -> None:
    """Preallocation ahead fails (no room for a whole step) but the slot itself fits."""

    class TightIO(FaultyIO):
        def allocate(self, fd: int, offset: int, length: int) -> bool:
            if length > 3 * fmt.slot_bytes_for(2 * PART):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().allocate(fd, offset, length)

    s = SlotStore(str(tmp_path / "ssd"), fileio=TightIO())
    s.open()
    try:
        key = make_keys(1)[0]
        write(s, 0, key, 1)
        assert read(s, 0, key, 1)[0] == pattern(key, 0, PART)
    finally:
        s.close()


def test_read_error_is_a_storage_error(store: SlotStore, io: FaultyIO) -> None:
    key = make_keys(1)[0]
    write(store, 0, key, 1)
    io.read_errno = errno.EIO
    with pytest.raises(StorageError) as err:
        read(store, 0, key, 1)
    assert not isinstance(err.value, CorruptChunk) and err.value.context["errno"] == errno.EIO


def test_unusable_directory(tmp_path: Path) -> None:
    """The directory cannot be created (a file is in the way): StorageError with errno."""
    (tmp_path / "file").write_text("x")
    s = SlotStore(str(tmp_path / "file" / "ssd"))
    with pytest.raises(StorageError) as err:
        s.open()
    assert err.value.context["errno"] == errno.ENOTDIR
    s.close()


def test_one_daemon_per_directory(store: SlotStore) -> None:
    other = SlotStore(store.directory)
    with pytest.raises(StorageError, match="in use"):
        other.open()
    other.close()


def test_foreign_directory_format_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    d.mkdir()
    (d / fmt.FORMAT_FILE).write_text('{"format": "kvserver-ssd", "version": 99}')
    s = SlotStore(str(d))
    with pytest.raises(StorageError, match="unsupported"):
        s.open()
    s.close()


def test_namespaces_file_is_replaced_atomically(store: SlotStore, io: FaultyIO) -> None:
    assert store.load_namespaces() == []
    store.save_namespaces([{"model": "a"}])
    io.write_errno = errno.ENOSPC
    with pytest.raises(StorageError):
        store.save_namespaces([{"model": "b"}])
    assert store.load_namespaces() == [{"model": "a"}]  # the old file is intact
    store.save_namespaces([{"model": "b"}])
    assert store.load_namespaces() == [{"model": "b"}]


# ----------------------------------------------------------------------------- disk space


def test_released_slots_give_their_blocks_back_and_read_as_empty(store: SlotStore) -> None:
    """Slots 1..3 of 5, discarded then released (one punch for the run): the file's blocks
    (st_blocks) drop by 3 slots, its size stays, a released slot reads as an empty slot
    (never the chunk it held), the neighbours are intact, and a write fills it again."""
    slot_bytes = fmt.slot_bytes_for(2 * PART)
    keys = make_keys(5)
    for slot, key in enumerate(keys):
        write(store, slot, key, slot + 1)
    store.truncate(slot_bytes, 5)  # drop the preallocation: only the slots are counted
    before = os.stat(data_path(store))
    for slot in (1, 2, 3):
        store.discard(slot_bytes, slot)
    assert store.release_slots(slot_bytes, [3, 1, 2]) == [None, None, None]
    after = os.stat(data_path(store))
    assert after.st_size == before.st_size
    assert (before.st_blocks - after.st_blocks) * 512 == 3 * slot_bytes
    with pytest.raises(CorruptChunk) as bad:
        read(store, 2, keys[2], 3)
    assert bad.value.reason == "blank"
    assert read(store, 4, keys[4], 5)[1] == pattern(keys[4], 1, PART)
    assert [c.slot for c in store.scan().chunks] == [0, 4]
    write(store, 2, keys[2], 9)
    assert read(store, 2, keys[2], 9)[0] == pattern(keys[2], 0, PART)


def test_the_scan_reports_discarded_slots_as_blank_within_a_bound(store: SlotStore) -> None:
    """A discarded slot keeps its payload's blocks under a zero header: the scan lists it as
    blank (spare at start-up), only within ``blank_within`` bytes (a huge file of zeros would
    otherwise cost one entry per slot); a released slot holds no data and is not listed."""
    slot_bytes = fmt.slot_bytes_for(2 * PART)
    for slot, key in enumerate(make_keys(6)):
        write(store, slot, key, slot + 1)
    for slot in (1, 2, 4):
        store.discard(slot_bytes, slot)
    assert store.release_slots(slot_bytes, [2]) == [None]
    assert store.scan().blank == [(slot_bytes, 1), (slot_bytes, 4)]
    assert store.scan(blank_within=4 * slot_bytes).blank == [(slot_bytes, 1)]


class NoPunchIO(FaultyIO):
    def punch(self, fd: int, offset: int, length: int) -> bool:
        return False


def test_a_filesystem_that_cannot_punch_keeps_the_blocks(tmp_path: Path) -> None:
    s = SlotStore(str(tmp_path / "ssd"), fileio=NoPunchIO())
    s.open()
    try:
        slot_bytes = fmt.slot_bytes_for(2 * PART)
        write(s, 0, make_keys(1)[0], 1)
        (err,) = s.release_slots(slot_bytes, [0])
        assert err is not None and err.context["errno"] == errno.EOPNOTSUPP
    finally:
        s.close()


def test_preallocation_ahead_follows_the_step_given(tmp_path: Path) -> None:
    """The tier caps the preallocation by its capacity (``slack_bytes_for``: 1/16 of it, at
    most 64 MiB); was: 64 MiB ahead whatever the capacity (8 times an 8 MiB tier)."""
    slot_bytes = fmt.slot_bytes_for(2 * PART)
    s = SlotStore(str(tmp_path / "ssd"), allocate_step=slack_bytes_for(64 * slot_bytes))
    s.open()
    try:
        write(s, 0, make_keys(1)[0], 1)
        assert os.path.getsize(data_path(s)) == 4 * slot_bytes
        assert os.stat(data_path(s)).st_blocks * 512 == 4 * slot_bytes
    finally:
        s.close()


def test_a_filesystem_without_locks_is_not_reported_as_a_directory_in_use(tmp_path: Path) -> None:
    """flock failing with ENOLCK (NFS without a lock manager; injected: no local filesystem
    gives it) was reported "in use by another daemon" with no daemon there; now the errno is
    named, and nothing stays open."""

    class NoLocks(FileIO):
        def lock(self, fd: int) -> None:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    store = SlotStore(str(tmp_path / "ssd"), fileio=NoLocks())
    with pytest.raises(StorageError) as caught:
        store.open()
    assert "cannot lock the SSD directory" in str(caught.value)
    assert "ENOLCK" in str(caught.value) and "another daemon" not in str(caught.value)
    assert not store._dir.locked
