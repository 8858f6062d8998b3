"""Copies into and out of one mapping, the co-located path's copies without kvserver: by the
kind of mapping (page size) and by where the private buffer on the other side lies (its
distance from the mapping modulo 4 KiB). Which of the two makes the arena read slower than
memcpy (docs/benchmarks.md, "Daemon data plane and Lookup", session 14).

Usage::

    python -m benchmarks.arena_copy [--part 256KiB] [--batch 64MiB] [--repeats 15]
        [--mappings shm,anon,anon-thp,memfd,hugetlb] [--distances 0,16,64]

Runs in this process, single-threaded. Each mapping (``shm``: a /dev/shm file mapped shared
and pre-faulted, as the arena is; ``anon``: private anonymous; ``anon-thp``: the same with
``madvise(MADV_HUGEPAGE)``; ``memfd``; ``hugetlb``: a memfd with ``MFD_HUGETLB``, which needs
``/proc/sys/vm/nr_hugepages`` raised) gets ``--batch`` bytes written from a source buffer and
read back into a destination buffer at each distance, one slice assignment per ``--part``,
rounds interleaved; a mapping the system cannot give is reported as such. Prints the median
milliseconds per batch of each write and read.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Callable

MADV_HUGEPAGE = 14
PAGE = 4096


def _address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _shm(size: int) -> mmap.mmap:
    path = f"/dev/shm/kvserver-arena-copy-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


def _memfd(size: int, flags: int = 0) -> mmap.mmap:
    fd = os.memfd_create("kvserver-arena-copy", flags)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


def _anon(size: int, huge: bool = False) -> mmap.mmap:
    mapping = mmap.mmap(-1, size, mmap.MAP_PRIVATE)
    if huge:
        mapping.madvise(MADV_HUGEPAGE)
    return mapping


MAPPINGS: dict[str, Callable[[int], mmap.mmap]] = {
    "shm": _shm,
    "anon": _anon,
    "anon-thp": lambda size: _anon(size, huge=True),
    "memfd": _memfd,
    "hugetlb": lambda size: _memfd(size, os.MFD_HUGETLB),
}


def _at(buf: memoryview, size: int, distance: int) -> memoryview:
    """``size`` bytes of ``buf`` starting ``distance`` past a page boundary."""
    start = (distance - _address(buf)) % PAGE
    return buf[start : start + size]


def _copy(dst: memoryview, src: memoryview, part: int) -> float:
    start = time.perf_counter()
    for pos in range(0, src.nbytes, part):
        dst[pos : pos + part] = src[pos : pos + part]
    return time.perf_counter() - start


def measure(
    part: int, batch: int, repeats: int, mappings: list[str], distances: list[int]
) -> dict[str, dict[str, float] | str]:
    """Median seconds per batch: per mapping, ``write`` and ``read@D`` for each distance D
    (``PAGE`` > D >= 0); a mapping the system refused: why, as a string."""
    source = memoryview(bytearray(os.urandom(batch + PAGE)))
    src = _at(source, batch, 0)
    out = memoryview(bytearray(batch + PAGE))
    views: dict[str, memoryview] = {}
    results: dict[str, dict[str, float] | str] = {}
    for name in mappings:
        try:
            views[name] = memoryview(MAPPINGS[name](batch))
        except OSError as exc:
            results[name] = f"unavailable: {exc.strerror}"
    times: dict[str, dict[str, list[float]]] = {name: {} for name in views}
    for _ in range(repeats):
        for name, view in views.items():
            for d in distances:
                columns = times[name]
                columns.setdefault("write", []).append(_copy(view, src, part))
                columns.setdefault(f"read@{d}", []).append(_copy(_at(out, batch, d), view, part))
    for name, columns in times.items():
        results[name] = {column: statistics.median(ts) for column, ts in columns.items()}
    return results


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="256KiB", help="bytes per copy (default 256KiB)")
    parser.add_argument("--batch", default="64MiB", help="bytes per round (default 64MiB)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--mappings", default=",".join(MAPPINGS))
    parser.add_argument("--distances", default="0,16,64", help="bytes past a page, < 4096")
    args = parser.parse_args()
    part, batch = _size(args.part), _size(args.batch)
    distances = [int(d) for d in args.distances.split(",")]
    if batch % part or not all(0 <= d < PAGE for d in distances):
        parser.error("--batch must be a multiple of --part; distances in 0..4095")
    results = measure(part, batch, args.repeats, args.mappings.split(","), distances)
    print(f"{args.batch} in parts of {args.part}, median of {args.repeats}, ms; "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name, row in results.items():
        if isinstance(row, str):
            print(f"{name:9s} {row}")
        else:
            print(f"{name:9s} " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
