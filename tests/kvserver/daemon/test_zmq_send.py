"""kvserver/daemon/zmq_send.py in one process: a real KVService and a real ROUTER/DEALER pair
on loopback.

A zero-copy reply references arena pages until ZMQ has written it; its send pin must hold
them that long, and no longer. The receiving DEALER is throttled (receive high-water mark 1,
one message already queued, small socket buffers), so ZMQ cannot finish the large reply while
the test evicts everything else and overwrites the pages it frees; then the DEALER reads, gets
the original bytes, and the pin ends.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import zmq

from kvserver import wire
from kvserver.daemon.peers.zmq_windows import CAP_REFUSAL
from kvserver.daemon.results import Fetched
from kvserver.daemon.service import KVService
from kvserver.daemon.zmq_send import ZMQ_SEND_CLIENT, Parts, ZeroCopySender
from kvserver.engine.types import EngineConfig
from kvserver.errors import CapacityError
from tests.kvserver.builders import make_keys, make_spec, pattern

PART = 1 << 20
SPEC = make_spec(model="test/zero-copy", part_bytes_override=PART)
DRAM = 8 * PART
WAIT_S = 30.0


@pytest.fixture
async def svc() -> AsyncIterator[KVService]:
    service = KVService(EngineConfig(dram_bytes=DRAM, page_size=PART))  # a part: one page
    service.register_namespace(SPEC)
    yield service
    service.engine.check_invariants()
    service.close()


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.SNDBUF, 4096)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.ROUTING_ID, b"d")
    dealer.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hi")  # the ROUTER learns the DEALER's routing id
    assert router.poll(int(WAIT_S * 1000)) and router.recv_multipart() == [b"d", b"hi"]
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


def fetched(svc: KVService, keys: list[bytes]) -> Fetched:
    """``get`` of ``keys`` (all in DRAM): pinned under a lease of the send client."""
    got = svc.get(SPEC.ns_id, keys, None, client=ZMQ_SEND_CLIENT)
    assert isinstance(got, Fetched)
    return got


def store(svc: KVService, keys: list[bytes], tag: int) -> None:
    parts = [pattern(k, tag, PART) for k in keys]
    assert svc.put(SPEC.ns_id, keys, parts, client="c").stored == keys


async def until(condition: object, what: str) -> None:
    """Let the loop run until ``condition()`` holds (bounded: fails after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_a_reply_zmq_still_holds_keeps_its_pages_pinned_until_sent(
    svc: KVService, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    router, dealer = pair
    sender = ZeroCopySender(svc)
    sent = make_keys(4, tag="sent")
    store(svc, sent, 0)
    got = fetched(svc, sent)
    router.send_multipart([b"d", b"filler", b"x" * PART])  # fills the DEALER's queue (HWM 1)
    reply = Parts({"keys": got.keys, "ranks": got.ranks}, got.parts, sender.adopt(got.lease_id))
    sender.send(router, b"d", 7, "sid", reply)
    # ZMQ cannot write the whole 4 MiB while the DEALER is throttled; the loop turns and the
    # I/O thread's progress meanwhile must not end the pin
    await asyncio.sleep(0.05)
    assert sender.num_pins == 1
    assert svc.stats()["pinned_pages"] == 4

    others = make_keys(8, tag="other")
    for i in range(0, 8, 2):  # DRAM turns over; the pinned chunks must stay untouched
        store(svc, others[i : i + 2], 1)
    assert all(svc.engine.contains(SPEC.ns_id, k) for k in sent)

    assert dealer.recv_multipart()[0] == b"filler"
    frames = dealer.recv_multipart()
    assert wire.unpack_header(frames[0])["id"] == 7
    assert frames[1:] == [pattern(k, 0, PART) for k in sent]
    await until(lambda: sender.num_pins == 0, "the send pin to end")
    assert svc.stats()["pinned_pages"] == 0 and sender.num_cuts == 0  # sent within 60 s
    store(svc, make_keys(8, tag="after"), 2)  # now the sent chunks can be evicted
    assert not any(svc.engine.contains(SPEC.ns_id, k) for k in sent)
    await sender.close()


async def test_small_parts_are_copied_and_the_pin_ends_at_once(
    svc: KVService, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    router, dealer = pair
    sender = ZeroCopySender(svc)
    keys = make_keys(2, tag="small")
    store(svc, keys, 0)
    got = fetched(svc, keys)
    small = [[view[:100] for view in row] for row in got.parts]  # under COPY_THRESHOLD
    sender.send(router, b"d", 8, "sid", Parts({"keys": keys}, small, sender.adopt(got.lease_id)))
    await until(lambda: sender.num_pins == 0, "the pin of a copied reply to end")
    assert dealer.recv_multipart()[1:] == [pattern(k, 0, PART)[:100] for k in keys]
    await sender.close()


async def test_close_releases_pins_of_replies_still_queued(
    svc: KVService, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    router, _dealer = pair
    sender = ZeroCopySender(svc)
    keys = make_keys(4, tag="queued")
    store(svc, keys, 0)
    router.send_multipart([b"d", b"filler", b"x" * PART])
    got = fetched(svc, keys)
    sender.send(router, b"d", 9, "sid", Parts({}, got.parts, sender.adopt(got.lease_id)))
    assert sender.num_pins == 1  # ZMQ cannot have written it: the DEALER is throttled
    await sender.close()  # the daemon stops: pins end, the late frame release is a no-op
    assert sender.num_pins == 0 and svc.stats()["pinned_pages"] == 0


def source_fd(router: zmq.Socket[bytes], dealer: zmq.Socket[bytes]) -> int:
    """The ROUTER's descriptor of the DEALER's connection (``SRCFD`` of a request)."""
    dealer.send(b"again")
    assert router.poll(int(WAIT_S * 1000))
    frames = router.recv_multipart(copy=False)
    return int(frames[1].get(zmq.SRCFD))


async def test_a_reply_the_client_does_not_read_cuts_its_connection_and_its_pin_ends(
    svc: KVService, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    """The DEALER never reads: past the send timeout its connection is shut down, ZMQ drops
    the frames, the pin ends and the pages can be evicted."""
    router, dealer = pair
    sender = ZeroCopySender(svc, timeout_s=0.2)
    fd = source_fd(router, dealer)
    keys = make_keys(4, tag="stuck")
    store(svc, keys, 0)
    got = fetched(svc, keys)
    router.send_multipart([b"d", b"filler", b"x" * PART])  # fills the DEALER's queue (HWM 1)
    reply = Parts({"keys": got.keys}, got.parts, sender.adopt(got.lease_id))
    sender.send(router, b"d", 11, "sid", reply, fd)
    del reply, got
    await until(lambda: sender.num_pins == 0, "the stuck reply's pin to end")
    assert sender.stats() == {"pins": 0, "unsent_bytes": 0, "cut_connections": 1, "refused": 0}
    assert svc.stats()["pinned_pages"] == 0
    store(svc, make_keys(8, tag="after-cut"), 1)  # the pages are free to be evicted
    await sender.close()


async def test_a_reply_of_a_lower_tiers_buffers_is_held_to_the_same_timeout(
    svc: KVService, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    """No pin (the buffers are the reply's own), but ZMQ holds them as long: the connection
    is cut at the timeout and the buffers are freed."""
    router, dealer = pair
    sender = ZeroCopySender(svc, timeout_s=0.2)
    fd = source_fd(router, dealer)
    buffers = [np.full(PART, i, np.uint8) for i in range(4)]
    alive = [weakref.ref(b) for b in buffers]
    router.send_multipart([b"d", b"filler", b"x" * PART])
    sender.send(router, b"d", 12, "sid", Parts({}, [[memoryview(b)] for b in buffers], 0), fd)
    del buffers
    await until(lambda: sender.num_cuts == 1, "the connection to be cut")
    await until(lambda: all(ref() is None for ref in alive), "ZMQ to drop the frames")
    # the release reaches the loop from ZMQ's gc thread after the frames are dropped
    await until(lambda: sender.unsent_bytes == 0, "the release of the dropped frames")
    assert sender.stats() == {"pins": 0, "unsent_bytes": 0, "cut_connections": 1, "refused": 0}
    await sender.close()


async def test_a_connection_at_its_unsent_cap_is_refused_until_its_replies_are_sent(
    svc: KVService, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    """Admitted while under the cap or with one reply unsent (a reply may take it past the
    cap: it goes); refused at or past it with two, other connections not; admitted again once
    ZMQ has sent what it held."""
    router, dealer = pair
    sender = ZeroCopySender(svc, max_unsent=2 * PART)
    keys = make_keys(4, tag="capped")
    store(svc, keys, 0)
    router.send_multipart([b"d", b"filler", b"x" * PART])  # fills the DEALER's queue (HWM 1)
    for req_id, chunks in ((15, keys[:3]), (16, keys[3:])):
        sender.admit(b"d")
        got = fetched(svc, chunks)
        sender.send(router, b"d", req_id, "sid", Parts({}, got.parts, sender.adopt(got.lease_id)))
        del got
    assert sender.unsent_bytes_of(b"d") == 4 * PART  # past the cap, in two replies
    with pytest.raises(CapacityError, match="retry later") as refused:
        sender.admit(b"d")
    assert CAP_REFUSAL in str(refused.value)  # how a fetching daemon tells it from others
    sender.admit(b"another connection")
    assert sender.stats() == {
        "pins": 2, "unsent_bytes": 4 * PART, "cut_connections": 0, "refused": 1
    }  # fmt: skip
    assert dealer.recv_multipart()[0] == b"filler"
    assert dealer.recv_multipart()[1:] == [pattern(k, 0, PART) for k in keys[:3]]
    assert dealer.recv_multipart()[1:] == [pattern(k, 0, PART) for k in keys[3:]]
    await until(lambda: sender.num_pins == 0, "the pins to end")
    assert sender.unsent_bytes == 0
    sender.admit(b"d")
    await sender.close()
