"""A client that stops reading its ZMQ socket cannot keep DRAM pinned for everyone else.

A real daemon process on loopback. The stalled client gets every chunk in DRAM with a socket
it never reads (receive high-water mark 1, a 4 KiB kernel buffer), so its zero-copy reply sits
in ZMQ's queue and its send pin holds every page. The daemon cuts that connection once the
reply is ``zmq_send_timeout_s`` old: ZMQ drops the frames, the pin ends, and another client's
store goes through (before: the pin held for ``max_lease_s``, 600 s, and the pages it left
were overwritten under the frames still queued). That bounds the time; ``zmq_send_max_unsent``
bounds the bytes: a client that pipelines many ``get``s without reading has all but the first
answered ``capacity`` once its unsent replies reach the cap, so it pins about the cap, not a
reply per request, for the time it takes to cut it. The peer stream's server end, serving
another daemon, was bounded already: a reply not sent within the peer timeout closes the
connection.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvserver import wire, wire_stream
from kvserver.client import KVClient
from kvserver.crypto import apply_token
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument
from kvserver.token_file import TokenFile
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.metrics import scrape

pytestmark = pytest.mark.multiprocess

PART = 1 << 20
SPEC = make_spec(model="test/stalled", part_bytes_override=PART)
NUM_CHUNKS = 16  # the whole DRAM tier


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(
        tmp_path,
        "--dram",
        f"{NUM_CHUNKS}MiB",
        "--page-size",
        "1MiB",
        env={"KVSERVER_ZMQ_SEND_TIMEOUT_S": "1", "KVSERVER_ZMQ_SEND_MAX_UNSENT": "1GiB"},
    )
    yield d
    assert d.terminate() == 0, d.log()


def stalled_get(address: str, ns_id: str, keys: list[bytes]) -> zmq.Socket[bytes]:
    """A DEALER that asks for ``keys`` three times and then never reads (kept open by the
    caller)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    token = TokenFile(address).token() or ""
    apply_token(sock, token)
    sock.connect(address)
    for req_id in (1, 2, 3):  # the first reply fills its queue, the next ones wait in ours
        sock.send(wire.encode_request(req_id, wire.GET, {"ns_id": ns_id, "keys": keys}, auth=token))
    return sock


def test_a_client_that_stops_reading_loses_its_connection_not_everyones_dram(
    daemon: DaemonProc,
) -> None:
    """The stalled reply's pin ends within the send timeout; the other store succeeds."""
    mine, theirs = make_keys(NUM_CHUNKS, tag="mine"), make_keys(NUM_CHUNKS, tag="theirs")
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.put(ns.ns_id, mine, [pattern(k, 0, PART) for k in mine]).stored == mine
        sock = stalled_get(daemon.zmq_address, ns.ns_id, mine)
        try:
            wait_until(lambda: kv.stats()["pinned_pages"] > 0, timeout=10)

            def stored() -> bool:
                r = kv.put(ns.ns_id, theirs, [pattern(k, 1, PART) for k in theirs])
                return set(r.stored) | set(r.present) == set(theirs)

            wait_until(stored, timeout=15)
            assert kv.stats()["pinned_pages"] == 0
            assert kv.stats()["zmq_sends"] == {
                "pins": 0,
                "unsent_bytes": 0,
                "cut_connections": 1,
                "refused": 0,
            }
            metrics = scrape(daemon.metrics_url)
            assert metrics.value("kvserver_zmq_send_cuts_total") == 1
            assert metrics.value("kvserver_zmq_send_pins") == 0
            got = kv.get(ns.ns_id, theirs)
            assert [bytes(row[0]) for row in got] == [pattern(k, 1, PART) for k in theirs]
        finally:
            sock.close(linger=0)


def pipelined_gets(address: str, ns_id: str, groups: list[list[bytes]]) -> zmq.Socket[bytes]:
    """A DEALER that asks for each group of ``groups`` in turn without reading (kept open by
    the caller)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    token = TokenFile(address).token() or ""
    apply_token(sock, token)
    sock.connect(address)
    for req_id, keys in enumerate(groups, 1):
        sock.send(wire.encode_request(req_id, wire.GET, {"ns_id": ns_id, "keys": keys}, auth=token))
    return sock


@pytest.fixture
def capped_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    """64 pages of 1 MiB; a connection may leave 2 MiB of replies unsent; the send timeout
    at its default (60 s: no cut within the test)."""
    d = start_daemon(
        tmp_path, "--dram", "64MiB", "--page-size", "1MiB", "--zmq-send-max-unsent", "2MiB"
    )
    yield d
    assert d.terminate() == 0, d.log()


def test_a_client_pipelining_gets_it_does_not_read_pins_about_the_cap_not_a_reply_each(
    capped_daemon: DaemonProc,
) -> None:
    """24 gets of 2 MiB each, never read: the daemon stops pinning at the cap (the rest
    answered ``capacity``), and another client's store of 40 chunks goes through at once
    (before: every reply ZMQ could not hand to the kernel pinned its pages for 60 s, some
    46 of the 64 in a run, and that store failed)."""
    d = capped_daemon
    mine, theirs = make_keys(48, tag="mine"), make_keys(40, tag="theirs")
    with KVClient(d.zmq_address, colocated=False) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.put(ns.ns_id, mine, [pattern(k, 0, PART) for k in mine]).stored == mine
        groups = [mine[i : i + 2] for i in range(0, len(mine), 2)]
        sock = pipelined_gets(d.zmq_address, ns.ns_id, groups)
        try:

            def answered() -> dict[str, int] | None:
                sends: dict[str, int] = kv.stats()["zmq_sends"]
                count = ("kvserver_op_duration_seconds_count", (("op", "get"),))
                sent = scrape(d.metrics_url).samples.get(count, 0)
                return sends if sent + sends["refused"] >= len(groups) else None

            sends = wait_until(answered, timeout=15)
            r = kv.put(ns.ns_id, theirs, [pattern(k, 1, PART) for k in theirs])
            assert set(r.stored) == set(theirs), (len(r.stored), sends)
            # a reply is admitted while the connection is under the cap: those the client's
            # queue and the kernel's buffers took, plus the one left unsent
            assert sends["refused"] >= len(groups) // 2, sends
            assert sends["unsent_bytes"] <= 2 * 2 * PART, sends
            metrics = scrape(d.metrics_url)
            assert metrics.value("kvserver_zmq_send_refused_total") == sends["refused"]
            assert metrics.value("kvserver_zmq_send_unsent_bytes") <= sends["unsent_bytes"]
        finally:
            sock.close(linger=0)


def test_a_client_that_waits_for_each_reply_is_never_refused_even_past_the_cap(
    capped_daemon: DaemonProc,
) -> None:
    """Gets of 4 MiB each (twice the cap), one at a time: each is admitted, though the pin of
    the reply before, read already, may not be released yet when the next get arrives (its
    release reaches the loop from pyzmq's gc thread): one reply unsent never refuses."""
    d = capped_daemon
    keys = make_keys(4, tag="sequential")
    with KVClient(d.zmq_address, colocated=False) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.put(ns.ns_id, keys, [pattern(k, 0, PART) for k in keys]).stored == keys
        for _ in range(40):
            got = kv.get(ns.ns_id, keys)
            assert [bytes(row[0]) for row in got] == [pattern(k, 0, PART) for k in keys]
        assert kv.stats()["zmq_sends"]["refused"] == 0


def test_the_unsent_cap_defaults_to_a_quarter_of_dram_and_takes_a_size() -> None:
    assert DaemonConfig(dram=8 << 30).send_max_unsent == 2 << 30
    config = DaemonConfig.load(env={"KVSERVER_ZMQ_SEND_MAX_UNSENT": "64MiB"})
    assert config.send_max_unsent == 64 << 20
    with pytest.raises(InvalidArgument, match="zmq_send_max_unsent"):
        DaemonConfig(zmq_send_max_unsent=-1)


@pytest.mark.parametrize(
    ("timeout_s", "max_lease_s"), [(-1.0, 600.0), (301.0, 600.0), (60.0, 100.0), (20.5, 40.0)]
)
def test_a_send_timeout_outside_0_to_half_the_longest_lease_is_refused(
    timeout_s: float, max_lease_s: float
) -> None:
    with pytest.raises(InvalidArgument, match="zmq_send_timeout_s"):
        DaemonConfig(zmq_send_timeout_s=timeout_s, max_lease_s=max_lease_s)
    assert DaemonConfig(zmq_send_timeout_s=300.0).send_timeout_s == 300.0
    half = max_lease_s / 2
    assert DaemonConfig(zmq_send_timeout_s=half, max_lease_s=max_lease_s).send_timeout_s == half


@pytest.mark.parametrize(("max_lease_s", "half"), [(600.0, "300"), (100.0, "50"), (41.0, "20.5")])
def test_the_send_timeouts_error_gives_its_range_with_0_in_it(
    max_lease_s: float, half: str
) -> None:
    """0 is taken (the default), so the range the message gives is [0, half the longest
    lease] and says what 0 means (before: "(0, 300]", though 0 was accepted)."""
    assert DaemonConfig(zmq_send_timeout_s=0.0, max_lease_s=max_lease_s).send_timeout_s > 0
    with pytest.raises(InvalidArgument) as refused:
        DaemonConfig(zmq_send_timeout_s=-1.0, max_lease_s=max_lease_s)
    assert str(refused.value) == (
        f"zmq_send_timeout_s must be in [0, {half}], at most half the longest lease (0: the "
        "default, 60 s or that half when less) (value=-1.0)"
    )


@pytest.mark.parametrize(("max_lease_s", "timeout_s"), [(600.0, 60.0), (120.0, 60.0), (40.0, 20.0)])
def test_the_send_timeout_defaults_to_60_s_or_half_the_longest_lease(
    max_lease_s: float, timeout_s: float
) -> None:
    """Before: 60 s whatever the longest lease, its bound half of the engine's constant 600 s
    (the send pins' lease is the running ``max_lease_s``)."""
    config = DaemonConfig.load(env={"KVSERVER_MAX_LEASE_S": str(max_lease_s)})
    assert config.zmq_send_timeout_s == 0 and config.send_timeout_s == timeout_s


@pytest.fixture
def stream_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(
        tmp_path, "--dram", f"{NUM_CHUNKS}MiB", "--page-size", "1MiB", "--peer-timeout-s", "1"
    )
    yield d
    assert d.terminate() == 0, d.log()


def test_a_peer_that_stops_reading_its_stream_reply_loses_the_connection(
    stream_daemon: DaemonProc,
) -> None:
    """The peer stream was bounded already: a fetch of every chunk whose reply the fetcher
    never reads is closed at the peer timeout, its pins end, another client's store goes
    through (each reply is sent within the timeout, one at a time per connection)."""
    d = stream_daemon
    mine, theirs = make_keys(NUM_CHUNKS, tag="mine"), make_keys(NUM_CHUNKS, tag="theirs")
    with KVClient(d.zmq_address, colocated=False) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.put(ns.ns_id, mine, [pattern(k, 0, PART) for k in mine]).stored == mine
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        try:
            sock.connect(("127.0.0.1", d.info["peer_stream_port"]))
            sock.sendall(wire_stream.encode_hello(d.token or ""))
            sock.sendall(wire_stream.encode_request(wire_stream.FetchRequest(7, ns.ns_id, mine)))
            wait_until(lambda: kv.stats()["pinned_pages"] > 0, timeout=10)

            def stored() -> bool:
                r = kv.put(ns.ns_id, theirs, [pattern(k, 1, PART) for k in theirs])
                return set(r.stored) | set(r.present) == set(theirs)

            wait_until(stored, timeout=15)
            assert kv.stats()["pinned_pages"] == 0
        finally:
            sock.close()
