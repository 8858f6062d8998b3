"""The KV-event PUB's connection bound (``kvserver/daemon/pub_limit.py``) on a real PUB and real
SUB sockets in one process, its monitor read on a running event loop: what a refused subscriber
that reconnects in a tight loop costs the daemon."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq

from kvserver.daemon.pub_limit import (
    MAX_SUBSCRIBERS_PER_ADDRESS,
    PRUNE_INTERVAL_S,
    SubscriberLimit,
    configure,
)
from kvserver.daemon.refusals import SubscriberCounts

MAX_SUBSCRIBERS = 4


def sub(ctx: zmq.Context[Any], address: str, reconnect_ms: int = 100) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.SUB)
    s.linger = 0
    s.setsockopt(zmq.RECONNECT_IVL, reconnect_ms)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(address)
    return s


async def run_until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.01)


def test_a_subscriber_reconnecting_every_millisecond_does_not_rescan_every_connection() -> None:
    """Four subscribers hold the limit; two SUBs with RECONNECT_IVL 1 ms are refused over and
    over. Each refusal checked the descriptors of all four open connections first (4 checks a
    refusal, 1,900 refusals a second took 66% of a core in the daemon); now they are checked
    at most once per PRUNE_INTERVAL_S, and the holders stay connected."""

    async def main() -> tuple[int, int, float, int]:
        ctx: zmq.Context[Any] = zmq.Context()
        pub = ctx.socket(zmq.XPUB)  # as the daemon makes it (zmq_sockets.py)
        pub.linger = 0
        configure(pub, 100)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        counts = SubscriberCounts()
        limit = SubscriberLimit(ctx, counts, MAX_SUBSCRIBERS)
        checks = 0
        check = limit._is_subscriber  # a spy: counts the descriptor checks, changes nothing

        def counted(fd: int) -> bool:
            nonlocal checks
            checks += 1
            return check(fd)

        limit._is_subscriber = counted  # type: ignore[method-assign]
        limit.watch(pub, port)
        address = f"tcp://127.0.0.1:{port}"
        holders = [sub(ctx, address) for _ in range(MAX_SUBSCRIBERS)]
        await run_until(lambda: counts.connected == MAX_SUBSCRIBERS)
        start = time.monotonic()
        churners = [sub(ctx, address, reconnect_ms=1) for _ in range(2)]
        await run_until(lambda: counts.refused >= 200)
        elapsed = time.monotonic() - start
        connected, refused = counts.connected, counts.refused
        for s in holders + churners:
            s.close(0)
        limit.stop()
        pub.close(0)
        ctx.term()
        return checks, refused, elapsed, connected

    checks, refused, elapsed, connected = asyncio.run(main())
    assert connected == MAX_SUBSCRIBERS
    assert checks <= MAX_SUBSCRIBERS * (elapsed / PRUNE_INTERVAL_S + 1), (checks, refused, elapsed)


@pytest.mark.parametrize("per_address", [None, 3])
def test_one_address_may_hold_only_its_share_of_the_subscriber_slots(
    per_address: int | None,
) -> None:
    """The limit counted every connection alike: one address (no token needed) opening
    pub_max_subscribers SUBs kept every other subscriber out. Now at most
    MAX_SUBSCRIBERS_PER_ADDRESS (or the setting pub_max_subscribers_per_address) from one
    address: one more from it is refused, and a SUB from another address (127.0.0.2) is
    admitted."""
    share = MAX_SUBSCRIBERS_PER_ADDRESS if per_address is None else per_address

    async def main() -> tuple[int, int]:
        ctx: zmq.Context[Any] = zmq.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.linger = 0
        configure(pub, 100)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        counts = SubscriberCounts()
        if per_address is None:
            limit = SubscriberLimit(ctx, counts, 64)
        else:
            limit = SubscriberLimit(ctx, counts, 64, per_address)
        limit.watch(pub, port)
        address = f"tcp://127.0.0.1:{port}"
        mine = [sub(ctx, address) for _ in range(share)]
        await run_until(lambda: counts.connected == share)
        extra = sub(ctx, address, reconnect_ms=60_000)
        await run_until(lambda: counts.refused >= 1)
        other = sub(ctx, f"tcp://127.0.0.2:0;127.0.0.1:{port}")
        await run_until(lambda: counts.connected == share + 1)
        connected, refused = counts.connected, counts.refused
        for s in [*mine, extra, other]:
            s.close(0)
        limit.stop()
        pub.close(0)
        ctx.term()
        return connected, refused

    connected, refused = asyncio.run(main())
    assert connected == share + 1 and refused == 1
