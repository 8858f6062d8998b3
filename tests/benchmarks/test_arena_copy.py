"""benchmarks/arena_copy.py: every mapping asked for gets its write and a read per distance
(or says why the system refused it), and a buffer placed at a distance lies there."""

from __future__ import annotations

import ctypes

from benchmarks.arena_copy import PAGE, _at, measure


def test_at_places_the_view_that_far_past_a_page() -> None:
    buf = memoryview(bytearray(3 * PAGE))
    for distance in (0, 16, 4000):
        view = _at(buf, PAGE, distance)
        assert view.nbytes == PAGE
        assert ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE == distance


def test_measure_reports_each_mapping_and_distance() -> None:
    results = measure(64 << 10, 256 << 10, 1, ["shm", "anon", "anon-thp", "hugetlb"], [0, 16])
    assert set(results) == {"shm", "anon", "anon-thp", "hugetlb"}
    for name in ("shm", "anon", "anon-thp"):
        row = results[name]
        assert isinstance(row, dict)
        assert set(row) == {"write", "read@0", "read@16"}
        assert all(seconds > 0 for seconds in row.values())
    hugetlb = results["hugetlb"]  # needs huge pages reserved: either measured or refused
    assert isinstance(hugetlb, dict) or hugetlb.startswith("unavailable: ")
