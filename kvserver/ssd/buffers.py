"""A bounded pool of page-aligned I/O buffers (the write-back staging area, read bounce buffers).

Owned by the tier on the daemon's event loop: ``acquire``/``release`` are called from the loop
only (the I/O threads use the buffers in between but never call the pool). Not thread-safe.

Invariant: ``in_use_bytes + cached_bytes <= limit_bytes``. A request that does not fit even
after dropping the cache gets None: a full staging area is a normal result (the caller skips
the write-back), never a wait. Released buffers are kept per size for reuse (allocating an
mmap and faulting its pages in costs more than the copy itself).
"""

from __future__ import annotations

from kvserver.ssd.fileio import aligned_buffer


class BufferPool:
    """See the module docstring."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self._cache: dict[int, list[memoryview]] = {}

    def acquire(self, nbytes: int) -> memoryview | None:
        """A buffer of exactly ``nbytes`` (contents undefined), or None if over the limit."""
        cached = self._cache.get(nbytes)
        if cached:
            buf = cached.pop()
            self.cached_bytes -= nbytes
        else:
            if self.in_use_bytes + nbytes > self.limit_bytes:
                return None
            while self.in_use_bytes + self.cached_bytes + nbytes > self.limit_bytes:
                self._drop_one()
            buf = aligned_buffer(nbytes)
        self.in_use_bytes += nbytes
        return buf

    def release(self, buf: memoryview) -> None:
        """Give a buffer from :meth:`acquire` back (kept for reuse)."""
        nbytes = buf.nbytes
        self.in_use_bytes -= nbytes
        self._cache.setdefault(nbytes, []).append(buf)
        self.cached_bytes += nbytes

    def clear(self) -> None:
        """Drop every cached buffer (buffers in use stay valid)."""
        self._cache.clear()
        self.cached_bytes = 0

    def _drop_one(self) -> None:
        for size, bufs in self._cache.items():
            if bufs:
                bufs.pop()
                self.cached_bytes -= size
                return
        raise AssertionError("cache accounting is off")  # pragma: no cover
