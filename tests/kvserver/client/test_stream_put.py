"""A remote client's ``put`` over the daemon's stream port in windows
(``kvserver/client/stream_put.py``; ``docs/wire.md`` §4 and §6, "Client ops"): real daemons on
loopback with 64 MiB of DRAM, so a quota of 16 MiB for the stream's puts in flight and windows
of at most 8 MiB.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvserver import wire, wire_stream
from kvserver.client import AsyncKVClient, KVClient
from kvserver.client.calls import PutResult
from kvserver.client.stream import StreamLink
from kvserver.client.stream_put import QUOTA_SHARE, StreamPut, stream_windows
from kvserver.errors import InvalidArgument
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.client.test_client import as_bytes, parts
from tests.support.daemon import DaemonProc, start_daemon, wait_until

MiB = 1 << 20
#: 64 KiB parts (one 64 KiB page each), two ranks: 128 KiB a key, 64 keys a window
SPEC = make_spec(model="test/streamput", tp_world_size=2, block_size=512)
QUOTA = 16 * MiB
WINDOW_KEYS = QUOTA // QUOTA_SHARE // (2 * SPEC.part_bytes)
DAEMON = ("--dram", "64MiB", "--no-auth", "--peer-timeout-s", "120")


def client_counters(kv: KVClient) -> dict[str, int]:
    stats: dict[str, Any] = kv.stats()["peer_stream"]
    return {k: v for k, v in stats.items() if k.startswith("client_")}


def grew(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("client_requests", "client_errors",
                                              "client_received_chunks")}  # fmt: skip


def read_back(kv: KVClient, keys: list[bytes]) -> None:
    """Every key's parts bit-exact, in gets of a window's size."""
    for i in range(0, len(keys), WINDOW_KEYS):
        run = keys[i : i + WINDOW_KEYS]
        assert as_bytes(kv.get(SPEC.ns_id, run)) == parts(run, SPEC)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("streamput"), *DAEMON)
    yield d
    d.kill()


def test_windows_are_whole_keys_within_the_payload_and_the_pages() -> None:
    """Runs of whole keys: a run ends before a key that would take it past either bound
    (pages counted per part, rounded up); a key over a bound is a run of its own."""
    four = [[b"x" * 4096] * 2] * 5  # 8 KiB of payload and of pages a key
    assert stream_windows(four, 16384, 1 << 30, 4096) == [(0, 2), (2, 4), (4, 5)]
    assert stream_windows(four, 1 << 30, 3 * 8192, 4096) == [(0, 3), (3, 5)]
    small = [b"y" * 10] * 4  # 10 bytes of payload, one 4 KiB page each
    assert stream_windows(small, 1 << 30, 8192, 4096) == [(0, 2), (2, 4)]
    big = [b"z" * 10, b"z" * 100, b"z" * 10]
    assert stream_windows(big, 50, 1 << 30, 1) == [(0, 1), (1, 2), (2, 3)]
    assert stream_windows(four, 1 << 30, 1 << 30, 4096) == [(0, 5)]


@pytest.mark.multiprocess
def test_a_put_of_three_quotas_goes_over_the_stream_in_windows(daemon: DaemonProc) -> None:
    """48 MiB (three times the quota) goes as 6 stream requests of 64 keys, none over ZMQ;
    the result is every key stored, in order; every chunk reads back bit-exact."""
    keys = make_keys(3 * QUOTA // (2 * SPEC.part_bytes), tag="three-quotas")
    with KVClient(daemon.zmq_address, colocated=False, timeout=60) as kv:
        kv.register_namespace(SPEC)
        assert kv.hello()["stream_put_max_reserved"] == QUOTA
        before = client_counters(kv)
        put = kv.put(SPEC.ns_id, keys, parts(keys, SPEC))
        assert (put.stored, put.present, put.rejected) == (keys, [], False)
        assert kv.sent_by_op[wire.PUT] == 0
        windows = len(keys) // WINDOW_KEYS
        assert windows == 6
        assert grew(before, client_counters(kv)) == {
            "client_requests": windows, "client_errors": 0, "client_received_chunks": len(keys),
        }  # fmt: skip
        read_back(kv, keys)
        again = kv.put(SPEC.ns_id, keys[:40], parts(keys[:40], SPEC))  # results merged
        assert (again.stored, again.present) == ([], keys[:40])


@pytest.mark.multiprocess
def test_the_async_client_puts_in_windows_too(daemon: DaemonProc) -> None:
    keys = make_keys(3 * WINDOW_KEYS + 5, tag="async-windows")

    async def run() -> list[bytes]:
        async with AsyncKVClient(daemon.zmq_address, colocated=False, timeout=60) as kv:
            await kv.register_namespace(SPEC)
            put = await kv.put(SPEC.ns_id, keys, parts(keys, SPEC))
            assert kv.sent_by_op[wire.PUT] == 0
            return put.stored

    with KVClient(daemon.zmq_address, colocated=False, timeout=60) as kv:
        kv.register_namespace(SPEC)
        before = client_counters(kv)
        assert asyncio.run(run()) == keys
        assert grew(before, client_counters(kv)) == {
            "client_requests": 4, "client_errors": 0, "client_received_chunks": len(keys),
        }  # fmt: skip
        read_back(kv, keys)


@pytest.mark.multiprocess
def test_a_window_refused_does_not_stop_the_others(daemon: DaemonProc) -> None:
    """A part of the wrong size in the second window: that window is refused
    (``invalid_argument``, nothing of it stored), the first and third are stored, and the
    error is raised once the put is done, as over ZMQ."""
    keys = make_keys(3 * WINDOW_KEYS, tag="bad-window")
    payload = parts(keys, SPEC)
    payload[WINDOW_KEYS + 3] = [b"short", payload[WINDOW_KEYS + 3][1]]
    with KVClient(daemon.zmq_address, colocated=False, timeout=60) as kv:
        kv.register_namespace(SPEC)
        before = client_counters(kv)
        with pytest.raises(InvalidArgument, match="payload size"):
            kv.put(SPEC.ns_id, keys, payload)
        assert grew(before, client_counters(kv)) == {
            "client_requests": 3, "client_errors": 1,
            "client_received_chunks": 2 * WINDOW_KEYS,
        }  # fmt: skip
        assert kv.sent_by_op[wire.PUT] == 0
        kept = keys[:WINDOW_KEYS] + keys[2 * WINDOW_KEYS :]
        read_back(kv, kept)
        assert kv.lookup(SPEC.ns_id, keys[WINDOW_KEYS : 2 * WINDOW_KEYS]).hit_chunks == 0


def hold_quota(daemon: DaemonProc, keys: list[bytes]) -> socket.socket:
    """Another connection's stream put of ``keys`` whose payload stops after its first byte:
    the daemon holds its pages reserved (against the quota) while it waits for the rest."""
    port = daemon.info["peer_stream_port"]
    link = StreamLink.open(("127.0.0.1", port), "", 30, None)
    size = len(keys) * 2 * SPEC.part_bytes
    args = {"ns_id": SPEC.ns_id, "keys": keys, "lease_s": None}
    request = wire_stream.encode_op_request(1, wire.PUT, args, "holder", size)
    link._sock.sendall(request + b"\0")
    return link._sock


@pytest.mark.multiprocess
def test_a_window_answered_capacity_sends_the_rest_over_zmq(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two windows stored over the stream; then another connection's put in flight holds
    12.5 MiB of the 16 MiB quota, so the third window is answered ``capacity`` (and the
    fourth, already sent behind it, too): they and the rest go over ZMQ, the two windows
    stored stay stored, the result is every key in order, and every chunk reads back
    bit-exact."""
    keys = make_keys(4 * WINDOW_KEYS, tag="capacity")
    holder_keys = make_keys(100, tag="holder")
    held: list[socket.socket] = []
    sends = 0
    send_put = StreamLink.send_put

    def hold_then_send(link: StreamLink, *args: Any, **kwargs: Any) -> Any:
        nonlocal sends
        sends += 1
        if sends == 3:  # once the first two windows are in, nothing of this put in flight
            wait_until(lambda: stored_by_stream() == 2 * WINDOW_KEYS and reserved() == 0,
                       timeout=60)  # fmt: skip
            held.append(hold_quota(daemon, holder_keys))
            wait_until(lambda: reserved() >= 100 * 2, timeout=60)
        return send_put(link, *args, **kwargs)

    monkeypatch.setattr(StreamLink, "send_put", hold_then_send)
    with (
        KVClient(daemon.zmq_address, colocated=False, timeout=60) as kv,
        KVClient(daemon.zmq_address, colocated=False, stream=False) as watcher,
    ):
        kv.register_namespace(SPEC)
        before = client_counters(kv)

        def stored_by_stream() -> int:
            return (
                client_counters(watcher)["client_received_chunks"]
                - before["client_received_chunks"]
            )

        def reserved() -> int:
            return int(watcher.stats()["reserved_pages"])

        try:
            put_result = kv.put(SPEC.ns_id, keys, parts(keys, SPEC))
        finally:
            for sock in held:
                sock.close()
        assert (put_result.stored, put_result.rejected) == (keys, False)
        assert grew(before, client_counters(kv)) == {
            "client_requests": 4 + 1, "client_errors": 2,  # the holder's request: 1
            "client_received_chunks": 2 * WINDOW_KEYS,
        }  # fmt: skip
        assert kv.sent_by_op[wire.PUT] >= 1
        wait_until(lambda: reserved() == 0, timeout=60)
        read_back(kv, keys)


def test_results_merge_in_the_order_of_the_keys() -> None:
    """Windows answered over the stream around one that went over ZMQ: the rest is that
    window's keys, and each list of the result keeps the put's key order."""
    keys = make_keys(6, tag="merge")
    session = SimpleNamespace(server={}, client_id="c")
    call = StreamPut(session, SPEC.ns_id, keys, parts(keys, SPEC), None, 1.0)  # type: ignore[arg-type]
    call.cut = [(0, 2), (2, 4), (4, 6)]
    call.done = {
        0: PutResult(keys[:1], keys[1:2], [], False),
        2: PutResult(keys[4:], [], [], False),
    }
    assert call.rest() == (keys[2:4], parts(keys[2:4], SPEC))
    merged = call.merge(PutResult([keys[3]], [], [keys[2]], rejected=True))
    assert merged == PutResult([keys[0], keys[3], keys[4], keys[5]], [keys[1]], [keys[2]], True)


@pytest.mark.multiprocess
def test_a_daemon_that_does_not_announce_its_quota_gets_one_request(tmp_path: Path) -> None:
    """An older daemon (no ``stream_put_max_reserved`` in its hello): the put is one stream
    request, however large, as before windows."""
    older = start_daemon(tmp_path, *DAEMON, module="tests.support.older_peer",
                         env={"OLDER_PEER_DROP": "stream_put_max_reserved"})  # fmt: skip
    keys = make_keys(3 * QUOTA // (2 * SPEC.part_bytes), tag="older")
    try:
        with KVClient(older.zmq_address, colocated=False, timeout=60) as kv:
            kv.register_namespace(SPEC)
            assert "stream_put_max_reserved" not in kv.hello()
            before = client_counters(kv)
            assert kv.put(SPEC.ns_id, keys, parts(keys, SPEC)).stored == keys
            assert kv.sent_by_op[wire.PUT] == 0
            assert grew(before, client_counters(kv)) == {
                "client_requests": 1, "client_errors": 0, "client_received_chunks": len(keys),
            }  # fmt: skip
            read_back(kv, keys)
    finally:
        older.kill()
