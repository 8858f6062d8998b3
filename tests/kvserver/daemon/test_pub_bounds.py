"""The KV-event PUB's memory stays bounded whatever its subscribers do, on a real daemon
process (its RSS from /proc and its ``pub_subscribers`` counters): many real SUB sockets that
never read, a bound on their number, and a well-behaved subscriber that still gets every event
(what the PUB dropped for it, through the replay protocol)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
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


def subscribe(sub: zmq.Socket[bytes], address: str, *, stalled: bool = False) -> None:
    """Make ``sub`` a SUB to every topic at ``address``; ``stalled``: one that reads nothing
    (its own buffers the least)."""
    sub.linger = 0
    if stalled:
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)


def drain(sub: zmq.Socket[bytes], into: dict[int, bytes]) -> None:
    """Move every message waiting on ``sub`` into ``into`` (seq -> payload)."""
    while sub.poll(0):
        _topic, seq_b, payload = sub.recv_multipart()
        into[int.from_bytes(seq_b, "big")] = payload


class Publisher:
    """A daemon whose PUB takes MAX_SUBSCRIBERS subscribers, a client of it that stores chunks
    of 512-byte parts in namespace ``ns`` (each store an event, or two when it evicts), and the
    SUB sockets a test opens (``socket``), all closed by ``close``."""

    def __init__(self, tmp_path: Path) -> None:
        self.daemon = start_daemon(
            tmp_path, "--page-size", "4KiB", "--dram", "64KiB",
            env={"KVSERVER_PUB_MAX_SUBSCRIBERS": str(MAX_SUBSCRIBERS)},
        )  # fmt: skip
        self.ctx: zmq.Context[bytes] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []
        self.kv = KVClient(self.daemon.zmq_address)
        spec = make_spec(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte parts
        self.ns = self.kv.register_namespace(spec).ns_id
        self.part = bytes(spec.part_bytes)
        self._probes = (make_keys(1, start=i, tag="probe")[0] for i in itertools.count())

    def socket(self) -> zmq.Socket[bytes]:
        """A SUB socket of the test's, closed with the publisher (not connected yet)."""
        sock = self.ctx.socket(zmq.SUB)
        self.sockets.append(sock)
        return sock

    def subscriber(self, *, stalled: bool = False) -> zmq.Socket[bytes]:
        """A SUB to every topic of the daemon's PUB (``subscribe``)."""
        sub = self.socket()
        subscribe(sub, self.daemon.pub_address, stalled=stalled)
        return sub

    def put_probe(self) -> int:
        """Store a new key (an event); returns the newest event's sequence number."""
        self.kv.put(self.ns, [next(self._probes)], [self.part])
        return int(self.kv.stats()["events_last_seq"])

    def reaches(self, sub: zmq.Socket[bytes]) -> bool:
        """A probe stored now arrives at ``sub`` (the PUB drops what it publishes until a
        subscription has propagated, and cuts a subscriber over its bounds)."""
        self.put_probe()
        return sub.poll(50) != 0

    def caught_up(self, sub: zmq.Socket[bytes], received: dict[int, bytes]) -> bool:
        """A probe stored now, after ``sub``'s queue was drained into ``received``, arrives."""
        newest = self.put_probe()
        drain(sub, received)
        return max(received, default=0) >= newest

    def pub_subscribers(self) -> dict[str, int]:
        return dict(self.kv.stats()["pub_subscribers"])

    def close(self) -> None:
        self.kv.close()
        for sock in self.sockets:
            sock.close()
        self.ctx.term()
        self.daemon.terminate()


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[Publisher]:
    pub = Publisher(tmp_path)
    try:
        yield pub
    finally:
        pub.close()


def test_stalled_subscribers_are_bounded_and_a_slow_reader_misses_nothing(
    publisher: Publisher,
) -> None:
    """40 SUB sockets that never read are connected while 50,000 events are published
    (before: ~210 bytes per event per subscriber in the daemon past the kernel's buffers, RSS
    +265 and +271 MiB in two runs): the daemon keeps at most 8 subscriber connections (the
    others are cut at once, counted), its RSS grows by less than 64 MiB, and a subscriber that
    read nothing during the burst then gets every event: what the PUB still held, and what it
    dropped through replay."""
    d, kv = publisher.daemon, publisher.kv
    good = publisher.subscriber()
    received: dict[int, bytes] = {}
    wait_until(lambda: publisher.reaches(good))
    stalled = [publisher.subscriber(stalled=True) for _ in range(STALLED)]

    def stalled_subscribed() -> bool:  # they read nothing: a message is waiting
        publisher.put_probe()
        return sum(sub.poll(0) != 0 for sub in stalled) >= MAX_SUBSCRIBERS - 1

    wait_until(stalled_subscribed)
    drain(good, received)
    first = kv.stats()["events_last_seq"] + 1
    before = rss(d.proc.pid)
    for i in range(PUTS):
        kv.put(publisher.ns, make_keys(1, start=i, tag="ev"), [publisher.part])
    last = kv.stats()["events_last_seq"]
    assert last - first + 1 > PUTS
    grew = rss(d.proc.pid) - before
    counts = publisher.pub_subscribers()
    # a probe published after the queue emptied arrives
    wait_until(lambda: publisher.caught_up(good, received), timeout=60)
    missed = set(range(first, last + 1)) - set(received)
    if missed:
        received.update(replay_from(d, min(missed), publisher.ctx))
    assert set(range(first, last + 1)) <= set(received)
    assert grew < 64 * MIB, grew
    assert counts["connected"] <= MAX_SUBSCRIBERS
    assert counts["refused"] >= STALLED + 1 - MAX_SUBSCRIBERS


def test_a_subscriber_over_the_limit_is_cut_and_admitted_once_one_leaves(
    publisher: Publisher,
) -> None:
    """8 subscribers fill the limit; a 9th is cut at once (counted in stats and /metrics);
    once one of the 8 closes, the 9th's own reconnection is admitted and receives events."""
    counts = publisher.pub_subscribers
    subs = [publisher.subscriber() for _ in range(MAX_SUBSCRIBERS)]
    wait_until(lambda: counts()["connected"] == MAX_SUBSCRIBERS)
    extra = publisher.subscriber()
    wait_until(lambda: counts()["refused"] >= 1)
    assert counts()["connected"] == MAX_SUBSCRIBERS
    assert extra.poll(0) == 0
    metrics = scrape(publisher.daemon.metrics_url)
    assert metrics.value("kvserver_pub_subscribers") == MAX_SUBSCRIBERS
    assert metrics.value("kvserver_pub_subscribers_refused_total") >= 1
    subs.pop().close()
    wait_until(lambda: publisher.reaches(extra))
    assert counts()["connected"] == MAX_SUBSCRIBERS


def test_a_subscriber_sending_many_topics_is_cut_and_memory_stays_bounded(
    publisher: Publisher,
) -> None:
    """Anyone who reaches the PUB port may subscribe (no token): one SUB subscribing to
    50,000 random 100-byte topics (5 MB) grew ZMQ's subscription trie in the daemon by 241 MB
    (100,000 of them: +488 MB, and the next 200 stores took 5.1 s instead of 0.05). A
    connection past MAX_TOPICS subscriptions is now cut (counted as ``too_many_topics``), its
    subscriptions freed with it; the daemon's RSS grows by less than 64 MiB (3-7 MB in
    most runs) and a well-behaved subscriber still gets the events."""
    good = publisher.subscriber()
    flood = publisher.socket()
    flood.linger = 0
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.setsockopt(zmq.RECONNECT_IVL, 60_000)  # cut: it stays away for the test
    flood.connect(publisher.daemon.pub_address)
    received: dict[int, bytes] = {}
    wait_until(lambda: publisher.reaches(good))
    before = rss(publisher.daemon.proc.pid)
    for _ in range(50_000):
        flood.setsockopt(zmq.SUBSCRIBE, os.urandom(100))
    wait_until(lambda: publisher.pub_subscribers()["too_many_topics"] >= 1)
    for _ in range(200):
        publisher.put_probe()
    grew = rss(publisher.daemon.proc.pid) - before
    wait_until(lambda: publisher.caught_up(good, received), timeout=60)
    assert publisher.pub_subscribers()["connected"] == 1
    assert grew < 64 * MIB, grew
