"""The SSD tier's disk space and start-up memory, in real daemon processes on real files.

``--ssd`` is a promise to the operator: while the daemon runs, its data files hold about that
much disk (measured as allocated blocks, ``st_blocks``), whatever the mix of chunk sizes; and a
data file far longer than the capacity (a huge sparse file) costs start-up memory in
proportion to the capacity, not to the file's length. Shared helpers: ``test_ssd_daemon``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvserver.client import KVClient
from kvserver.namespace import NamespaceSpec
from kvserver.ssd import format as fmt
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_ssd_daemon import (
    SLOT,
    SPEC,
    data_file,
    expected,
    headers,
    on_ssd_only,
    registered,
    ssd,
    start,
    store_all,
)
from tests.support.daemon import wait_until

pytestmark = pytest.mark.multiprocess

CAPACITY = 8 << 20  # test_ssd_daemon.args: --ssd 8MiB
BIG = make_spec(model="test/big", part_bytes_override=28_000)  # slot 32 KiB
BIG_SLOT = fmt.slot_bytes_for(28_000)


def disk_bytes(ssd_dir: Path) -> int:
    """Disk blocks allocated to the data files (st_blocks, 512-byte units)."""
    return sum(p.stat().st_blocks * 512 for p in ssd_dir.glob("slots-*.dat"))


def quiet(kv: KVClient) -> dict[str, Any]:
    """SSD stats once no write-down, discard or release is in flight."""
    stats: dict[str, Any] = wait_until(
        lambda: (s := ssd(kv))["writes_in_flight"] == 0 and s["freeing_slots"] == 0 and s
    )
    return stats


def read_back(kv: KVClient, ns_id: str, spec: NamespaceSpec, keys: list[bytes]) -> None:
    for key in keys:
        assert [bytes(p) for p in kv.load(ns_id, [key])[0]] == expected(spec, key), key.hex()


def test_disk_use_stays_within_the_capacity_while_the_mix_of_chunk_sizes_changes(
    tmp_path: Path,
) -> None:
    """8 MiB of 16 KiB chunks, then 8 MiB of 32 KiB chunks that take the capacity over, then
    16 KiB chunks again: after each phase the data files hold at most the capacity plus 1/16
    of it spare plus 1/16 preallocated per file (9.5 MiB); was: 64 MiB preallocated per file,
    and the slots of the evicted size kept (up to the capacity per chunk size). The chunks
    left on SSD load byte-exact (a released slot is never read as a chunk)."""
    ssd_dir = tmp_path / "ssd"
    bound = CAPACITY + 3 * CAPACITY // 16
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            small, big = registered(kv, SPEC), registered(kv, BIG)
            phases = [
                (small, SPEC, make_keys(600, tag="small-1")),
                (big, BIG, make_keys(300, tag="big")),
                (small, SPEC, make_keys(600, tag="small-2")),
            ]
            used = []
            for ns_id, spec, keys in phases:
                store_all(kv, ns_id, spec, keys)
                stats = quiet(kv)
                used.append(disk_bytes(ssd_dir))
                assert used[-1] <= bound, (used, stats)
                assert stats["used_bytes"] > CAPACITY - BIG_SLOT  # the capacity was taken
                # the newest chunks of the phase on SSD load byte-exact (a load promotes, and
                # what it evicts from DRAM goes down and evicts the oldest on SSD)
                read_back(kv, ns_id, spec, on_ssd_only(kv, ns_id, keys)[-6:])
            stats = ssd(kv)
            assert stats["released_slots"] > 0 and stats["condition"] == "ok"
            assert stats["corrupt_chunks"] == 0
    finally:
        assert d.terminate() == 0, d.log()
    print(f"disk after each phase: {[u >> 10 for u in used]} KiB (bound {bound >> 10} KiB)")


def vm_hwm_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM, KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_huge_sparse_data_file_costs_start_up_memory_by_the_capacity_not_its_length(
    tmp_path: Path,
) -> None:
    """A data file 8 Mi slots long (128 GiB, sparse) whose only data is one valid chunk in its
    last slot: the daemon starts with about the peak memory of one on an empty directory
    (was: one free-list entry per slot, ~300 MiB more), serves the chunk byte-exact from slot
    0 and cuts the file to one slot."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            store_all(kv, ns_id, SPEC, make_keys(80, tag="sparse"))
            quiet(kv)
            reference = vm_hwm_kib(d.proc.pid)
    finally:
        assert d.terminate() == 0, d.log()
    path = data_file(ssd_dir)
    key, (slot, _) = next(iter(headers(path).items()))
    with open(path, "rb") as f:
        f.seek(slot * SLOT)
        one = f.read(SLOT)
    last = (1 << 23) - 1
    os.truncate(path, 0)
    with open(path, "r+b") as f:
        f.seek(last * SLOT)
        f.write(one)
    assert path.stat().st_size == (last + 1) * SLOT and path.stat().st_blocks * 512 <= 2 * SLOT
    d = start(tmp_path, ssd_dir)
    try:
        hwm = vm_hwm_kib(d.proc.pid)
        with KVClient(d.zmq_address, colocated=False) as kv:
            assert ssd(kv)["recovered_chunks"] == 1
            assert path.stat().st_size == SLOT and headers(path)[key][0] == 0
            kv.register_namespace(SPEC)
            assert [bytes(p) for p in kv.get(ns_id, [key])[0]] == expected(SPEC, key)
        assert "moved 1 chunks below the capacity bound" in d.log()
    finally:
        assert d.terminate() == 0, d.log()
    print(f"peak RSS: reference {reference >> 10} MiB, huge sparse file {hwm >> 10} MiB")
    assert hwm < reference + (48 << 10), (reference, hwm)
