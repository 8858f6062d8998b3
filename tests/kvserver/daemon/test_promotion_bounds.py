"""kvserver/daemon/promotion.py in one process over a real SSD directory (the harness of
test_tiering.py): the per-daemon bound on bytes served straight from SSD, and a cancelled
promotion whose slot reads still run (a read held on its I/O thread through the FileIO seam:
a slow disk on demand).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserver.errors import CapacityError
from kvserver.ssd import format as fmt
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.test_tiering import SPECS, expected, on_ssd, register, start, stop, store

SPEC = SPECS[1]
SLOT = fmt.slot_bytes_for(SPEC.part_bytes)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the loop (and the I/O threads) run until ``cond`` holds; AssertionError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.001)


async def test_serving_straight_from_ssd_is_bounded_per_daemon(tmp_path: Path) -> None:
    """DRAM fully pinned: a remote get whose chunks would be served from SSD read buffers past
    the daemon's bound (its staging bytes) is refused before anything is read (CapacityError,
    counted, nothing held); within it, served, the bytes counted until the reply drops them.
    Was: one buffer per chunk, however many the get named."""
    node = await start(tmp_path / "ssd", staging_bytes=3 * SLOT)
    try:
        keys = make_keys(10, tag="serve")
        await register(node, SPEC)
        for key in keys:  # one at a time: the staging area holds only 3 write-backs
            store(node, SPEC, [key])
            await node.tier.wait_idle()
        in_dram = [k for k in keys if node.engine.contains(SPEC.ns_id, k)]
        pins = node.svc.prepare_load(SPEC.ns_id, in_dram, client="c")  # DRAM cannot evict
        victims = on_ssd(node, SPEC, keys)
        assert len(victims) >= 4
        reads_before = node.io.reads
        with pytest.raises(CapacityError, match="straight from SSD"):
            await node.svc.promote(SPEC.ns_id, victims[:4], direct=True)
        stats = node.svc.stats()["ssd"]
        assert stats["refused_direct_chunks"] == 4 and stats["serving_bytes"] == 0
        assert node.io.reads == reads_before and node.tier.index.pinned_bytes == 0
        parts = await node.svc.promote(SPEC.ns_id, victims[:2], direct=True)
        assert [bytes(p) for p in parts[victims[0]]] == expected(SPEC, victims[0])
        assert node.svc.stats()["ssd"]["serving_bytes"] == 2 * SLOT  # still being sent
        with pytest.raises(CapacityError):
            await node.svc.promote(SPEC.ns_id, victims[2:4], direct=True)
        del parts  # the reply let go of the buffers (the I/O thread drops its job's reference
        # to a buffer a moment after the read completes)
        await until(lambda: node.svc.stats()["ssd"]["serving_bytes"] == 0)
        more = await node.svc.promote(SPEC.ns_id, victims[2:4], direct=True)
        assert sorted(more) == sorted(victims[2:4])
        node.svc.complete_load(pins.lease_id)
        node.tier.index.check_invariants()
    finally:
        await stop(node)


async def test_a_cancelled_promotion_keeps_its_slots_pinned_until_their_reads_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion is cancelled while its slot read is held on the I/O thread: the slot stays
    pinned (not evicted, not reused under the read) until the read has ended, then is unpinned
    with its read buffer back in the pool and nothing counted corrupt. Was: unpinned at once."""
    node = await start(tmp_path / "ssd")
    try:
        keys = make_keys(12, tag="hold")
        await register(node, SPEC)
        store(node, SPEC, keys)
        await node.tier.wait_idle()
        victim = on_ssd(node, SPEC, keys)[0]
        entry = node.tier.index.ready(SPEC.ns_id, victim)
        assert entry is not None and entry.readers == 0
        started, release = threading.Event(), threading.Event()
        before_read = node.io._before_read

        def held_read(*args: Any) -> None:
            started.set()
            release.wait(30)
            before_read(*args)

        monkeypatch.setattr(node.io, "_before_read", held_read)
        task = asyncio.get_running_loop().create_task(node.svc.promote(SPEC.ns_id, [victim]))
        assert await asyncio.to_thread(started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert entry.readers == 1, "unpinned while its read still runs"
        release.set()
        await node.tier.wait_idle()  # the read has ended on its thread
        await until(lambda: entry.readers == 0)
        stats = node.svc.stats()["ssd"]
        assert stats["corrupt_chunks"] == 0 and node.tier.reads.in_use_bytes == 0
        assert node.tier.index.ready(SPEC.ns_id, victim) is entry  # still on SSD, intact
        node.tier.index.check_invariants()
        node.engine.check_invariants()
    finally:
        release.set()
        await stop(node)


async def test_close_gives_up_on_a_hung_disk_write_after_the_drain_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown while a write-back hangs in the disk (held on its I/O thread): the tier's close
    returns after its drain timeout, the job counted abandoned, instead of waiting for the disk
    (was: ``threads.shutdown(wait=True)`` after the timeout, i.e. forever)."""
    node = await start(tmp_path / "ssd", drain_timeout_s=0.2)
    started, release = threading.Event(), threading.Event()
    before_write = node.io._before_write

    def held_write(*args: Any) -> None:
        started.set()
        release.wait(30)
        before_write(*args)

    try:
        await register(node, SPEC)
        monkeypatch.setattr(node.io, "_before_write", held_write)
        store(node, SPEC, make_keys(12, tag="hung"))  # DRAM evicts: write-backs start
        assert await asyncio.to_thread(started.wait, 30)
        await asyncio.wait_for(node.svc.close_tiers(), 10)
        assert not release.is_set() and node.tier.abandoned_jobs >= 1
    finally:
        release.set()
        node.svc.close()
