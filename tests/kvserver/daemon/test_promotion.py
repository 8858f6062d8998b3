"""kvserver/daemon/promotion.py in one process: concurrent promotions of one tier.

Two promotions of one chunk read it once (the second joins the first), also when DRAM is fully
pinned and both want the bytes directly; a batch whose read fails wakes the requests that
joined it without an error; a request that joined a batch which did not bring its chunk in
(not ``direct``, DRAM full) reads it itself; the concurrency limit. SSD reads are held by a
gate at the FileIO seam (a ``threading.Event``), so "in progress" is a state, not a delay.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from kvserver.daemon.service import KVService
from kvserver.daemon.tiering import SsdTier
from kvserver.engine.types import EngineConfig
from kvserver.errors import UnknownKey
from kvserver.ssd.config import TierConfig
from tests.kvserver.builders import PAGE, make_keys
from tests.kvserver.daemon.test_tiering import (
    DRAM_PAGES,
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

SPEC = SPECS[1]
KEYS = make_keys(10, tag="promo")


class Gate:
    """Holds every SSD read of ``node`` until :meth:`open`; counts the read system calls that
    started (one per run of consecutive slots read together)."""

    def __init__(self, node: Node) -> None:
        self.reads = 0
        self._entered = threading.Event()
        self._open = threading.Event()
        read, readv = node.io.pread_into, node.io.preadv_into

        def hold() -> None:
            self.reads += 1
            self._entered.set()
            self._open.wait(30)

        def held(fd: int, buf: memoryview, offset: int) -> int:
            hold()
            return read(fd, buf, offset)

        def heldv(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
            hold()
            return readv(fd, bufs, offset)

        node.io.pread_into = held  # type: ignore[method-assign]
        node.io.preadv_into = heldv  # type: ignore[method-assign]

    async def wait_for_read(self) -> None:
        entered = await asyncio.get_running_loop().run_in_executor(None, self._entered.wait, 30)
        assert entered, "no SSD read started"

    def open(self) -> None:
        self._open.set()


async def until(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate()`` holds (at most 10 000 turns)."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)  # one loop turn, not a delay
    raise AssertionError("condition not met")


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = await start(tmp_path / "ssd")
    await register(n, SPEC)
    yield n
    await n.tier.wait_idle()
    n.tier.index.check_invariants()
    n.engine.check_invariants()
    await stop(n)


async def cold_keys(node: Node) -> list[bytes]:
    """Store 10 chunks in a 4-chunk DRAM tier; the ones now on SSD only."""
    store(node, SPEC, KEYS)
    await node.tier.wait_idle()
    return [k for k in on_ssd(node, SPEC, KEYS) if not node.engine.contains(SPEC.ns_id, k)]


async def test_two_promotions_of_one_chunk_read_it_once(node: Node) -> None:
    keys = await cold_keys(node)
    victim = keys[0]
    gate = Gate(node)
    first = asyncio.create_task(node.svc.promote(SPEC.ns_id, [victim]))
    await gate.wait_for_read()
    second = asyncio.create_task(load(node, SPEC, [victim]))
    await until(lambda: node.tier.promotions.joined_chunks == 1)
    assert node.tier.promotions.in_flight(SPEC.ns_id, victim)
    gate.open()
    assert await first == {}
    assert await second == [expected(SPEC, victim)]
    assert gate.reads == 1
    stats = node.svc.stats()["ssd"]
    assert stats["promoted_chunks"] == 1 and stats["promoting_chunks"] == 0


async def test_direct_promotions_share_the_bytes_when_dram_is_pinned(node: Node) -> None:
    keys = await cold_keys(node)
    in_dram = [k for k in KEYS if node.engine.contains(SPEC.ns_id, k)]
    pins = node.svc.prepare_load(SPEC.ns_id, in_dram, client="c")  # DRAM cannot evict
    try:
        victim = keys[0]
        gate = Gate(node)
        first = asyncio.create_task(node.svc.promote(SPEC.ns_id, [victim], direct=True))
        await gate.wait_for_read()
        second = asyncio.create_task(node.svc.promote(SPEC.ns_id, [victim], direct=True))
        await until(lambda: node.tier.promotions.joined_chunks == 1)
        gate.open()
        for parts in (await first, await second):
            assert [bytes(p) for p in parts[victim]] == expected(SPEC, victim)
        assert gate.reads == 1
        assert node.svc.stats()["ssd"]["served_direct_chunks"] == 1
    finally:
        node.svc.complete_load(pins.lease_id)


async def test_a_joiner_reads_what_the_batch_it_joined_left_out(tmp_path: Path) -> None:
    """DRAM fully pinned, one batch at a time: while a direct batch of another chunk reads, a
    load (not direct) claims the victim and waits for the slot; a direct request joins it. The
    load's batch reads nothing (DRAM cannot take the chunk), so the joiner reads the chunk
    itself afterwards and gets its bytes."""
    n = await start(tmp_path / "ssd", max_promotions=1)
    try:
        await register(n, SPEC)
        other, victim = (await cold_keys(n))[:2]
        in_dram = [k for k in KEYS if n.engine.contains(SPEC.ns_id, k)]
        pins = n.svc.prepare_load(SPEC.ns_id, in_dram, client="c")  # DRAM cannot evict
        try:
            gate = Gate(n)
            busy = asyncio.create_task(n.svc.promote(SPEC.ns_id, [other], direct=True))
            await gate.wait_for_read()
            first = asyncio.create_task(n.svc.promote(SPEC.ns_id, [victim]))
            await until(lambda: n.tier.promotions.in_flight(SPEC.ns_id, victim))
            second = asyncio.create_task(n.svc.promote(SPEC.ns_id, [victim], direct=True))
            await until(lambda: n.tier.promotions.joined_chunks == 1)
            gate.open()
            assert [bytes(p) for p in (await busy)[other]] == expected(SPEC, other)
            assert await first == {}
            assert [bytes(p) for p in (await second)[victim]] == expected(SPEC, victim)
            assert gate.reads == 2
            assert n.svc.stats()["ssd"]["served_direct_chunks"] == 2
        finally:
            n.svc.complete_load(pins.lease_id)
    finally:
        await stop(n)


async def test_a_failed_read_wakes_the_joined_request(node: Node) -> None:
    keys = await cold_keys(node)
    victim = keys[0]
    gate = Gate(node)
    node.io.read_errno = errno.EIO
    first = asyncio.create_task(node.svc.promote(SPEC.ns_id, [victim]))
    await gate.wait_for_read()
    second = asyncio.create_task(load(node, SPEC, [victim]))
    await until(lambda: node.tier.promotions.joined_chunks == 1)
    gate.open()
    assert await first == {}
    with pytest.raises(UnknownKey):  # a miss, reported by the load, after one read
        await second
    assert gate.reads == 1
    assert node.svc.stats()["ssd"]["io_errors"] == 1
    assert node.tier.promotions.num_in_flight == 0


async def test_at_most_limit_batches_read_at_once(tmp_path: Path) -> None:
    """With a limit of 1, a second batch (another chunk) claims its key but pins and reads
    nothing until the first is done."""
    n = await start(tmp_path / "ssd", max_promotions=1)
    try:
        await register(n, SPEC)
        a, b = (await cold_keys(n))[:2]
        gate = Gate(n)
        first = asyncio.create_task(load(n, SPEC, [a]))
        await gate.wait_for_read()
        second = asyncio.create_task(load(n, SPEC, [b]))
        await until(lambda: n.tier.promotions.num_in_flight == 2)
        entry = n.tier.index.ready(SPEC.ns_id, a)
        assert entry is not None and n.tier.index.pinned_bytes == entry.slot_bytes
        assert gate.reads == 1
        gate.open()
        assert await first == [expected(SPEC, a)]
        assert await second == [expected(SPEC, b)]
        assert gate.reads == 2
    finally:
        await stop(n)


def test_the_limit_must_allow_one_promotion(tmp_path: Path) -> None:
    svc = KVService(EngineConfig(dram_bytes=DRAM_PAGES * PAGE, page_size=PAGE))
    try:
        with pytest.raises(ValueError, match="at least one promotion"):
            SsdTier(svc.engine, TierConfig(str(tmp_path / "ssd")), max_promotions=0)
    finally:
        svc.close()
