"""The longest event-loop stall while a fleet member with N chunks registers (its resync).

A ``ClusterNode`` in this process (no daemon: the snapshot is a list of N random 32-byte keys)
registers with a real Redis; a ticker task on the same loop wakes every 1 ms and records the
gaps between its wake-ups. Prints the registration time and the two longest gaps (ms). The
daemon's other work (lookups, stores) would wait as long as the longest gap.

    redis-server --port 6392 --save '' --appendonly no --daemonize yes
    python benchmarks/resync_stall.py --url redis://127.0.0.1:6392/0 --chunks 1000000

The database is flushed before the run (use a Redis of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from kvserver.cluster import ClusterConfig, ClusterNode, HostInfo
from kvserver.cluster.config import connect
from kvserver.eventlog import EventLog


async def measure(url: str, chunks: int) -> tuple[float, list[float]]:
    """(registration seconds, loop gaps in seconds, longest first)."""
    config = ClusterConfig(url, timeout_s=5, ttl_s=30)
    flush = connect(config)
    await flush.flushdb()
    await flush.aclose()
    keys = [os.urandom(32) for _ in range(chunks)]
    identity = HostInfo("h", "", "tcp://127.0.0.1:1", "127.0.0.1:2")
    node = ClusterNode(config, identity, EventLog(), lambda: {("ns", "dram"): keys},
                       lambda: {"ns": "{}"})  # fmt: skip
    gaps: list[float] = []
    ticking = True

    async def ticker() -> None:
        last = time.perf_counter()
        while ticking:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    await node.start()
    while node.condition != "ok":
        await asyncio.sleep(0.01)
    took = time.perf_counter() - start
    ticking = False
    await tick
    await node.stop()
    return took, sorted(gaps, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6392/0")
    parser.add_argument("--chunks", type=int, default=1_000_000)
    args = parser.parse_args()
    took, gaps = asyncio.run(measure(args.url, args.chunks))
    print(
        f"chunks={args.chunks} registered in {took * 1e3:.0f} ms, "
        f"loop gaps max {gaps[0] * 1e3:.0f} ms, 2nd {gaps[1] * 1e3:.0f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
