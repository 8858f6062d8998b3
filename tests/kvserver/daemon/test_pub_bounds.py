"""The KV-event PUB's memory stays bounded whatever its subscribers do, on a real daemon
process (its RSS from /proc and its ``pub_subscribers`` counters): many real SUB sockets that
never read, a bound on their number, and a well-behaved subscriber that still gets every event
(what the PUB dropped for it, through the replay protocol)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from kvserver import wire
from kvserver.client import KVClient
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_memory_bounds import MIB, rss
from tests.support.daemon import DaemonProc, raw_dealer, start_daemon, wait_until
from tests.support.metrics import scrape

pytestmark = pytest.mark.multiprocess

STALLED = 40
MAX_SUBSCRIBERS = 8
PUTS = 25_000  # each stores a key and evicts one: two events (messages of ~230 bytes)


def replay_from(d: DaemonProc, start: int, ctx: zmq.Context[bytes]) -> dict[int, bytes]:
    """Every batch the daemon's replay serves from ``start`` on (asking again until empty)."""
    got: dict[int, bytes] = {}
    dealer = raw_dealer(d.zmq_address, ctx=ctx)
    try:
        # replay is served on a connection that authenticated (docs/wire.md, Replay)
        dealer.send_multipart([wire.encode_request(1, wire.HELLO, {}, auth=d.token)])
        assert dealer.poll(10_000) and wire.decode_reply(dealer.recv_multipart()[0]).ok
        while True:
            dealer.send_multipart([b"", wire.seq_bytes(start)])
            more = False
            while True:
                assert dealer.poll(10_000)
                _, seq_b, payload = dealer.recv_multipart()
                if seq_b == wire.REPLAY_END_SEQ:
                    break
                seq = int.from_bytes(seq_b, "big")
                more = more or seq not in got
                got[seq] = payload
                start = seq + 1
            if not more:
                return got
    finally:
        dealer.close()


def subscriber(
    ctx: zmq.Context[bytes], address: str, *, stalled: bool = False
) -> zmq.Socket[bytes]:
    """A SUB to every topic; ``stalled``: one that reads nothing (its own buffers the least)."""
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    if stalled:
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def drain(sub: zmq.Socket[bytes], into: dict[int, bytes]) -> None:
    """Move every message waiting on ``sub`` into ``into`` (seq -> payload)."""
    while sub.poll(0):
        _topic, seq_b, payload = sub.recv_multipart()
        into[int.from_bytes(seq_b, "big")] = payload


def start(tmp_path: Path) -> DaemonProc:
    return start_daemon(
        tmp_path,
        "--page-size",
        "4KiB",
        "--dram",
        "64KiB",
        env={"KVSERVER_PUB_MAX_SUBSCRIBERS": str(MAX_SUBSCRIBERS)},
    )


def test_stalled_subscribers_are_bounded_and_a_slow_reader_misses_nothing(
    tmp_path: Path,
) -> None:
    """40 SUB sockets that never read are connected while 50,000 events are published
    (before: ~210 bytes per event per subscriber in the daemon past the kernel's buffers, RSS
    +265 and +271 MiB in two runs): the daemon keeps at most 8 subscriber connections (the
    others are cut at once, counted), its RSS grows by less than 64 MiB, and a subscriber that
    read nothing during the burst then gets every event: what the PUB still held, and what it
    dropped through replay."""
    d = start(tmp_path)
    ctx: zmq.Context[bytes] = zmq.Context()
    good = subscriber(ctx, d.pub_address)
    stalled: list[zmq.Socket[bytes]] = []
    received: dict[int, bytes] = {}
    try:
        with KVClient(d.zmq_address) as kv:
            spec = make_spec(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte parts
            ns = kv.register_namespace(spec)
            part = bytes(spec.part_bytes)
            probes = iter(make_keys(1000, tag="probe"))

            def put_probe() -> int:
                kv.put(ns.ns_id, [next(probes)], [part])
                return int(kv.stats()["events_last_seq"])

            def subscribed() -> bool:  # PUB drops until the subscription has propagated
                put_probe()
                return good.poll(50) != 0

            wait_until(subscribed)
            stalled = [subscriber(ctx, d.pub_address, stalled=True) for _ in range(STALLED)]

            def stalled_subscribed() -> bool:  # they read nothing: a message is waiting
                put_probe()
                return sum(sub.poll(0) != 0 for sub in stalled) >= MAX_SUBSCRIBERS - 1

            wait_until(stalled_subscribed)
            drain(good, received)
            first = kv.stats()["events_last_seq"] + 1
            before = rss(d.proc.pid)
            for i in range(PUTS):
                kv.put(ns.ns_id, make_keys(1, start=i, tag="ev"), [part])
            last = kv.stats()["events_last_seq"]
            assert last - first + 1 > PUTS
            grew = rss(d.proc.pid) - before
            counts = kv.stats().get("pub_subscribers")

            def caught_up() -> bool:  # a probe published after the queue emptied arrives
                newest = put_probe()
                drain(good, received)
                return max(received) >= newest

            wait_until(caught_up, timeout=60)
        missed = set(range(first, last + 1)) - set(received)
        if missed:
            received.update(replay_from(d, min(missed), ctx))
        assert set(range(first, last + 1)) <= set(received)
        assert grew < 64 * MIB, grew
        assert counts is not None
        assert counts["connected"] <= MAX_SUBSCRIBERS
        assert counts["refused"] >= STALLED + 1 - MAX_SUBSCRIBERS
    finally:
        for sock in [good, *stalled]:
            sock.close()
        ctx.term()
        d.terminate()


def test_a_subscriber_over_the_limit_is_cut_and_admitted_once_one_leaves(tmp_path: Path) -> None:
    """8 subscribers fill the limit; a 9th is cut at once (counted in stats and /metrics);
    once one of the 8 closes, the 9th's own reconnection is admitted and receives events."""
    d = start(tmp_path)
    ctx: zmq.Context[bytes] = zmq.Context()
    subs = [subscriber(ctx, d.pub_address) for _ in range(MAX_SUBSCRIBERS)]
    extra: zmq.Socket[bytes] | None = None
    try:
        with KVClient(d.zmq_address) as kv:
            spec = make_spec()
            ns = kv.register_namespace(spec)
            probes = iter(make_keys(1000, tag="probe"))

            def counts() -> dict[str, int]:
                return dict(kv.stats()["pub_subscribers"])

            def admitted(sub: zmq.Socket[bytes]) -> bool:
                kv.put(ns.ns_id, [next(probes)], [bytes(spec.part_bytes)])
                return sub.poll(50) != 0

            wait_until(lambda: counts()["connected"] == MAX_SUBSCRIBERS)
            extra = subscriber(ctx, d.pub_address)
            wait_until(lambda: counts()["refused"] >= 1)
            assert counts()["connected"] == MAX_SUBSCRIBERS
            assert extra.poll(0) == 0
            metrics = scrape(d.metrics_url)
            assert metrics.value("kvserver_pub_subscribers") == MAX_SUBSCRIBERS
            assert metrics.value("kvserver_pub_subscribers_refused_total") >= 1
            subs.pop().close()
            wait_until(lambda: admitted(extra))
            assert counts()["connected"] == MAX_SUBSCRIBERS
    finally:
        for sock in [*subs, *([extra] if extra is not None else [])]:
            sock.close()
        ctx.term()
        d.terminate()


def test_a_subscriber_sending_many_topics_is_cut_and_memory_stays_bounded(
    tmp_path: Path,
) -> None:
    """Anyone who reaches the PUB port may subscribe (no token): one SUB subscribing to
    50,000 random 100-byte topics (5 MB) grew ZMQ's subscription trie in the daemon by 241 MB
    (100,000 of them: +488 MB, and the next 200 stores took 5.1 s instead of 0.05). A
    connection past MAX_TOPICS subscriptions is now cut (counted as ``too_many_topics``), its
    subscriptions freed with it; the daemon's RSS grows by less than 64 MiB (3-7 MB in
    most runs) and a well-behaved subscriber still gets the events."""
    d = start(tmp_path)
    ctx: zmq.Context[bytes] = zmq.Context()
    good = subscriber(ctx, d.pub_address)
    flood = ctx.socket(zmq.SUB)
    flood.linger = 0
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.setsockopt(zmq.RECONNECT_IVL, 60_000)  # cut: it stays away for the test
    flood.connect(d.pub_address)
    received: dict[int, bytes] = {}
    try:
        with KVClient(d.zmq_address) as kv:
            spec = make_spec(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte parts
            ns = kv.register_namespace(spec)
            part = bytes(spec.part_bytes)
            probes = iter(make_keys(5000, tag="topics"))

            def put_probe() -> int:
                kv.put(ns.ns_id, [next(probes)], [part])
                return int(kv.stats()["events_last_seq"])

            def subscribed() -> bool:
                put_probe()
                return good.poll(50) != 0

            wait_until(subscribed)
            before = rss(d.proc.pid)
            for _ in range(50_000):
                flood.setsockopt(zmq.SUBSCRIBE, os.urandom(100))
            wait_until(lambda: kv.stats()["pub_subscribers"]["too_many_topics"] >= 1)
            for _ in range(200):
                put_probe()
            grew = rss(d.proc.pid) - before

            def caught_up() -> bool:
                newest = put_probe()
                drain(good, received)
                return max(received, default=0) >= newest

            wait_until(caught_up, timeout=60)
            assert kv.stats()["pub_subscribers"]["connected"] == 1
        assert grew < 64 * MIB, grew
    finally:
        for sock in (good, flood):
            sock.close()
        ctx.term()
        d.terminate()
