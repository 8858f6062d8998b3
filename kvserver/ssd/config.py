"""Settings and counters of the SSD tier: plain validated data, shared by the daemon's config
(``kvserver/daemon/config.py``) and the tier (``kvserver/daemon/tiering.py``). No I/O but
:func:`disk_room`'s (a statvfs and a directory listing, at start-up)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvserver.errors import InvalidArgument
from kvserver.policies import make_policy
from kvserver.ssd.format import slot_bytes_for


@dataclass(frozen=True, slots=True)
class TierConfig:
    """SSD tier settings (from ``DaemonConfig.tier_config()``). Validated on construction."""

    directory: str
    capacity_bytes: int = 1 << 30
    #: write a DRAM victim down only if it was used at least this many times.
    admission: int = 2
    policy: str = "lru"
    io_threads: int = 4
    #: bytes of evicted chunks waiting to be written (and of promotion read buffers); also
    #: the most bytes of chunks served straight from SSD alive at once (promotion.py).
    staging_bytes: int = 64 << 20
    retry_s: float = 5.0
    #: "auto" (O_DIRECT when the filesystem allows it) or "off".
    direct: str = "auto"
    #: seconds ``close`` waits for disk jobs in flight before abandoning them.
    drain_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.directory:
            raise InvalidArgument("the SSD tier needs a directory")
        # each message names the daemon's setting (DaemonConfig's field, the flag's name)
        if self.capacity_bytes < slot_bytes_for(1):
            raise InvalidArgument(
                f"ssd (the SSD tier's capacity) must hold one slot at least, "
                f"{slot_bytes_for(1)} bytes",
                value=self.capacity_bytes,
            )
        for name, value in (("ssd_admission", self.admission),
                            ("ssd_io_threads", self.io_threads),
                            ("ssd_staging", self.staging_bytes)):  # fmt: skip
            if value < 1:
                raise InvalidArgument(f"{name} must be >= 1", value=value)
        if not 0 < self.retry_s < math.inf:
            raise InvalidArgument("ssd_retry_s must be a positive number", value=self.retry_s)
        if not 0 < self.drain_timeout_s < math.inf:
            raise InvalidArgument(
                "ssd_drain_timeout_s must be a positive number", value=self.drain_timeout_s
            )
        if self.direct not in ("auto", "off"):
            raise InvalidArgument("ssd_direct must be auto or off", value=self.direct)
        make_policy(self.policy)  # names the valid choices when wrong


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters of the SSD tier (chunks unless named otherwise)."""

    lookups: int = 0
    hit_chunks: int = 0
    miss_chunks: int = 0
    stored_chunks: int = 0
    loaded_chunks: int = 0
    promoted_chunks: int = 0
    served_direct_chunks: int = 0
    #: chunks not served straight from SSD: over the read buffers' bound (``promotion.py``)
    refused_direct_chunks: int = 0
    evicted_chunks: int = 0
    corrupt_chunks: int = 0
    recovered_chunks: int = 0
    io_errors: int = 0
    not_admitted_chunks: int = 0
    skipped_chunks: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    #: free slots whose disk blocks went back to the filesystem (``SsdIndex.to_release``)
    released_slots: int = 0


def disk_room(directory: str) -> int | None:
    """Bytes an SSD tier in ``directory`` could take: its filesystem's free room plus what the
    files there already take (the tier's own); None when that cannot be told."""
    try:
        st = os.statvfs(directory)
        with os.scandir(directory) as entries:
            files = [e.stat() for e in entries if e.is_file(follow_symlinks=False)]
    except OSError:
        return None
    return st.f_bavail * st.f_frsize + sum(f.st_blocks * 512 for f in files)
