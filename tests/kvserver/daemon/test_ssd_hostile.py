"""The SSD tier against damaged and hostile directory contents, in real daemon processes.

What a daemon finds in its SSD directory at start-up (a torn last slot, a header forged with an
extreme sequence number, the same key in two namespaces, a smaller ``--ssd`` than the data)
must never make it serve bytes other than those stored, nor stop it writing down.
Shared helpers: ``test_ssd_daemon``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from kvserver.client import KVClient
from kvserver.errors import UnknownKey
from kvserver.ssd import format as fmt
from kvserver.ssd.fileio import aligned_buffer
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_ssd_daemon import (
    ENV,
    SLOT,
    SPEC,
    args,
    data_file,
    expected,
    headers,
    on_ssd_only,
    registered,
    settled,
    ssd,
    start,
    store_all,
)
from tests.support.daemon import start_daemon

pytestmark = pytest.mark.multiprocess


def write_at(path: Path, offset: int, data: bytes | memoryview) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def forged(h: fmt.ChunkHeader, *, seq: int) -> memoryview:
    """``h``'s header block with sequence number ``seq`` and a valid header checksum (as a
    hostile writer makes it; ``encode_header`` refuses numbers out of range)."""
    block = aligned_buffer(fmt.HEADER_BYTES)
    fmt.encode_header(h, block)
    block[16:24] = seq.to_bytes(8, "little")  # docs/ssd_format.md: the seq field
    body = bytes(block[: fmt.HEADER_USED - 8])
    block[fmt.HEADER_USED - 8 : fmt.HEADER_USED] = xxhash.xxh3_64_intdigest(body).to_bytes(
        8, "little"
    )
    return block


def read_back(kv: KVClient, ns_id: str, keys: list[bytes]) -> None:
    """Every key loads byte-exact (one at a time: a miss names its key)."""
    for key in keys:
        got = kv.load(ns_id, [key])
        assert [bytes(p) for p in got[0]] == expected(SPEC, key), key.hex()


def test_a_header_forged_with_the_largest_sequence_number_does_not_stop_write_downs(
    tmp_path: Path,
) -> None:
    """A valid header (both checksums right) whose sequence number is 2**64-1: the rebuilt
    index would continue at 2**64, which no header can hold, so every later write-down failed
    (``struct.error`` in the I/O job: the tier degraded at each restart, forever). Now a
    sequence number past 2**63-1 is an invalid header, discarded at start-up."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            keys = make_keys(80, tag="seq")
            store_all(kv, ns_id, SPEC, keys)
            settled(kv)
    finally:
        assert d.terminate() == 0, d.log()
    disk = headers(data_file(ssd_dir))
    forged_key, (slot, h) = next(iter(disk.items()))
    write_at(data_file(ssd_dir), slot * SLOT, forged(h, seq=2**64 - 1))
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            kv.register_namespace(SPEC)
            assert kv.lookup(ns_id, [forged_key]).hit_chunks == 0
            assert ssd(kv)["recovered_chunks"] == len(disk) - 1
            before = ssd(kv)["stored_chunks"]
            more = make_keys(80, tag="seq-more")
            store_all(kv, ns_id, SPEC, more)
            stats = settled(kv)
            assert stats["condition"] == "ok", stats["condition_detail"]
            assert stats["stored_chunks"] > before and stats["io_errors"] == 0
            read_back(kv, ns_id, on_ssd_only(kv, ns_id, more)[:8])
        assert "1 invalid headers" in d.log()
    finally:
        assert d.terminate() == 0, d.log()


def test_a_slot_torn_at_the_end_of_the_file_is_a_miss_and_the_rest_is_served(
    tmp_path: Path,
) -> None:
    """The file cut between two runs inside the last slot's payload (its header valid) and
    inside the header block of the slot before it (a torn write-down simulated): the first is
    a counted miss when read, the second an invalid header; every other chunk is byte-exact
    and write-downs go on into the slots reclaimed."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            keys = make_keys(80, tag="torn")
            store_all(kv, ns_id, SPEC, keys)
            settled(kv)
    finally:
        assert d.terminate() == 0, d.log()
    path = data_file(ssd_dir)
    disk = headers(path)
    by_slot = sorted(disk.items(), key=lambda item: item[1][0])
    (torn_header_key, (hslot, _)), (torn_key, (last, _)) = by_slot[-2], by_slot[-1]
    assert hslot == last - 1
    write_at(path, hslot * SLOT + 100, bytes(SLOT - 100))  # the header block, torn
    os.truncate(path, last * SLOT + fmt.HEADER_BYTES + 5_000)  # the payload, cut short
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            assert ssd(kv)["recovered_chunks"] == len(disk) - 1
            with pytest.raises(UnknownKey):  # never the bytes that were read
                kv.get(ns_id, [torn_key])
            stats = settled(kv)
            assert stats["corrupt_chunks"] == 1
            for key in (torn_key, torn_header_key):
                assert kv.lookup(ns_id, [key]).hit_chunks == 0
            rest = [k for k in disk if k not in (torn_key, torn_header_key)]
            read_back(kv, ns_id, rest)
            more = make_keys(80, tag="torn-more")
            store_all(kv, ns_id, SPEC, more)
            stats = settled(kv)
            assert stats["condition"] == "ok" and stats["corrupt_chunks"] == 1
            read_back(kv, ns_id, on_ssd_only(kv, ns_id, more))
        assert "1 invalid headers" in d.log()
    finally:
        assert d.terminate() == 0, d.log()


OTHER = make_spec(model="test/other", part_bytes_override=12_000)  # SPEC's geometry


def other_bytes(key: bytes) -> list[bytes]:
    """OTHER's payload of ``key``: not SPEC's (the same key holds other bytes there)."""
    return [bytes(b ^ 0x5A for b in part) for part in expected(SPEC, key)]


def test_one_key_in_two_namespaces_of_one_geometry_keeps_each_namespaces_bytes(
    tmp_path: Path,
) -> None:
    """The same chunk keys stored in two namespaces whose chunks share a slot size (one data
    file) with different bytes: on SSD, and again after a restart, each namespace loads its
    own bytes."""
    ssd_dir = tmp_path / "ssd"
    keys = make_keys(60, tag="collide")

    def check(kv: KVClient, ns_a: str, ns_b: str) -> None:
        for key in keys:
            assert [bytes(p) for p in kv.load(ns_a, [key])[0]] == expected(SPEC, key)
            assert [bytes(p) for p in kv.load(ns_b, [key])[0]] == other_bytes(key)

    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_a, ns_b = registered(kv, SPEC), registered(kv, OTHER)
            assert ns_a != ns_b
            for i in range(0, len(keys), 6):
                batch = keys[i : i + 6]
                assert kv.store(ns_a, batch, [expected(SPEC, k) for k in batch]) == batch
                assert kv.store(ns_b, batch, [other_bytes(k) for k in batch]) == batch
            settled(kv)
            on_disk = [h.ns_id for h in _all_headers(data_file(ssd_dir))]
            assert on_disk.count(ns_a) > 0 and on_disk.count(ns_b) > 0
            check(kv, ns_a, ns_b)
    finally:
        assert d.terminate() == 0, d.log()
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            assert ssd(kv)["recovered_chunks"] > 0
            kv.register_namespace(SPEC)
            kv.register_namespace(OTHER)
            check(kv, ns_a, ns_b)
            assert ssd(kv)["corrupt_chunks"] == 0
    finally:
        assert d.terminate() == 0, d.log()


def _all_headers(path: Path) -> list[fmt.ChunkHeader]:
    data = path.read_bytes()
    out = []
    for slot in range(len(data) // SLOT):
        try:
            out.append(fmt.decode_header(data[slot * SLOT : slot * SLOT + fmt.HEADER_BYTES]))
        except fmt.CorruptChunk:
            continue
    return out


def fill_in_order(tmp_path: Path, ssd_dir: Path, keys: list[bytes]) -> tuple[str, list[bytes]]:
    """Store ``keys`` (4 at a time, each write-down done before the next store, so sequence
    numbers and slots follow store order) and stop; the namespace id and the 64 newest keys
    on SSD."""
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            for i in range(0, len(keys), 4):
                batch = keys[i : i + 4]
                assert kv.store(ns_id, batch, [expected(SPEC, k) for k in batch]) == batch
                settled(kv)
    finally:
        assert d.terminate() == 0, d.log()
    disk = headers(data_file(ssd_dir))
    return ns_id, sorted(disk, key=lambda k: disk[k][1].seq)[-64:]


def test_a_restart_with_less_capacity_or_another_page_size_keeps_the_newest_byte_exact(
    tmp_path: Path,
) -> None:
    """160 chunks (2.5 MiB) on SSD; a restart with ``--ssd 1MiB`` keeps the newest chunks that
    fit (64 slots), byte-exact, and never holds more; they are moved below the file's bound
    and the file is cut there (was: the file kept 2.5 MiB); a restart with 8 KiB DRAM pages
    serves them byte-exact too (slots do not depend on the page size)."""
    ssd_dir = tmp_path / "ssd"
    keys = make_keys(200, tag="cap")
    ns_id, newest = fill_in_order(tmp_path, ssd_dir, keys)
    d = start_daemon(tmp_path, *args(ssd_dir, "--ssd", "1MiB"), env=ENV)
    try:
        with KVClient(d.zmq_address) as kv:
            stats = ssd(kv)
            assert stats["recovered_chunks"] == 64 and stats["used_bytes"] == 64 * SLOT
            assert stats["capacity_bytes"] == 1 << 20
            kv.register_namespace(SPEC)
            held = [k for k in keys if kv.lookup(ns_id, [k]).hit_chunks == 1]
            assert sorted(held) == sorted(newest)
            # the kept chunks lay in slots 96..159: moved below the bound, the file cut there
            assert data_file(ssd_dir).stat().st_size <= 64 * SLOT
            read_back(kv, ns_id, held[:16])
            assert ssd(kv)["used_bytes"] <= 1 << 20
        assert "moved 64 chunks below the capacity bound" in d.log()
    finally:
        assert d.terminate() == 0, d.log()
    d = start_daemon(tmp_path, *args(ssd_dir, "--ssd", "1MiB", "--page-size", "8KiB"), env=ENV)
    try:
        with KVClient(d.zmq_address) as kv:
            kv.register_namespace(SPEC)
            assert ssd(kv)["recovered_chunks"] >= 48  # minus the ones promoted, then evicted
            held = [k for k in keys if kv.lookup(ns_id, [k]).tiers.get("ssd") == 1]
            read_back(kv, ns_id, held)
            assert ssd(kv)["corrupt_chunks"] == 0
    finally:
        assert d.terminate() == 0, d.log()


def test_of_two_valid_copies_of_a_key_the_newest_is_served_and_the_other_discarded(
    tmp_path: Path,
) -> None:
    """A second valid copy of a chunk with other bytes (checksums right) appended to the data
    file between two runs, once with a lower sequence number (an evicted copy whose discard
    never ran), once with a higher one (a rewrite whose discard of the old copy never ran):
    the copy with the higher number is served, byte for byte, the other slot is zeroed."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            store_all(kv, ns_id, SPEC, make_keys(80, tag="dup"))
            settled(kv)
    finally:
        assert d.terminate() == 0, d.log()
    path = data_file(ssd_dir)
    disk = headers(path)
    (old_key, (_, old_h)), (new_key, (_, new_h)) = [i for i in disk.items() if i[1][1].seq > 1][:2]
    other = [bytes(b ^ 0xA5 for b in part) for part in expected(SPEC, new_key)]
    end = path.stat().st_size // SLOT
    # old_key: its copy on disk is the newer; new_key: the appended copy is the newer
    write_at(path, end * SLOT, copy_of(old_h, other_parts(old_key), seq=old_h.seq - 1))
    write_at(path, (end + 1) * SLOT, copy_of(new_h, other, seq=new_h.seq + 10_000))
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            assert ssd(kv)["recovered_chunks"] == len(disk)
            assert [bytes(p) for p in kv.get(ns_id, [old_key])[0]] == expected(SPEC, old_key)
            assert [bytes(p) for p in kv.get(ns_id, [new_key])[0]] == other
            settled(kv)
        assert "2 older duplicates" in d.log()
    finally:
        assert d.terminate() == 0, d.log()
    left = _all_headers(path)
    assert [h.key for h in left].count(old_key) == 1 and [h.key for h in left].count(new_key) == 1


def other_parts(key: bytes) -> list[bytes]:
    return [bytes(b ^ 0x3C for b in part) for part in expected(SPEC, key)]


def copy_of(h: fmt.ChunkHeader, parts: list[bytes], *, seq: int) -> bytes:
    """A whole valid slot for ``h``'s key holding ``parts`` with sequence number ``seq``."""
    slot = aligned_buffer(SLOT)
    payload = b"".join(parts)
    slot[fmt.HEADER_BYTES : fmt.HEADER_BYTES + len(payload)] = payload
    meta = fmt.prepare_slot(slot, SLOT, fmt.ChunkHeader(h.ns_id, h.key, seq, SLOT,
                                                         h.part_bytes, h.num_parts, 0))  # fmt: skip
    fmt.encode_header(meta, slot)
    return bytes(slot)


def test_a_chunk_that_fails_its_move_below_the_bound_stays_a_miss(tmp_path: Path) -> None:
    """As above, with one payload byte of a kept chunk flipped between the runs: its move
    reads and verifies it first, so it is not copied (never laundered under a new checksum);
    it stays where it was and is a counted miss; the 63 others moved, byte-exact."""
    ssd_dir = tmp_path / "ssd"
    keys = make_keys(200, tag="cap-flip")
    ns_id, newest = fill_in_order(tmp_path, ssd_dir, keys)
    bad = newest[-1]
    slot, _ = headers(data_file(ssd_dir))[bad]
    write_at(data_file(ssd_dir), slot * SLOT + fmt.HEADER_BYTES + 7, b"\xff\x00\xff")
    d = start_daemon(tmp_path, *args(ssd_dir, "--ssd", "1MiB"), env=ENV)
    try:
        with KVClient(d.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            with pytest.raises(UnknownKey):
                kv.get(ns_id, [bad])
            assert settled(kv)["corrupt_chunks"] == 1
            read_back(kv, ns_id, newest[:-1])
        assert "moved 63 chunks below the capacity bound" in d.log()
        assert "chunk not moved below the capacity bound" in d.log()
    finally:
        assert d.terminate() == 0, d.log()


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        (fmt.FORMAT_FILE, b'{"format": "kvserver-ssd", "version": 1e999}', "bad FORMAT file"),
        (fmt.NAMESPACES_FILE, bytes(300), "damaged namespaces file"),
    ],
    ids=["format-overflow", "namespaces-zeroed"],
)
def test_a_damaged_format_or_namespaces_file_leaves_the_tier_unavailable_naming_it(
    tmp_path: Path, name: str, content: bytes, said: str
) -> None:
    """A FORMAT file whose version is 1e999 made the daemon exit at start (OverflowError out
    of the tier's open); a zero-filled namespaces.json was "unreadable namespaces file",
    naming no file. Now either leaves the tier unavailable with a reason naming the file
    (the chunks are kept), DRAM serves, and the daemon says so in Stats."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            store_all(kv, ns_id, SPEC, make_keys(80, tag="meta"))
            settled(kv)
    finally:
        assert d.terminate() == 0, d.log()
    stored = headers(data_file(ssd_dir))
    (ssd_dir / name).write_bytes(content)
    d = start(tmp_path, ssd_dir)
    try:
        assert d.info["ssd_condition"] == "unavailable"
        with KVClient(d.zmq_address) as kv:
            ns_id = kv.register_namespace(SPEC).ns_id
            detail = ssd(kv)["condition_detail"]
            assert said in detail and str(ssd_dir / name) in detail, detail
            keys = make_keys(8, tag="meta-dram")
            store_all(kv, ns_id, SPEC, keys)
            read_back(kv, ns_id, keys)
    finally:
        assert d.terminate() == 0, d.log()
    assert headers(data_file(ssd_dir)) == stored  # nothing discarded
