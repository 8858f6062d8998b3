"""kvserver/daemon/writeback.py's release of spare slots, in one process: a KVService with a
tiny DRAM tier over a real SSD directory whose namespaces' mix of chunk sizes changes, with
and without a filesystem that can punch holes (refusal injected through the FileIO seam).
The daemon-level bound is measured in ``test_ssd_space``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvserver.ssd import format as fmt
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_tiering import SPECS, expected, load, on_ssd, register, start
from tests.kvserver.daemon.test_tiering import stop as stop_node
from tests.kvserver.daemon.test_tiering import store as store_keys
from tests.kvserver.ssd.faults import FaultyIO

SMALL = SPECS[1]  # slot 12 KiB
BIG = make_spec(model="test/big", part_bytes_override=20_000)  # slot 24 KiB
SMALL_SLOT, BIG_SLOT = fmt.slot_bytes_for(5000), fmt.slot_bytes_for(20_000)
CAPACITY = 32 * SMALL_SLOT


class NoPunchIO(FaultyIO):
    """A filesystem without FALLOC_FL_PUNCH_HOLE."""

    def punch(self, fd: int, offset: int, length: int) -> bool:
        return False


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.glob("slots-*.dat"))


@pytest.mark.parametrize("punch", [True, False], ids=["punched", "refused"])
async def test_a_change_of_chunk_size_releases_the_old_sizes_slots_or_keeps_them_safely(
    tmp_path: Path, punch: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Small chunks fill the tier, big ones take it over. Punched: the small file's spare
    slots past the slack go back (the files hold at most capacity + slack + one
    preallocation step per file). Refused: the slots stay spare, one warning, no more
    release attempts, the tier stays ``ok``. Either way every chunk on SSD loads byte-exact
    and both tiers' invariants hold."""
    node = await start(tmp_path / "ssd", capacity_bytes=CAPACITY)
    if not punch:
        node.tier.store.io = NoPunchIO()
    try:
        await register(node, SMALL)
        await register(node, BIG)
        small, big = make_keys(48, tag="small"), make_keys(24, tag="big")
        store_keys(node, SMALL, small)
        await node.tier.wait_idle()
        store_keys(node, BIG, big)
        await node.tier.wait_idle()
        tier, stats = node.tier, node.svc.stats()["ssd"]
        tier.index.check_invariants()
        assert stats["condition"] == "ok" and stats["freeing_slots"] == 0
        slack = tier.index.slack_bytes
        if punch:
            assert stats["released_slots"] > 0 and tier.index.can_release
            assert disk_bytes(tmp_path / "ssd") <= CAPACITY + slack + SMALL_SLOT + BIG_SLOT
        else:
            assert stats["released_slots"] == 0 and not tier.index.can_release
            assert stats["spare_bytes"] > slack
            warnings = [r for r in caplog.records if "keep their disk space" in r.getMessage()]
            assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        for spec, keys in ((BIG, big), (SMALL, small)):
            cold = [k for k in on_ssd(node, spec, keys) if not node.engine.contains(spec.ns_id, k)]
            for key in cold[-3:]:
                assert await load(node, spec, [key]) == [expected(spec, key)]
        await tier.wait_idle()
        assert node.svc.stats()["ssd"]["corrupt_chunks"] == 0
        tier.index.check_invariants()
        node.engine.check_invariants()
    finally:
        await stop_node(node)
