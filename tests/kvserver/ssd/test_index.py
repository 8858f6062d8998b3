"""kvserver/ssd/index.py (and buffers.py): slot life cycle, capacity and eviction by every policy,
readers protecting slots, rebuild with duplicates / orphans / over-capacity / invalid slots, and
random operation sequences with the invariants checked after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserver.policies import POLICIES
from kvserver.ssd.buffers import BufferPool
from kvserver.ssd.format import BLOCK, ChunkHeader
from kvserver.ssd.index import SsdIndex, SsdState
from tests.kvserver.builders import make_keys

NS = "0123456789abcdef"
SLOT = 4 * BLOCK
KEYS = make_keys(12)
POLICY_NAMES = sorted(POLICIES)


def filled(index: SsdIndex, keys: list[bytes]) -> None:
    for key in keys:
        got = index.reserve(NS, key, SLOT)
        assert got is not None
        index.commit(got[0])


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_reserve_commit_and_lookup(policy: str) -> None:
    index = SsdIndex(4 * SLOT, policy)
    got = index.reserve(NS, KEYS[0], SLOT)
    assert got is not None
    entry, victims = got
    assert victims == [] and entry.state is SsdState.WRITING and entry.slot == 0
    assert index.ready(NS, KEYS[0]) is None, "a chunk being written is invisible"
    assert index.reserve(NS, KEYS[0], SLOT) is None, "one slot per key"
    index.commit(entry)
    assert index.ready(NS, KEYS[0]) is entry and len(index) == 1
    assert index.used_bytes == SLOT and index.usage_by_namespace() == {NS: (1, SLOT)}
    index.check_invariants()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_eviction_keeps_capacity_and_slots_wait_for_discard(policy: str) -> None:
    index = SsdIndex(4 * SLOT, policy)
    filled(index, KEYS[:4])
    got = index.reserve(NS, KEYS[4], SLOT)
    assert got is not None
    entry, victims = got
    assert len(victims) == 1 and index.get(NS, victims[0].key) is None
    assert entry.slot == 4, "the victim's slot is not reused before it is discarded"
    assert index.used_bytes == 4 * SLOT and index.num_discarding == 1
    index.commit(entry)
    index.discarded(victims[0].location)
    index.check_invariants()
    got = index.reserve(NS, KEYS[5], SLOT)
    assert got is not None and got[0].slot == victims[0].slot  # reused once discarded
    index.check_invariants()


def test_lru_victim_is_the_least_recently_used() -> None:
    index = SsdIndex(4 * SLOT, "lru")
    filled(index, KEYS[:4])
    index.touch(NS, [KEYS[0]])
    got = index.reserve(NS, KEYS[4], SLOT)
    assert got is not None and [v.key for v in got[1]] == [KEYS[1]]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_chunks_being_read_are_never_evicted(policy: str) -> None:
    index = SsdIndex(2 * SLOT, policy)
    filled(index, KEYS[:2])
    for key in KEYS[:2]:
        entry = index.ready(NS, key)
        assert entry is not None
        index.pin(entry)
    assert index.reserve(NS, KEYS[2], SLOT) is None, "every chunk is being read"
    assert index.used_bytes == 2 * SLOT and len(index) == 2
    assert index.reserve(NS, KEYS[3], 3 * SLOT) is None, "larger than the tier"
    index.check_invariants()


def test_remove_while_read_defers_the_slot() -> None:
    """A chunk found corrupt by one reader while another read is in flight."""
    index = SsdIndex(4 * SLOT)
    filled(index, KEYS[:1])
    entry = index.ready(NS, KEYS[0])
    assert entry is not None
    index.pin(entry)
    index.pin(entry)
    assert index.remove(entry) is None and index.get(NS, KEYS[0]) is None
    assert index.used_bytes == 0
    index.check_invariants()
    assert index.unpin(entry) is None
    assert index.unpin(entry) == entry.location
    index.check_invariants()
    index.discarded(entry.location)
    index.check_invariants()


def test_abort_and_failed_discard() -> None:
    index = SsdIndex(4 * SLOT)
    got = index.reserve(NS, KEYS[0], SLOT)
    assert got is not None
    slot = index.abort(got[0])
    assert index.get(NS, KEYS[0]) is None and index.used_bytes == 0
    index.discard_failed(slot)  # quarantined: never handed out again
    index.check_invariants()
    again = index.reserve(NS, KEYS[0], SLOT)
    assert again is not None and again[0].location != slot


def header(key: bytes, seq: int, ns: str = NS, part: int = 3 * BLOCK) -> ChunkHeader:
    return ChunkHeader(ns, key, seq, SLOT, part, 1, 0)


def test_restore_keeps_the_newest_copy_and_drops_the_rest() -> None:
    """A chunk written twice (slots 0 and 3, seq 5 and 9), one of another namespace, one
    invalid slot, and more chunks than fit: the rebuilt index keeps the newest of each key
    and the newest chunks that fit; every other non-blank slot is to be discarded."""
    index = SsdIndex(3 * SLOT, "lru")
    chunks = [
        (SLOT, 0, header(KEYS[0], 5)),
        (SLOT, 3, header(KEYS[0], 9)),  # newer duplicate: wins
        (SLOT, 1, header(KEYS[1], 2)),  # oldest: over capacity
        (SLOT, 2, header(KEYS[2], 7)),
        (SLOT, 4, header(KEYS[3], 8)),
        (SLOT, 5, header(KEYS[4], 6, ns="ffffffffffffffff")),  # unknown namespace
        (SLOT, 7, header(KEYS[5], 10, part=BLOCK)),  # wrong geometry for the namespace
    ]
    result = index.restore(chunks, {SLOT: 9}, [(SLOT, 6)], {NS: (3 * BLOCK, 1)})
    assert sorted(e.key for e in result.recovered) == sorted([KEYS[0], KEYS[2], KEYS[3]])
    recovered = index.ready(NS, KEYS[0])
    assert recovered is not None and recovered.slot == 3 and recovered.seq == 9
    # slots 0 and 1 are discarded; 5, 6, 7 lie past the last live slot (4): the file is cut
    assert sorted(result.discard) == [(SLOT, 0), (SLOT, 1)] and result.trimmed == {SLOT: 5}
    assert (result.duplicates, result.orphans, result.over_capacity, result.invalid) == (
        1,
        2,
        1,
        1,
    )
    index.check_invariants()
    got = index.reserve(NS, KEYS[6], SLOT)  # evicts the oldest recovered (seq 7)
    assert got is not None
    assert [v.key for v in got[1]] == [KEYS[2]]
    assert got[0].seq == 11 and got[0].slot == 5  # seq continues; the file grows again
    index.check_invariants()


def test_restore_cuts_files_after_their_last_live_slot() -> None:
    index = SsdIndex(SLOT)
    chunks = [(SLOT, 1, header(KEYS[0], 4)), (SLOT, 5, header(KEYS[1], 1))]  # seq 1: too many
    result = index.restore(chunks, {SLOT: 8, 2 * SLOT: 3}, [(SLOT, 0)], {NS: (3 * BLOCK, 1)})
    # KEYS[1] did not fit: slot 5 is not kept, so SLOT's file is cut after slot 1; the
    # 2*SLOT file holds nothing live and is cut to nothing
    assert result.trimmed == {SLOT: 2, 2 * SLOT: 0}
    assert result.discard == [(SLOT, 0)]
    index.check_invariants()
    got = index.reserve(NS, KEYS[2], SLOT)  # full: evicts KEYS[0], whose slot is discarding
    assert got is not None and got[0].slot == 2  # 0 and 1 are discarding
    index.check_invariants()


def test_restore_of_the_same_seq_twice_keeps_one() -> None:
    index = SsdIndex(4 * SLOT)
    chunks = [(SLOT, 1, header(KEYS[0], 4)), (SLOT, 0, header(KEYS[0], 4))]
    result = index.restore(chunks, {SLOT: 2}, [], {NS: (3 * BLOCK, 1)})
    assert len(result.recovered) == 1 and result.duplicates == 1
    assert result.discard == [(SLOT, 0)] and result.recovered[0].slot == 1
    index.check_invariants()


def test_chunks_past_the_bound_are_planned_into_free_slots_below_it() -> None:
    """Capacity 3 slots; the newest 3 of 5 chunks lie in slots 2..4 (0 and 1: over capacity,
    discarding). Once discarded, 3 and 4 move to 0 and 1 with new sequence numbers; one move
    fails after touching its slot (quarantined, the chunk stays), the file is cut after the
    last slot in use."""
    index = SsdIndex(3 * SLOT)
    chunks = [(SLOT, s, header(KEYS[s], s + 1)) for s in range(5)]
    result = index.restore(chunks, {SLOT: 5}, [], {NS: (3 * BLOCK, 1)})
    assert sorted(result.discard) == [(SLOT, 0), (SLOT, 1)] and index.past_bound()
    assert index.plan_moves() == []  # no free slot below the bound yet
    for slot in result.discard:
        index.discarded(slot)
    plan = index.plan_moves()
    assert [(e.key, target, seq) for e, target, seq in plan] == [
        (KEYS[4], 0, 6),
        (KEYS[3], 1, 7),
    ]
    (first, slot0, seq0), (second, slot1, _) = plan
    index.moved(first, slot0, seq0, cleared=True)
    index.move_failed(second.slot_bytes, slot1, touched=True)
    index.check_invariants()
    assert index.cut() == {SLOT: 4}  # KEYS[3] is still in slot 3
    assert index.get(NS, KEYS[4]).location == (SLOT, 0)  # type: ignore[union-attr]
    assert index.slot_state((SLOT, 1)) == "quarantined"
    index.check_invariants()
    got = index.reserve(NS, KEYS[5], SLOT)  # full: evicts the oldest; no free slot left
    assert got is not None and got[0].slot == 4
    index.check_invariants()


def test_spare_slots_past_the_slack_go_back_highest_first_and_low_slots_are_reused() -> None:
    """Capacity 8 slots filled with chunks of one size, then taken over by chunks of twice the
    size: once the first size's slots are discarded, those past the slack are handed out to
    release, highest first (the files then hold about the capacity, not one per slot size);
    a released slot is free again, and a new chunk takes the lowest free slot."""
    index = SsdIndex(8 * SLOT)
    assert index.slack_bytes == 8 * SLOT // 16
    filled(index, KEYS[:8])
    victims = []
    for key in make_keys(4, tag="big"):
        got = index.reserve(NS, key, 2 * SLOT)
        assert got is not None
        index.commit(got[0])
        victims += got[1]
    assert len(victims) == 8 and index.to_release() == []  # nothing spare yet
    for v in victims:
        index.discarded(v.location)
    assert index.spare_bytes == 8 * SLOT
    released = index.to_release()
    assert released == [(SLOT, s) for s in range(0, 8)], "all spare: past the slack"
    assert index.spare_bytes == 0 and index.num_releasing == 8
    index.check_invariants()
    for slot in released:
        index.released(slot, ok=True)
    assert index.spare_bytes == 0 and index.slot_state((SLOT, 7)) == "free"
    index.check_invariants()
    got = index.reserve(NS, KEYS[9], SLOT)
    assert got is not None and got[0].slot == 0, "lowest free slot first"


def test_within_the_slack_spare_slots_keep_their_blocks_and_a_refusal_stops_releases() -> None:
    """One spare slot of 2 over the slack is released (the highest); where the filesystem
    refuses, the slot stays spare and no more releases are asked for in this run."""
    index = SsdIndex(32 * SLOT)  # slack 2 slots
    filled(index, make_keys(32, tag="a"))
    victims = []
    for key in make_keys(3, tag="big"):
        got = index.reserve(NS, key, SLOT)
        assert got is not None
        victims += got[1]
        index.commit(got[0])
    for v in victims:
        index.discarded(v.location)
    assert index.used_bytes + index.spare_bytes == 35 * SLOT
    (slot,) = index.to_release()  # 35 slots held, 34 allowed
    assert slot == max(v.location for v in victims)
    index.released(slot, ok=False)
    assert not index.can_release and index.spare_bytes == 3 * SLOT
    assert index.to_release() == []
    index.check_invariants()


def test_restoring_a_huge_sparse_file_lists_slots_by_the_capacity_not_its_length() -> None:
    """A file 4 Mi slots long with one valid chunk at its end (a huge sparse file): the free
    list is bounded by the capacity (was: one entry per slot of the file, ~150 MB here); the
    chunk moves below the bound and the file is cut to one slot."""
    import tracemalloc

    index = SsdIndex(8 * SLOT)
    last = (1 << 22) - 1
    tracemalloc.start()
    index.restore([(SLOT, last, header(KEYS[0], 5))], {SLOT: last + 1}, [], {NS: (3 * BLOCK, 1)})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak
    index.check_invariants()
    ((entry, target, seq),) = index.plan_moves()
    assert target == 0 and index.slot_state((SLOT, 1 << 21)) == "unlisted"
    index.moved(entry, target, seq, cleared=True)
    assert index.cut() == {SLOT: 1}
    index.check_invariants()


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["write", "fail", "pin", "unpin", "remove", "discard", "touch", "release", "punched"]
        ),
        st.integers(0, len(KEYS) - 1),
    ),
    max_size=60,
)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(steps=ops)
def test_random_operations_keep_the_invariants(policy: str, steps: list[tuple[str, int]]) -> None:
    index = SsdIndex(5 * SLOT + BLOCK, policy)
    pins: list[object] = []
    discarding: list[tuple[int, int]] = []
    releasing: list[tuple[int, int]] = []
    for op, i in steps:
        key = KEYS[i]
        entry = index.get(NS, key)
        if op in ("write", "fail") and entry is None:
            got = index.reserve(NS, key, SLOT if i % 3 else 2 * SLOT)
            if got is not None:
                new, victims = got
                discarding += [v.location for v in victims]
                if op == "write":
                    index.commit(new)
                else:
                    discarding.append(index.abort(new))
        elif op == "pin" and entry is not None and entry.state is SsdState.READY:
            index.pin(entry)
            pins.append(entry)
        elif op == "unpin" and pins:
            slot = index.unpin(pins.pop(i % len(pins)))  # type: ignore[arg-type]
            if slot is not None:
                discarding.append(slot)
        elif op == "remove" and entry is not None and entry.state is SsdState.READY:
            slot = index.remove(entry)
            if slot is not None:
                discarding.append(slot)
        elif op == "discard" and discarding:
            index.discarded(discarding.pop(i % len(discarding)))
        elif op == "touch":
            index.touch(NS, [key])
        elif op == "release":
            releasing += index.to_release()
            if index.can_release:
                assert index.used_bytes + index.spare_bytes <= 5 * SLOT + BLOCK + index.slack_bytes
        elif op == "punched" and releasing:
            index.released(releasing.pop(i % len(releasing)), ok=i != 5)
        index.check_invariants()
        assert index.used_bytes <= index.capacity_bytes


def test_buffer_pool_is_bounded_and_reuses() -> None:
    pool = BufferPool(3 * SLOT)
    a, b, c = (pool.acquire(SLOT) for _ in range(3))
    assert a is not None and b is not None and c is not None
    assert pool.acquire(SLOT) is None, "a full staging area is a normal result"
    pool.release(a)
    again = pool.acquire(SLOT)
    assert again is a, "released buffers are reused"
    pool.release(b)
    big = pool.acquire(2 * SLOT)
    assert big is None  # b is cached, c and again are in use: only 1 slot free
    pool.release(c)
    big = pool.acquire(2 * SLOT)
    assert big is not None and pool.in_use_bytes + pool.cached_bytes <= pool.limit_bytes
    assert big.nbytes == 2 * SLOT
