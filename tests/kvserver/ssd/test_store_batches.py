"""kvserver/ssd/store.py, batches: several chunks per system call (``write_chunks`` /
``read_chunks`` / ``discard_slots``) keep every per-chunk rule: byte-exact round trips,
consecutive slots in one call, a crash at any write of a batch leaves only complete chunks,
a failed run fails only its own chunks, short writes are continued, every chunk of a read run
is verified on its own."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvserver.errors import StorageError
from kvserver.ssd import format as fmt
from kvserver.ssd.fileio import FileIO, aligned_buffer
from kvserver.ssd.format import ChunkHeader, CorruptChunk
from kvserver.ssd.store import ChunkRead, ChunkWrite, SlotStore
from tests.kvserver.builders import make_keys, pattern
from tests.kvserver.ssd.faults import Crash, FaultyIO

NS = "0123456789abcdef"
PART = 5000  # not a multiple of the block: the padding path is exercised
SLOT = fmt.slot_bytes_for(PART)


@pytest.fixture
def io() -> FaultyIO:
    return FaultyIO()


@pytest.fixture
def store(tmp_path: Path, io: FaultyIO) -> Iterator[SlotStore]:
    s = SlotStore(str(tmp_path / "ssd"), fileio=io)
    s.open()
    yield s
    s.close()


def chunk_write(slot: int, key: bytes, seq: int) -> ChunkWrite:
    buf = aligned_buffer(SLOT)
    buf[fmt.HEADER_BYTES : fmt.HEADER_BYTES + PART] = pattern(key, 0, PART)
    return ChunkWrite(slot, ChunkHeader(NS, key, seq, SLOT, PART, 1, 0), buf)


def batch(slots: Sequence[int], keys: Sequence[bytes], first_seq: int = 1) -> list[ChunkWrite]:
    return [
        chunk_write(s, k, first_seq + i) for i, (s, k) in enumerate(zip(slots, keys, strict=True))
    ]


def read_back(store: SlotStore, slot: int, key: bytes, seq: int) -> bytes:
    buf = aligned_buffer(SLOT)
    store.read_chunk(SLOT, slot, (NS, key, seq), buf)
    return bytes(buf[fmt.HEADER_BYTES : fmt.HEADER_BYTES + PART])


def test_consecutive_slots_go_down_in_one_call_each_run(store: SlotStore, io: FaultyIO) -> None:
    """Slots 3..5 and 9..10 (given out of order): two payload calls, then one header each."""
    keys = make_keys(5, tag="run")
    slots = [5, 3, 4, 10, 9]
    before = io.writes
    assert store.write_chunks(SLOT, batch(slots, keys)) == [None] * 5
    assert io.writes - before == 2 + 5
    for i, (slot, key) in enumerate(zip(slots, keys, strict=True)):
        assert read_back(store, slot, key, 1 + i) == pattern(key, 0, PART)


def test_an_empty_batch_writes_nothing(store: SlotStore, io: FaultyIO) -> None:
    before = io.writes
    assert store.write_chunks(SLOT, []) == []
    assert store.discard_slots([]) == []
    assert io.writes == before


@pytest.mark.parametrize(
    ("crash_on_write", "torn", "complete"),
    [
        (1, 0, 0),  # before any payload byte of the run
        (1, SLOT + 3000, 0),  # mid-run: slot 0 whole, slot 1 half written
        (2, 0, 0),  # every payload written, no header yet
        (3, 0, 1),  # the first header written, the second never
        (4, 100, 2),  # two headers written, the third torn after 100 bytes
    ],
)
def test_a_crash_mid_batch_leaves_only_complete_chunks(
    tmp_path: Path, crash_on_write: int, torn: int, complete: int
) -> None:
    """Four slots that held older chunks (discarded for reuse) are rewritten in one batch and
    the process dies at some write of it: after a restart exactly the chunks whose header was
    written are found, each byte-exact; nothing else is a chunk (old headers are gone)."""
    io = FaultyIO()
    s = SlotStore(str(tmp_path / "ssd"), fileio=io)
    s.open()
    old, new = make_keys(4, tag="old"), make_keys(4, tag="new")
    assert s.write_chunks(SLOT, batch(range(4), old)) == [None] * 4
    assert s.discard_slots([(SLOT, i) for i in range(4)]) == [None] * 4
    io.crash_on_write, io.torn = io.writes + crash_on_write, torn
    with pytest.raises(Crash):
        s.write_chunks(SLOT, batch(range(4), new, first_seq=5))
    s.close()
    again = SlotStore(str(tmp_path / "ssd"))
    again.open()
    try:
        result = again.scan()
        assert [(c.slot, c.header.key) for c in result.chunks] == list(enumerate(new[:complete]))
        assert set(result.invalid) <= {(SLOT, complete)}  # at most the torn header
        for slot in range(complete):
            assert read_back(again, slot, new[slot], 5 + slot) == pattern(new[slot], 0, PART)
    finally:
        again.close()


def test_a_failed_run_fails_only_its_chunks(store: SlotStore, io: FaultyIO) -> None:
    keys = make_keys(4, tag="fail")
    io.write_errno = errno.EIO  # the first call: the payload of the run 0..1
    errors = store.write_chunks(SLOT, batch([0, 1, 7, 8], keys))
    assert [e is None for e in errors] == [False, False, True, True]
    for err in errors[:2]:
        assert isinstance(err, StorageError)
        assert err.context["errno"] == errno.EIO and err.context["slot_touched"] is True
    assert read_back(store, 7, keys[2], 3) == pattern(keys[2], 0, PART)
    assert [c.slot for c in store.scan().chunks] == [7, 8]


def test_no_room_fails_the_whole_batch_before_touching_a_slot(
    store: SlotStore, io: FaultyIO
) -> None:
    io.allocate_errno = errno.ENOSPC
    before = io.writes
    errors = store.write_chunks(SLOT, batch([0, 1], make_keys(2, tag="full")))
    assert io.writes == before
    for err in errors:
        assert isinstance(err, StorageError) and err.context["errno"] == errno.ENOSPC
        assert err.context["slot_touched"] is False


def test_short_writes_are_continued(tmp_path: Path) -> None:
    """A filesystem that writes one buffer per call: the run still lands whole."""

    class OneBufferIO(FileIO):
        def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
            return self.pwrite(fd, bufs[0], offset)

    s = SlotStore(str(tmp_path / "ssd"), fileio=OneBufferIO())
    s.open()
    try:
        keys = make_keys(3, tag="short")
        assert s.write_chunks(SLOT, batch([0, 1, 2], keys)) == [None] * 3
        for i, key in enumerate(keys):
            assert read_back(s, i, key, 1 + i) == pattern(key, 0, PART)
    finally:
        s.close()


def test_every_chunk_of_a_read_run_is_verified(store: SlotStore, io: FaultyIO) -> None:
    """Slots 0..3 in one call, one of them damaged, one more slot beyond the end of the file:
    each result stands alone."""
    keys = make_keys(4, tag="rd")
    assert store.write_chunks(SLOT, batch(range(4), keys)) == [None] * 4
    path = os.path.join(store.directory, fmt.data_file_name(SLOT))
    with open(path, "r+b") as f:
        f.seek(1 * SLOT + fmt.HEADER_BYTES + 77)
        f.write(b"\x00\xff\x00")
    bufs = [aligned_buffer(SLOT) for _ in range(5)]
    reads = [ChunkRead(i, (NS, k, 1 + i), bufs[i]) for i, k in enumerate(keys)]
    reads.append(ChunkRead(1 << 20, (NS, keys[0], 1), bufs[4]))
    before = io.reads
    got = store.read_chunks(SLOT, reads)
    assert io.reads - before == 2
    outcome = [g.key if isinstance(g, ChunkHeader) else getattr(g, "reason", g) for g in got]
    assert outcome == [keys[0], "payload_checksum", keys[2], keys[3], "geometry"]
    for i in (0, 2, 3):
        assert bytes(bufs[i][fmt.HEADER_BYTES : fmt.HEADER_BYTES + PART]) == pattern(
            keys[i], 0, PART
        )


def test_a_read_error_fails_its_run(store: SlotStore, io: FaultyIO) -> None:
    keys = make_keys(2, tag="eio")
    assert store.write_chunks(SLOT, batch(range(2), keys)) == [None] * 2
    io.read_errno = errno.EIO
    got = store.read_chunks(
        SLOT, [ChunkRead(i, (NS, k, 1 + i), aligned_buffer(SLOT)) for i, k in enumerate(keys)]
    )
    for g in got:
        assert isinstance(g, StorageError) and not isinstance(g, CorruptChunk)
        assert g.context["errno"] == errno.EIO


def test_discard_slots_reports_each_slot(store: SlotStore, io: FaultyIO) -> None:
    keys = make_keys(2, tag="dis")
    assert store.write_chunks(SLOT, batch(range(2), keys)) == [None] * 2
    io.write_errno = errno.EIO  # the first discard fails, the second goes through
    errors = store.discard_slots([(SLOT, 0), (SLOT, 1)])
    assert isinstance(errors[0], StorageError) and errors[1] is None
    assert [c.slot for c in store.scan().chunks] == [0]


def test_a_chunk_whose_header_cannot_be_encoded_fails_alone(store: SlotStore) -> None:
    """A key longer than the header holds: that chunk fails (its slot needs a discard), the
    rest of the batch is written."""
    good = make_keys(2, tag="ok")
    writes = batch([0, 1, 2], [good[0], b"x" * (fmt.MAX_KEY_BYTES + 1), good[1]])
    errors = store.write_chunks(SLOT, writes)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], StorageError) and errors[1].context["slot_touched"] is True
    assert [c.slot for c in store.scan().chunks] == [0, 2]
    assert read_back(store, 2, good[1], 3) == pattern(good[1], 0, PART)
