"""An in-process fleet member over a real EventLog and a real redis-server (tests only).

``Member`` stands in for a daemon's tiers: ``store`` / ``evict`` change what it holds and emit
the storage events the engine would, so the ``ClusterNode`` under test sees exactly what it
sees in a daemon.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvserver.cluster import ClusterConfig, ClusterNode, HostInfo
from kvserver.eventlog import EventLog
from kvserver.events import (
    MEDIUM_DRAM,
    MEDIUM_SSD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

NS = "ns0000000000000a"
MEDIUM = {"dram": MEDIUM_DRAM, "ssd": MEDIUM_SSD}


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [seed.to_bytes(4, "big") + i.to_bytes(4, "big") + os.urandom(24) for i in range(n)]


def cluster_config(url: str, **kw: float) -> ClusterConfig:
    """Short TTLs; a resync not delayed, retries at most 1 s apart (the timing before the
    spread and the backoff: ``test_resync_spread.py`` sets its own) so that the tests of other
    behaviours wait for no random delay. Redis calls bounded at 5 s: they are expected to
    succeed (a killed server refuses at once), and at 0.5 s a loaded machine timed out a TLS
    cluster's handshakes (load 10-15: every call of a valkeys+cluster:// member failed, and
    its client, cut off mid-connect, leaked into the next test as a ResourceWarning); the
    tests of slow or paused Redis set their own."""
    defaults: dict[str, float] = {
        "ttl_s": 1.5,
        "timeout_s": 5.0,
        "members_max_age_s": 0.0,
        "resync_spread_s": 0.0,
        "retry_max_s": 1.0,
    }
    defaults.update(kw)
    return ClusterConfig(url, **defaults)  # type: ignore[arg-type]


@dataclass
class Member:
    host_id: str
    config: ClusterConfig
    log: EventLog = field(default_factory=EventLog)
    held: dict[tuple[str, str], list[bytes]] = field(default_factory=dict)
    seq: int = 0
    node: ClusterNode | None = None
    #: the node's random draws (a resync's delay, a retry's pause); None: its own
    rng: random.Random | None = None
    #: the data address it advertises ("": one of its own, from its host id)
    data_address: str = ""

    def _emit(self, ev: Event) -> None:
        self.log.extend([ev])

    def store(self, ks: list[bytes], tier: str = "dram", ns: str = NS) -> None:
        have = self.held.setdefault((ns, tier), [])
        have.extend(k for k in ks if k not in have)
        self.seq += 1
        self._emit(BlockStored(self.seq, ns, tuple(ks), MEDIUM[tier]))

    def evict(self, ks: list[bytes], tier: str = "dram", ns: str = NS) -> None:
        have = self.held.setdefault((ns, tier), [])
        self.held[(ns, tier)] = [k for k in have if k not in ks]
        self.seq += 1
        self._emit(BlockRemoved(self.seq, ns, tuple(ks), MEDIUM[tier]))

    def clear(self, tier: str = "dram", ns: str = NS) -> None:
        self.held[(ns, tier)] = []
        self.seq += 1
        self._emit(AllBlocksCleared(self.seq, ns, MEDIUM[tier]))

    async def start(self, *, joined: bool = True) -> ClusterNode:
        """Start the member's node; ``joined``: until it is registered (:func:`registered`),
        else until its first attempt has ended (``connecting`` no more: ``unavailable`` with
        Redis down). ``ClusterNode.start`` waits for that first attempt at most 3 cluster
        timeouts (a daemon's start is not held up longer by a slow Redis): on a loaded host
        it returned before the member was registered, and tests that took it for registered
        failed."""
        port = 10_000 + zlib.crc32(self.host_id.encode()) % 50_000  # one per member: never
        identity = HostInfo(  # connected to, but one address per member, as in a real fleet
            self.host_id,
            "",
            self.data_address or f"tcp://127.0.0.1:{port}",
            "127.0.0.1:2",
            ("dram",),
        )
        self.node = ClusterNode(
            self.config,
            identity,
            self.log,
            lambda: dict(self.held),
            lambda: {NS: "{}"},
            rng=self.rng,
        )
        node = self.node
        await node.start()
        if joined:
            await registered(node)
        else:

            async def attempted() -> bool:
                return node.condition != "connecting"

            await eventually(attempted, timeout=30.0)
        return node

    async def crash(self) -> None:
        """Stop writing without leaving (as SIGKILL would)."""
        assert self.node is not None
        node = self.node
        node._registered = False  # its stop() then does not leave
        await node.stop()

    async def settled(self) -> None:
        """Until every event so far is written (bounded generously: a loaded machine)."""
        assert self.node is not None
        assert await self.node.wait_written(timeout_s=30.0), self.node.stats()


async def eventually(check: Callable[[], Awaitable[object]], timeout: float = 10.0) -> object:
    """Poll ``check`` until truthy; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout}s")
        await asyncio.sleep(0.02)


async def registered(node: ClusterNode, timeout: float = 30.0) -> None:
    """Until ``node`` is a member, its index resynced (``readable``: ``ok``, or ``degraded``
    with Redis full); AssertionError with its stats after ``timeout``."""

    async def member() -> bool:
        return node.readable

    try:
        await eventually(member, timeout)
    except AssertionError as exc:
        raise AssertionError(f"not registered within {timeout}s: {node.stats()}") from exc
