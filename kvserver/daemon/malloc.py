"""glibc allocator settings for processes that receive large ZMQ messages.

Runs in the daemon (``process.main`` applies them at start-up unless ``tune_malloc`` is off) and
in the bench's processes (``benchmarks.daemon_refs``, ``kvserver bench``); it imports nothing else
from the daemon, so any process may use it. Call :func:`tune_malloc` early, before threads that
allocate (ZMQ contexts, the gRPC server, I/O pools) exist: ``M_ARENA_MAX`` only limits arenas
created afterwards.

Why: with glibc's defaults a process that receives large messages returns their buffers to the
kernel after each batch — the mmap threshold adapts upwards only after a free, buffers above it
are unmapped on free, the heap top is trimmed past 128 KiB, and every thread gets an arena of
its own — and page-faults them in again on the next batch. On a VM that costs more than the
copy itself and varies from run to run (remote throughput swung 0.6x-2.8x between runs). The
settings keep up to 32 MiB allocations on the heap and freed memory in the process for reuse
(the trim threshold of 1 GiB is a ceiling on what is kept, not an allocation).

Elsewhere (musl, macOS, Windows) :func:`tune_malloc` does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import os

#: the same settings as environment variables (read by glibc at the start of a child process).
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}
# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def is_glibc() -> bool:
    """True when this process runs on GNU libc."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):  # no confstr, or not glibc
        return False


def tune_malloc() -> bool:
    """Apply :data:`MALLOC_ENV` to this process with ``mallopt``; False where not glibc (then
    nothing changed) or where glibc refused a setting."""
    if not is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = (
        (_M_ARENA_MAX, int(MALLOC_ENV["MALLOC_ARENA_MAX"])),
        (_M_MMAP_THRESHOLD, int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"])),
        (_M_TRIM_THRESHOLD, int(MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"])),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)
