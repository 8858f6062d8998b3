"""RequestState (scheduler/kv_connector_request.py): the scheduler connector's per-request
state changes only through its methods, which enforce its invariants."""

from __future__ import annotations

import pytest

from kvserver.errors import InvalidState
from kvserver.hashing import BlockHasher
from scheduler.kv_connector_request import RequestState
from scheduler.request import Request


def state(num_tokens: int = 64) -> RequestState:
    return RequestState(Request("r", list(range(num_tokens)), max_tokens=4))


def test_a_chunk_below_the_cursor_is_never_planned_again() -> None:
    s = state()
    s.store_planned(0, 2)
    s.store_reserved(2)
    s.store_finished()
    with pytest.raises(InvalidState, match="never planned again"):
        s.store_planned(1, 3)
    assert (s.cursor, s.num_stores) == (2, 0)  # nothing changed
    s.store_planned(2, 3)
    assert s.num_stores == 1


def test_the_cursor_moves_back_only_on_a_new_block_table_or_a_failed_load() -> None:
    s = state()
    s.store_planned(0, 4)
    s.store_reserved(4)
    s.store_reserved(2)  # an older answer never moves it back
    assert s.cursor == 4
    s.load_failed(3)  # chunk 3 is recomputed: stored afterwards
    assert s.cursor == 3
    s.load_failed(5)  # a failed chunk past the cursor changes nothing
    assert s.cursor == 3
    s.restart(0)  # preempted and admitted again
    s.store_planned(0, 1)
    assert s.cursor == 0 and s.num_stores == 2


def test_a_refused_store_is_planned_again_unless_refused_for_good() -> None:
    s = state()
    s.store_planned(0, 2)
    s.store_refused(2, for_good=False)  # unreachable, or the cache is full
    assert (s.cursor, s.num_stores) == (0, 0)
    s.store_planned(0, 2)
    s.store_refused(2, for_good=True)  # the daemon refused these chunks
    assert (s.cursor, s.num_stores) == (2, 0)


def test_counts_never_go_below_zero() -> None:
    s = state()
    with pytest.raises(InvalidState):
        s.store_finished()
    with pytest.raises(InvalidState):
        s.load_finished()
    assert (s.num_loads, s.num_stores) == (0, 0)


def test_a_finished_request_is_done_when_its_last_transfer_is_over() -> None:
    s = state()
    assert s.finish_when_idle() is False and not s.finished  # nothing in flight: let go now
    s.load_pinned(2)
    s.store_planned(2, 3)
    assert s.cursor == 2 and s.is_busy
    assert s.finish_when_idle() is True and not s.is_done
    s.load_finished()
    assert not s.is_done
    s.store_share_over()
    assert s.is_done


def test_taking_the_offer_sets_the_block_table_and_forgets_the_offer() -> None:
    s = state()
    s.offered((0, 0, [b"k"]))
    assert s.take_offer([1, 2, 3]) == (0, 0, [b"k"])
    assert s.offer is None and s.block_ids == [1, 2, 3]
    s.append_blocks([4])
    s.preempted()
    assert s.block_ids == [] and s.offer is None


def test_block_hashes_are_computed_and_extended_when_the_request_has_none() -> None:
    hasher = BlockHasher("sha256_cbor", 16, "0")
    s = RequestState(Request("r", list(range(40)), max_tokens=4))
    assert not s.request.block_hashes
    assert list(s.block_hashes(hasher)) == hasher.hash_blocks(list(range(32)))
