"""Page allocator for the DRAM arena.

Runs inside the storage engine (single owner, no locks). The arena is cut into fixed-size pages;
a part of any size occupies ``ceil(part_bytes / page_size)`` pages, which need not be adjacent.
This is what lets namespaces with different part sizes share one byte budget without external
fragmentation: any freed page can serve any namespace. Pages handed out by one ``allocate`` call
are sorted and coalesced into byte *extents* ``(offset, length)``, so on a fresh or
recently-freed arena a part is usually one contiguous extent.

Invariants:
- every page is either in the free stack or owned by exactly one caller;
- ``num_free + (pages handed out and not yet freed) == num_pages``;
- ``free`` of a page that is already free is a bug in the caller and is detected.
"""

from __future__ import annotations

from kvserver.errors import InvalidArgument

#: A part's location in the arena: ``((offset, length), ...)`` in bytes, ascending offsets.
Extents = tuple[tuple[int, int], ...]


class PageAllocator:
    """Hands out page numbers from a LIFO free stack (pages freed together come back together)."""

    __slots__ = ("_free", "_is_free", "num_pages", "page_size")

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise InvalidArgument("arena must hold at least one page", num_pages=num_pages)
        if page_size < 4096 or page_size & (page_size - 1):
            raise InvalidArgument("page_size must be a power of two >= 4096", page_size=page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        # Reversed so that pop() hands out 0, 1, 2, ... on a fresh arena.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, nbytes: int) -> int:
        """Pages needed to hold ``nbytes``."""
        return -(-nbytes // self.page_size)

    def allocate(self, count: int) -> list[int] | None:
        """Take ``count`` pages, ascending; ``None`` (nothing changed) if fewer are free."""
        if count < 0:
            raise InvalidArgument("page count must be >= 0", count=count)
        free = self._free
        if count > len(free):
            return None
        if count == 0:
            return []
        pages = free[-count:]
        del free[-count:]
        pages.sort()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages. REQUIRES: each page was allocated and not yet freed.

        A violation raises AssertionError before anything changes.
        """
        is_free = self._is_free
        if len(set(pages)) != len(pages):
            raise AssertionError("page freed twice in one call")
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise AssertionError(f"page {p} out of range")
            if is_free[p]:
                raise AssertionError(f"page {p} freed twice")
        for p in pages:
            is_free[p] = 1
        # Push in descending order so the next allocate pops them ascending (contiguous).
        self._free.extend(sorted(pages, reverse=True))

    def extents(self, pages: list[int], nbytes: int) -> Extents:
        """Coalesce ascending ``pages`` into byte extents covering exactly ``nbytes``."""
        size = self.page_size
        out: list[tuple[int, int]] = []
        start = prev = pages[0]
        for p in pages[1:]:
            if p != prev + 1:
                out.append((start * size, (prev - start + 1) * size))
                start = p
            prev = p
        out.append((start * size, (prev - start + 1) * size))
        # Trim the tail so the extents cover exactly nbytes.
        excess = len(pages) * size - nbytes
        if excess:
            off, length = out[-1]
            out[-1] = (off, length - excess)
        return tuple(out)
