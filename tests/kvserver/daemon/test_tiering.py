"""kvserver/daemon/tiering.py and promotion.py in one process: a KVService with a tiny DRAM tier
over a real SSD directory, faults injected through the FileIO seam, time through a fake clock.

Write-back and promotion byte-exact (TP 1 and 2, parts that are not a multiple of the block);
the admission rule; STORAGE events in the engine's one sequence; disk full (DRAM keeps serving,
the condition is visible, writes resume); flipped bytes (a miss, counted, space reclaimed);
read errors; restart (recovered, namespaces re-registered); serving straight from SSD when DRAM
is fully pinned; an unusable directory; a full staging area.
"""

from __future__ import annotations

import asyncio
import errno
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserver.daemon.service import KVService
from kvserver.daemon.tiering import SsdTier
from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig
from kvserver.errors import UnknownKey
from kvserver.namespace import NamespaceSpec
from kvserver.ssd import format as fmt
from kvserver.ssd.config import TierConfig
from tests.kvserver.builders import PAGE, FakeClock, make_keys, make_spec, pattern
from tests.kvserver.ssd.faults import FaultyIO

DRAM_PAGES = 8
SPECS = {
    1: make_spec(part_bytes_override=5000),  # 2 pages per part
    2: make_spec(model="test/tp2", tp_world_size=2),  # 1 page per part, 2 parts
}


@dataclass
class Node:
    svc: KVService
    tier: SsdTier
    io: FaultyIO
    clock: FakeClock

    @property
    def engine(self) -> StorageEngine:
        return self.svc.engine


async def start(directory: Path, *, max_promotions: int = 4, **config: Any) -> Node:
    io, clock = FaultyIO(), FakeClock()
    svc = KVService(EngineConfig(dram_bytes=DRAM_PAGES * PAGE, page_size=PAGE))
    settings: dict[str, Any] = {"capacity_bytes": 1 << 20, "admission": 1, "retry_s": 1.0}
    settings.update(config)
    tier = SsdTier(
        svc.engine,
        TierConfig(str(directory), **settings),
        publish=svc.publish,
        fileio=io,
        clock=clock,
        max_promotions=max_promotions,
    )
    svc.add_tier(tier)
    await svc.open_tiers()
    return Node(svc, tier, io, clock)


async def stop(node: Node) -> None:
    await node.svc.close_tiers()
    node.svc.close()


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = await start(tmp_path / "ssd")
    yield n
    n.tier.index.check_invariants()
    n.engine.check_invariants()
    await stop(n)


def expected(spec: NamespaceSpec, key: bytes) -> list[bytes]:
    return [pattern(key, r, spec.part_bytes) for r in range(spec.tp_world_size)]


async def register(node: Node, spec: NamespaceSpec) -> None:
    """Register and wait until the spec is saved (chunks of unsaved namespaces stay in DRAM)."""
    node.svc.register_namespace(spec)
    await node.tier.wait_idle()


def store(node: Node, spec: NamespaceSpec, keys: list[bytes]) -> None:
    """Store each key (one at a time, so DRAM evicts as it fills)."""
    ns_id = spec.ns_id
    for key in keys:
        grant = node.svc.prepare_store(ns_id, [key], client="c")
        assert grant is not None
        for rank, part in enumerate(expected(spec, key)):
            node.svc.write_part(grant.lease_id, key, rank, part)
        node.svc.complete_store(grant.lease_id)


async def load(node: Node, spec: NamespaceSpec, keys: list[bytes]) -> list[list[bytes]]:
    """What a co-located load does: promote, pin, read, release."""
    await node.svc.promote(spec.ns_id, keys)
    grant = node.svc.prepare_load(spec.ns_id, keys, client="c")
    try:
        return [
            [b"".join(bytes(v) for v in node.svc.read_part(grant.lease_id, k, r)) for r in range(n)]
            for k, n in ((k, spec.tp_world_size) for k in keys)
        ]
    finally:
        node.svc.complete_load(grant.lease_id)


def on_ssd(node: Node, spec: NamespaceSpec, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if node.tier.index.ready(spec.ns_id, k) is not None]


# ----------------------------------------------------------------------------- paths


@pytest.mark.parametrize("tp", [1, 2])
async def test_write_back_and_promotion_are_byte_exact(node: Node, tp: int) -> None:
    spec = SPECS[tp]
    keys = make_keys(12, tag=f"wb{tp}")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    down = on_ssd(node, spec, keys)
    assert down and all(not node.engine.contains(spec.ns_id, k) for k in down)
    stats = node.svc.stats()["ssd"]
    assert stats["stored_chunks"] == len(down) and stats["condition"] == "ok"
    assert await load(node, spec, down[:2]) == [expected(spec, k) for k in down[:2]]
    assert all(node.engine.contains(spec.ns_id, k) for k in down[:2])
    assert node.svc.stats()["ssd"]["promoted_chunks"] == 2
    await node.tier.wait_idle()


async def test_lookup_reports_the_run_over_both_tiers(node: Node) -> None:
    spec = SPECS[1]
    keys = make_keys(10, tag="lk")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    result = node.svc.lookup(spec.ns_id, keys)
    assert result.hit_chunks == 10 and sum(result.tiers.values()) == 10
    assert result.tiers["ssd"] == len(on_ssd(node, spec, keys)) - sum(
        node.engine.contains(spec.ns_id, k) for k in on_ssd(node, spec, keys)
    )
    assert node.svc.lookup(spec.ns_id, [*keys[:3], make_keys(1, tag="x")[0], *keys]).hit_chunks == 3


async def test_admission_needs_two_uses_by_default(tmp_path: Path) -> None:
    """Stored once and never used again: not written down. Stored and loaded: written."""
    node = await start(tmp_path / "ssd", admission=2)
    try:
        spec = SPECS[1]
        keys = make_keys(8, tag="adm")
        await register(node, spec)
        store(node, spec, keys[:1])
        await load(node, spec, keys[:1])
        store(node, spec, keys[1:])  # evicts everything stored before
        await node.tier.wait_idle()
        assert on_ssd(node, spec, keys) == keys[:1]
        assert node.svc.stats()["ssd"]["not_admitted_chunks"] >= 3
    finally:
        await stop(node)


async def test_disk_events_share_the_engine_sequence(node: Node) -> None:
    spec = SPECS[1]
    keys = make_keys(6, tag="ev")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    events = node.svc.events.replay(1)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    disk = [k for e in events if e.medium == "STORAGE" and e.type == "BlockStored" for k in e.keys]
    assert sorted(disk) == sorted(on_ssd(node, spec, keys))


# ----------------------------------------------------------------------------- faults


async def test_disk_full_dram_keeps_serving_and_writes_resume(node: Node) -> None:
    spec = SPECS[1]
    await register(node, spec)
    node.io.write_errno, node.io.sticky = errno.ENOSPC, True
    keys = make_keys(10, tag="full")
    store(node, spec, keys[:5])
    await node.tier.wait_idle()
    ssd = node.svc.stats()["ssd"]
    assert ssd["condition"] == "degraded" and "ENOSPC" in ssd["condition_detail"]
    assert ssd["io_errors"] >= 1 and ssd["entries"] == 0 and ssd["used_bytes"] == 0
    store(node, spec, keys[5:])  # DRAM keeps serving: stores and loads work
    assert await load(node, spec, keys[-2:]) == [expected(spec, k) for k in keys[-2:]]
    assert node.svc.stats()["ssd"]["skipped_chunks"] > 0, "no write tried while degraded"
    node.io.write_errno = None  # space returns
    node.clock.advance(1.0)  # the retry interval passes
    store(node, spec, make_keys(6, tag="again"))
    await node.tier.wait_idle()
    ssd = node.svc.stats()["ssd"]
    assert ssd["condition"] == "ok" and ssd["entries"] > 0


async def test_a_degraded_tier_probes_with_one_write_and_leaks_no_slot(node: Node) -> None:
    """Disk full at allocation: every failed write frees its slot at once (nothing reached
    it); while degraded, one write per retry interval probes the disk."""
    spec = SPECS[1]
    await register(node, spec)
    node.io.allocate_errno = errno.ENOSPC
    store(node, spec, make_keys(12, tag="probe"))
    await node.tier.wait_idle()
    first = node.svc.stats()["ssd"]
    assert first["condition"] == "degraded" and first["io_errors"] >= 1
    store(node, spec, make_keys(12, tag="probe2"))  # retry interval not over: no write at all
    await node.tier.wait_idle()
    assert node.svc.stats()["ssd"]["io_errors"] == first["io_errors"]
    node.clock.advance(1.0)
    store(node, spec, make_keys(12, tag="probe3"))
    await node.tier.wait_idle()
    assert node.svc.stats()["ssd"]["io_errors"] == first["io_errors"] + 1  # exactly one probe
    states = {node.tier.index.slot_state((fmt.slot_bytes_for(5000), s)) for s in range(8)}
    assert states <= {"free", "unused"}, states
    node.io.allocate_errno = None
    node.clock.advance(1.0)
    store(node, spec, make_keys(12, tag="probe4"))
    await node.tier.wait_idle()
    ssd = node.svc.stats()["ssd"]
    assert ssd["condition"] == "ok" and ssd["entries"] > 0


async def test_flipped_bytes_are_a_counted_miss_and_the_space_is_reclaimed(node: Node) -> None:
    spec = SPECS[2]
    keys = make_keys(10, tag="flip")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    victim = on_ssd(node, spec, keys)[0]
    entry = node.tier.index.ready(spec.ns_id, victim)
    assert entry is not None
    path = os.path.join(node.tier.store.directory, fmt.data_file_name(entry.slot_bytes))
    offset = entry.slot * entry.slot_bytes + fmt.HEADER_BYTES + 1234
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff\x00\xff")
    await node.svc.promote(spec.ns_id, [victim])
    with pytest.raises(UnknownKey):
        node.svc.prepare_load(spec.ns_id, [victim], client="c")
    await node.tier.wait_idle()
    ssd = node.svc.stats()["ssd"]
    assert ssd["corrupt_chunks"] == 1 and ssd["used_bytes"] == ssd["entries"] * entry.slot_bytes
    assert node.svc.lookup(spec.ns_id, [victim]).hit_chunks == 0
    assert node.tier.index.get(spec.ns_id, victim) is None
    # its slot was discarded and is free again (or already reused by the chunk that DRAM
    # evicted to make room for the promotion attempt)
    assert node.tier.index.slot_state(entry.location) in ("free", "held")
    removed = [e for e in node.svc.events.replay(1) if e.type == "BlockRemoved"]
    assert any(victim in e.keys and e.medium == "STORAGE" for e in removed)


async def test_read_error_is_a_miss(node: Node) -> None:
    spec = SPECS[1]
    keys = make_keys(10, tag="eio")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    victim = on_ssd(node, spec, keys)[0]
    node.io.read_errno = errno.EIO
    assert await node.svc.promote(spec.ns_id, [victim], direct=True) == {}
    node.io.read_errno = None
    assert node.svc.stats()["ssd"]["io_errors"] == 1
    assert node.tier.index.get(spec.ns_id, victim) is None


async def test_unusable_directory_then_usable(tmp_path: Path) -> None:
    node = await start(tmp_path / "ssd", retry_s=0.01)
    try:
        assert node.tier.condition == "ok"
    finally:
        await stop(node)
    io_denied = tmp_path / "denied"
    node = await start(io_denied, retry_s=0.01)  # opens fine, then: deny on a fresh tier
    await stop(node)
    svc = KVService(EngineConfig(dram_bytes=DRAM_PAGES * PAGE, page_size=PAGE))
    io = FaultyIO()
    io.deny_dir = str(io_denied)
    tier = SsdTier(svc.engine, TierConfig(str(io_denied), retry_s=0.01), fileio=io)
    svc.add_tier(tier)
    await svc.open_tiers()
    try:
        assert tier.condition == "unavailable" and "EACCES" in tier.reason
        svc.register_namespace(SPECS[1])
        store(Node(svc, tier, io, FakeClock()), SPECS[1], make_keys(10, tag="u"))  # DRAM serves
        io.deny_dir = None
        for _ in range(500):  # the retry task runs every 10 ms
            if tier.condition == "ok":
                break
            await asyncio.sleep(0.01)
        assert tier.condition == "ok"
    finally:
        await svc.close_tiers()
        svc.close()


async def test_full_staging_area_skips_write_backs(tmp_path: Path) -> None:
    node = await start(tmp_path / "ssd", staging_bytes=fmt.slot_bytes_for(5000))
    try:
        spec = SPECS[1]
        await register(node, spec)
        store(node, spec, make_keys(4, tag="s"))
        node.svc.register_namespace(spec)
        grant = node.svc.prepare_store(spec.ns_id, make_keys(4, tag="t"), client="c")
        assert grant is not None and grant.num_evicted == 4  # four victims at once
        node.svc.complete_store(grant.lease_id, success=False)
        await node.tier.wait_idle()
        ssd = node.svc.stats()["ssd"]
        assert ssd["stored_chunks"] == 1 and ssd["skipped_chunks"] == 3
    finally:
        await stop(node)


# ----------------------------------------------------------------------------- restart


async def test_restart_recovers_chunks_and_namespaces(tmp_path: Path) -> None:
    node = await start(tmp_path / "ssd")
    spec = SPECS[2]
    keys = make_keys(12, tag="rs")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    down = on_ssd(node, spec, keys)
    await stop(node)
    node = await start(tmp_path / "ssd")
    try:
        assert spec.ns_id in node.engine.namespaces, "the namespace came back with the data"
        assert node.svc.stats()["ssd"]["recovered_chunks"] == len(down) > 0
        assert sorted(on_ssd(node, spec, keys)) == sorted(down)
        for i in range(0, len(down), 2):  # DRAM holds 4 chunks of this namespace
            batch = down[i : i + 2]
            assert await load(node, spec, batch) == [expected(spec, k) for k in batch]
        stored = [e for e in node.svc.events.replay(1) if e.medium == "STORAGE"]
        assert stored[0].type == "BlockStored" and sorted(stored[0].keys) == sorted(down)
        node.tier.index.check_invariants()
        node.engine.check_invariants()
    finally:
        await stop(node)


async def test_direct_serving_when_dram_is_fully_pinned(node: Node) -> None:
    spec = SPECS[1]
    keys = make_keys(10, tag="dir")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    in_dram = [k for k in keys if node.engine.contains(spec.ns_id, k)]
    pins = node.svc.prepare_load(spec.ns_id, in_dram, client="c")  # DRAM cannot evict
    try:
        victim = on_ssd(node, spec, keys)[0]
        parts = await node.svc.promote(spec.ns_id, [victim], direct=True)
        assert [bytes(p) for p in parts[victim]] == expected(spec, victim)
        assert not node.engine.contains(spec.ns_id, victim)
        assert node.svc.stats()["ssd"]["served_direct_chunks"] == 1
    finally:
        node.svc.complete_load(pins.lease_id)


# ----------------------------------------------------------------------------- configuration


def test_daemon_config_builds_the_tier_config(tmp_path: Path) -> None:
    from kvserver.daemon.config import DaemonConfig
    from kvserver.errors import InvalidArgument

    assert DaemonConfig().tier_config() is None, "no directory: no SSD tier"
    env = {"KVSERVER_SSD_DIR": str(tmp_path), "KVSERVER_SSD": "2GiB"}
    config = DaemonConfig.load(env=env, overrides={"ssd_admission": 3, "ssd_policy": "arc"})
    tier = config.tier_config()
    assert tier is not None and tier.directory == str(tmp_path)
    assert (tier.capacity_bytes, tier.admission, tier.policy) == (2 << 30, 3, "arc")
    with pytest.raises(InvalidArgument, match="lru"):
        DaemonConfig.load(env={}, overrides={"ssd_policy": "fifo"})
    with pytest.raises(InvalidArgument):
        DaemonConfig.load(env=env, overrides={"ssd_admission": 0})
    with pytest.raises(InvalidArgument):
        DaemonConfig.load(env=env, overrides={"ssd": "1KiB"})


# ----------------------------------------------------------------------------- random


ops = st.lists(
    st.tuples(
        st.sampled_from(["store"] * 4 + ["load"] * 3 + ["flip", "restart"]), st.integers(0, 11)
    ),
    min_size=1,
    max_size=40,
)


def test_damaged_copy_is_detected_in_the_random_harness(tmp_path: Path) -> None:
    """The harness below reaches its interesting case: a damaged SSD-only chunk is loaded."""
    steps = [("store", i) for i in range(12)] + [("flip", 0), ("load", 0)]
    notes: list[str] = []
    keys = make_keys(12, tag="rnd")
    asyncio.run(_run_ops(tmp_path / "ssd", SPECS[2], keys, steps, notes.append))
    assert notes == ["damaged chunk detected on load"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=ops)
def test_random_operations_never_serve_a_wrong_byte(
    tmp_path: Path, steps: list[tuple[str, int]]
) -> None:
    """Random stores, loads, flipped bytes on disk and restarts: a load returns exactly the
    bytes stored or fails (only for a chunk whose disk copy was damaged and that is not in
    DRAM); both tiers' invariants hold after every step."""
    spec = SPECS[2]
    keys = make_keys(12, tag="rnd")
    prefix = [("store", i) for i in range(12)]  # start with 8 chunks on SSD, 4 in DRAM
    with tempfile.TemporaryDirectory(dir=tmp_path) as directory:
        asyncio.run(_run_ops(Path(directory), spec, keys, prefix + steps, event))


async def _run_ops(
    directory: Path,
    spec: NamespaceSpec,
    keys: list[bytes],
    steps: list[tuple[str, int]],
    note: Callable[[str], object],
) -> None:
    node = await start(directory)
    damaged: set[bytes] = set()
    try:
        await register(node, spec)
        for op, i in steps:
            key = keys[i]
            if op == "load" and damaged and i % 2 == 0:  # often try the damaged ones
                key = sorted(damaged)[i % len(damaged)]
            if op == "flip":  # damage a copy that is on SSD only, when there is one
                cold = [k for k in keys if node.tier.index.ready(spec.ns_id, k) is not None]
                cold = [k for k in cold if not node.engine.contains(spec.ns_id, k)] or cold
                key = cold[i % len(cold)] if cold else key
            if op == "store" and not node.engine.contains(spec.ns_id, key):
                if node.tier.index.get(spec.ns_id, key) is None:
                    damaged.discard(key)
                store(node, spec, [key])
            elif op == "load" and node.svc.lookup(spec.ns_id, [key]).hit_chunks:
                in_dram = node.engine.contains(spec.ns_id, key)
                try:
                    got = await load(node, spec, [key])
                except UnknownKey:
                    note("damaged chunk detected on load")
                    assert key in damaged and not in_dram, "a good chunk failed to load"
                    assert node.tier.index.get(spec.ns_id, key) is None, "dropped"
                else:
                    assert got == [expected(spec, key)], "wrong bytes served"
            elif op == "flip" and (entry := node.tier.index.ready(spec.ns_id, key)) is not None:
                path = os.path.join(node.tier.store.directory, fmt.data_file_name(entry.slot_bytes))
                with open(path, "r+b") as f:
                    f.seek(entry.slot * entry.slot_bytes + fmt.HEADER_BYTES + 100)
                    f.write(b"\x00\xff")
                damaged.add(key)
            elif op == "restart":
                note("restart")
                await stop(node)
                node = await start(directory)
            await node.tier.wait_idle()
            node.tier.index.check_invariants()
            node.engine.check_invariants()
    finally:
        await stop(node)


async def test_a_staging_buffer_that_cannot_be_mapped_skips_that_chunk_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new staging buffer whose mmap fails (ENOMEM: injected, the one fault here a test
    cannot make for real) in the middle of an eviction: that chunk and the rest are skipped
    and counted, the chunks already copied still go down, and no SSD entry stays WRITING
    (such a key could never be written down again, its slot bytes lost to the budget)."""
    node = await start(tmp_path / "ssd")
    try:
        spec = SPECS[1]
        await register(node, spec)
        store(node, spec, make_keys(4, tag="s"))
        acquire = node.tier.staging.acquire
        calls = 0

        def failing_acquire(nbytes: int) -> memoryview | None:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
            return acquire(nbytes)

        monkeypatch.setattr(node.tier.staging, "acquire", failing_acquire)
        grant = node.svc.prepare_store(spec.ns_id, make_keys(4, tag="t"), client="c")
        assert grant is not None and grant.num_evicted == 4  # four victims at once
        node.svc.complete_store(grant.lease_id, success=False)
        await node.tier.wait_idle()
        ssd = node.svc.stats()["ssd"]
        assert ssd["writes_in_flight"] == 0
        assert ssd["stored_chunks"] == 1 and ssd["skipped_chunks"] == 3
        assert on_ssd(node, spec, make_keys(4, tag="s")) == make_keys(1, tag="s")
        node.tier.index.check_invariants()
    finally:
        await stop(node)


async def test_a_promotion_cancelled_as_its_read_completes_returns_the_read_buffer(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion's caller is cancelled (a client's deadline, a shutdown) in the loop turn in
    which its slot read completes: the pooled read buffer must come back to the pool. Was:
    lost to the pool's accounting for good; each such race shrank the pool until every
    promotion read paid a fresh mmap. The cancellation is injected at that instant."""
    spec = SPECS[1]
    keys = make_keys(12, tag="cancel")
    await register(node, spec)
    store(node, spec, keys)
    await node.tier.wait_idle()
    victim = on_ssd(node, spec, keys)[0]
    entry = node.tier.index.ready(spec.ns_id, victim)
    assert entry is not None
    task: asyncio.Task[Any] | None = None
    read_done = node.tier.slot_reads._read_done

    def done_then_cancelled(*args: Any) -> Any:
        got = read_done(*args)
        assert task is not None and got is not None and got[1]  # from the pool
        # runs after the result is set, before the task resumes with it
        asyncio.get_running_loop().call_soon(task.cancel)
        return got

    monkeypatch.setattr(node.tier.slot_reads, "_read_done", done_then_cancelled)
    node.tier.index.pin(entry)
    task = asyncio.get_running_loop().create_task(node.tier.slot_reads.read(entry, True))
    with pytest.raises(asyncio.CancelledError):
        await task
    node.tier.unpin(entry)
    assert node.tier.reads.in_use_bytes == 0
