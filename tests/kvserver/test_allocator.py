"""Tests of kvserver.allocator: page accounting, failure without side effects, extents."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserver.allocator import PageAllocator
from kvserver.errors import InvalidArgument
from tests.kvserver.builders import PAGE


def snapshot(alloc: PageAllocator) -> tuple[list[int], bytes]:
    return list(alloc._free), bytes(alloc._is_free)


# ---------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("num_pages", "page_size"),
    [(0, PAGE), (-1, PAGE), (4, 2048), (4, 3 * PAGE), (4, PAGE + 1), (4, 0)],
)
def test_invalid_geometry(num_pages: int, page_size: int) -> None:
    with pytest.raises(InvalidArgument):
        PageAllocator(num_pages, page_size)


@pytest.mark.parametrize(
    ("nbytes", "pages"), [(0, 0), (1, 1), (PAGE - 1, 1), (PAGE, 1), (PAGE + 1, 2), (5 * PAGE, 5)]
)
def test_pages_for(nbytes: int, pages: int) -> None:
    assert PageAllocator(8, PAGE).pages_for(nbytes) == pages


# ---------------------------------------------------------------------------- accounting


def test_fresh_arena_hands_out_ascending_contiguous_pages() -> None:
    alloc = PageAllocator(8, PAGE)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    assert alloc.num_free == 3


def test_allocate_free_accounting() -> None:
    alloc = PageAllocator(10, PAGE)
    a = alloc.allocate(4)
    b = alloc.allocate(6)
    assert a is not None and b is not None
    assert alloc.num_free == 0
    assert set(a).isdisjoint(b) and set(a) | set(b) == set(range(10))
    alloc.free(a)
    assert alloc.num_free == 4
    alloc.free(b)
    assert alloc.num_free == 10
    assert sorted(alloc.allocate(10) or []) == list(range(10))


def test_allocate_zero_is_empty() -> None:
    alloc = PageAllocator(2, PAGE)
    assert alloc.allocate(0) == []
    assert alloc.num_free == 2


def test_allocate_more_than_free_returns_none_and_changes_nothing() -> None:
    alloc = PageAllocator(5, PAGE)
    assert alloc.allocate(3) == [0, 1, 2]
    before = snapshot(alloc)
    assert alloc.allocate(3) is None
    assert snapshot(alloc) == before
    assert alloc.num_free == 2
    assert alloc.allocate(2) == [3, 4]


def test_negative_count_rejected() -> None:
    """allocate(-2) must not hand out "all but two" pages (negative slice)."""
    alloc = PageAllocator(5, PAGE)
    before = snapshot(alloc)
    with pytest.raises(InvalidArgument):
        alloc.allocate(-2)
    assert snapshot(alloc) == before


def test_double_free_detected() -> None:
    alloc = PageAllocator(4, PAGE)
    pages = alloc.allocate(2)
    assert pages is not None
    alloc.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(pages)
    assert alloc.num_free == 4


def test_double_free_detected_before_anything_changes() -> None:
    """free([allocated, already-free]) raised after marking the first page free: a leak."""
    alloc = PageAllocator(4, PAGE)
    assert alloc.allocate(2) == [0, 1]
    before = snapshot(alloc)
    with pytest.raises(AssertionError):
        alloc.free([1, 2])  # page 2 was never handed out
    assert snapshot(alloc) == before
    alloc.free([0, 1])  # page 1 is still owned by the caller: freeing it works
    assert alloc.num_free == 4


def test_duplicate_page_in_one_free_detected_before_anything_changes() -> None:
    """free([3, 3]) marked page 3 free and then raised, without returning it to the stack."""
    alloc = PageAllocator(4, PAGE)
    assert alloc.allocate(4) == [0, 1, 2, 3]
    before = snapshot(alloc)
    with pytest.raises(AssertionError):
        alloc.free([3, 3])
    assert snapshot(alloc) == before


@pytest.mark.parametrize("page", [-1, 4, 100])
def test_free_out_of_range_detected(page: int) -> None:
    """free([-1]) silently freed the last page (negative index into the free map)."""
    alloc = PageAllocator(4, PAGE)
    assert alloc.allocate(4) is not None
    before = snapshot(alloc)
    with pytest.raises(AssertionError):
        alloc.free([page])
    assert snapshot(alloc) == before


def test_lifo_reuse_keeps_parts_contiguous() -> None:
    alloc = PageAllocator(12, PAGE)
    a, b, c = alloc.allocate(4), alloc.allocate(4), alloc.allocate(4)
    assert b == [4, 5, 6, 7] and a is not None and c is not None
    alloc.free(b)
    again = alloc.allocate(4)
    assert again == b
    assert alloc.extents(again, 4 * PAGE) == ((4 * PAGE, 4 * PAGE),)


def test_lifo_after_interleaved_frees() -> None:
    alloc = PageAllocator(12, PAGE)
    parts = [alloc.allocate(3) for _ in range(4)]
    alloc.free(parts[1] or [])
    alloc.free(parts[3] or [])
    # Last freed comes back first, each still one contiguous run.
    assert alloc.allocate(3) == [9, 10, 11]
    assert alloc.allocate(3) == [3, 4, 5]
    assert alloc.allocate(1) is None


# ---------------------------------------------------------------------------- extents


@pytest.mark.parametrize(
    ("pages", "nbytes", "expected"),
    [
        ([0], PAGE, ((0, PAGE),)),
        ([0], 100, ((0, 100),)),
        ([2, 3, 4], 3 * PAGE, ((2 * PAGE, 3 * PAGE),)),
        ([2, 3, 4], 2 * PAGE + 1, ((2 * PAGE, 2 * PAGE + 1),)),
        ([1, 3], 2 * PAGE, ((PAGE, PAGE), (3 * PAGE, PAGE))),
        ([1, 3], PAGE + 10, ((PAGE, PAGE), (3 * PAGE, 10))),
        (
            [0, 1, 5, 6, 9],
            5 * PAGE - 7,
            ((0, 2 * PAGE), (5 * PAGE, 2 * PAGE), (9 * PAGE, PAGE - 7)),
        ),
    ],
)
def test_extents_coalesce_and_trim_exactly(
    pages: list[int], nbytes: int, expected: tuple[tuple[int, int], ...]
) -> None:
    extents = PageAllocator(16, PAGE).extents(pages, nbytes)
    assert extents == expected
    assert sum(length for _, length in extents) == nbytes


# ---------------------------------------------------------------------------- property


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_random_allocate_free_never_double_hands_out(ops: list[tuple[bool, int]]) -> None:
    alloc = PageAllocator(16, PAGE)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            before = alloc.num_free
            got = alloc.allocate(n)
            if got is None:
                assert n > before and alloc.num_free == before
                continue
            assert got == sorted(got) and len(got) == n
            held.append(got)
        elif held:
            alloc.free(held.pop(n % len(held)))
        owned = [p for pages in held for p in pages]
        assert len(owned) == len(set(owned))
        assert alloc.num_free + len(owned) == alloc.num_pages
        assert set(alloc._free).isdisjoint(owned)
