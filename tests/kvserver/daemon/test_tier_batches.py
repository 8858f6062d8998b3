"""kvserver/daemon/writeback.py and tier_jobs.py: the SSD tier's disk work in batches.

An eviction of several chunks is one job whose consecutive slots go down in one payload call;
a job that fails as a whole aborts each of its chunks (nothing leaks: staging, slots); reads
asked for in one loop turn share a call and still fail one by one; a promotion cancelled while
its read is on the disk gives the read buffer back; a read job that raises wakes every reader.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvserver.daemon.tier_jobs import BATCH_BYTES, ReadQueue, ReadResult, WriteBatch
from kvserver.errors import StorageError
from kvserver.ssd import format as fmt
from kvserver.ssd.fileio import aligned_buffer
from kvserver.ssd.store import ChunkRead, SlotStore
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.test_promotion import Gate
from tests.kvserver.daemon.test_tiering import (
    SPECS,
    Node,
    expected,
    load,
    on_ssd,
    register,
    start,
    stop,
    store,
)

SPEC = SPECS[1]  # 2 pages per chunk: the 8-page DRAM tier holds 4


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = await start(tmp_path / "ssd")
    await register(n, SPEC)
    yield n
    await n.tier.wait_idle()
    n.tier.index.check_invariants()
    n.engine.check_invariants()
    await stop(n)


async def evict_four(node: Node, tag: str) -> list[bytes]:
    """Fill DRAM with 4 chunks, then evict all of them with one reservation (rolled back)."""
    keys = make_keys(4, tag=tag)
    store(node, SPEC, keys)
    grant = node.svc.prepare_store(SPEC.ns_id, make_keys(4, tag=f"{tag}-new"), client="c")
    assert grant is not None and grant.num_evicted == 4
    node.svc.complete_store(grant.lease_id, success=False)
    await node.tier.wait_idle()
    return keys


async def test_an_eviction_goes_down_in_one_payload_call(node: Node) -> None:
    """Four victims, four fresh consecutive slots: one payload call, then the four headers."""
    before = node.io.writes
    keys = await evict_four(node, "one")
    assert node.io.writes - before == 1 + 4
    assert sorted(on_ssd(node, SPEC, keys)) == sorted(keys)
    entries = [node.tier.index.ready(SPEC.ns_id, k) for k in keys]
    assert [e.slot for e in entries if e is not None] == [0, 1, 2, 3]
    for key in keys:
        assert await load(node, SPEC, [key]) == [expected(SPEC, key)]


async def test_a_failed_job_aborts_each_of_its_chunks(node: Node) -> None:
    """The job raises (not an OS error: nothing is known about the slots): every chunk is a
    failed write, its staging buffer comes back and its slot is discarded, then reused."""

    def broken(slot_bytes: int, writes: Any) -> Any:
        raise RuntimeError("bug in a job")

    original = node.tier.store.write_chunks
    node.tier.store.write_chunks = broken  # type: ignore[method-assign]
    await evict_four(node, "bug")
    ssd = node.svc.stats()["ssd"]
    assert ssd["entries"] == 0 and ssd["io_errors"] == 4 and ssd["condition"] == "degraded"
    assert node.tier.staging.in_use_bytes == 0
    slot_bytes = fmt.slot_bytes_for(SPEC.part_bytes)
    assert {node.tier.index.slot_state((slot_bytes, s)) for s in range(4)} == {"free"}
    node.tier.store.write_chunks = original  # type: ignore[method-assign]
    node.clock.advance(1.0)  # the retry interval passes: the next write probes, and succeeds
    keys = await evict_four(node, "after")
    assert node.svc.stats()["ssd"]["condition"] == "ok"
    assert on_ssd(node, SPEC, keys), "writes resumed"


async def test_reads_of_one_turn_share_a_call_and_fail_alone(tmp_path: Path) -> None:
    """One I/O thread: the four reads of one promotion are one job, one call for the four
    consecutive slots; the damaged chunk is a counted miss, the three others come in."""
    node = await start(tmp_path / "ssd", io_threads=1)
    try:
        await register(node, SPEC)
        keys = await evict_four(node, "rd")
        damaged = keys[1]
        entry = node.tier.index.ready(SPEC.ns_id, damaged)
        assert entry is not None
        path = os.path.join(node.tier.store.directory, fmt.data_file_name(entry.slot_bytes))
        with open(path, "r+b") as f:
            f.seek(entry.slot * entry.slot_bytes + fmt.HEADER_BYTES + 99)
            f.write(b"\xff\x00\xff")
        before = node.io.reads
        await node.svc.promote(SPEC.ns_id, keys)
        assert node.io.reads - before == 1
        good = [k for k in keys if k != damaged]
        assert all(node.engine.contains(SPEC.ns_id, k) for k in good)
        assert await load(node, SPEC, good) == [expected(SPEC, k) for k in good]
        assert node.svc.stats()["ssd"]["corrupt_chunks"] == 1
        assert node.tier.index.get(SPEC.ns_id, damaged) is None
        await node.tier.wait_idle()
        node.tier.index.check_invariants()
    finally:
        await stop(node)


async def test_a_cancelled_promotion_gives_its_read_buffer_back(node: Node) -> None:
    keys = await evict_four(node, "cancel")
    gate = Gate(node)
    task = asyncio.create_task(node.svc.promote(SPEC.ns_id, keys[:1]))
    await gate.wait_for_read()
    assert node.tier.reads.in_use_bytes > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.open()
    await node.tier.wait_idle()  # the read job is disk work in flight until it is done
    assert node.tier.reads.in_use_bytes == 0
    assert node.tier.index.ready(SPEC.ns_id, keys[0]) is not None, "a good chunk stays"
    assert await load(node, SPEC, keys[:1]) == [expected(SPEC, keys[0])]


async def test_a_read_job_that_raises_wakes_every_reader(tmp_path: Path) -> None:
    class Broken(SlotStore):
        def read_chunks(self, slot_bytes: int, reads: Any) -> Any:
            raise RuntimeError("bug in a job")

    results: list[ReadResult] = []
    jobs: list[asyncio.Future[Any]] = []
    with ThreadPoolExecutor(2) as threads:
        queue = ReadQueue(Broken(str(tmp_path)), threads, 2, track=jobs.append)
        for slot in range(3):
            read = ChunkRead(slot, ("0123456789abcdef", b"k", 1), aligned_buffer(8192))
            queue.submit(8192, read, results.append)
        await asyncio.sleep(0)  # one loop turn: the queue hands its jobs to the threads
        assert len(jobs) == 2  # at least one job per thread
        await asyncio.wait(jobs)  # returns after the jobs' own completions ran
    assert len(results) == 3
    assert all(isinstance(r, StorageError) and "bug in a job" in str(r) for r in results)


def test_a_write_batch_is_full_at_batch_bytes() -> None:
    batch = WriteBatch(BATCH_BYTES // 2)
    assert not batch and not batch.is_full
    batch.discards.append((4096 * 3, 0))
    assert batch and not batch.is_full
    batch.writes += [None, None]  # type: ignore[list-item]
    assert batch.is_full
