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
from kvserver.ssd import format as fmt
from kvserver.ssd.fileio import aligned_buffer
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.test_ssd_daemon import (
    SLOT,
    SPEC,
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
