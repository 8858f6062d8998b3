"""The Python clients, sync and asyncio: session logic without sockets (stale replies, restart
detection, arena mapping), then against the real daemon: both data paths, typed errors,
timeouts against a dead port, and transparent reconnection after a restart on the same port.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
import zmq

from kvserver import wire
from kvserver.client import AsyncKVClient, KVClient
from kvserver.client.calls import Answer, Call, PutResult
from kvserver.client.common import Session
from kvserver.client.ops import PUT_WINDOW_BYTES, merge_puts
from kvserver.errors import (
    InvalidArgument,
    InvalidState,
    LeaseError,
    Unavailable,
    UnknownKey,
    UnknownNamespace,
)
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, port_kept, start_daemon, wait_until
from tests.support.ports import free_port

SPEC = make_spec(model="test/client", tp_world_size=2)


def parts(keys: list[bytes], spec: NamespaceSpec = SPEC) -> list[list[bytes]]:
    return [[pattern(k, r, spec.part_bytes) for r in range(spec.tp_world_size)] for k in keys]


def as_bytes(rows: list[list[memoryview]]) -> list[list[bytes]]:
    return [[bytes(p) for p in row] for row in rows]


# ----------------------------------------------------------------------------- session (no I/O)


def frames(*parts: bytes) -> list[zmq.Frame]:
    return [zmq.Frame(p) for p in parts]


def test_session_frames_requests_with_fresh_ids_and_identity() -> None:
    s = Session("tcp://x:1", client_id="me", auth_token="tok")
    id1, f1 = s.encode(Call(wire.STATS, {}))
    id2, f2 = s.encode(Call(wire.PUT, {"ns_id": "n"}, [b"a", b"b"]))
    assert id2 == id1 + 1 and f2[1:] == [b"a", b"b"]
    req = wire.parse_request(wire.unpack_header(f1[0]))
    assert (req.req_id, req.op, req.auth, req.client) == (id1, wire.STATS, "tok", "me")


def test_session_discards_stale_and_unreadable_replies() -> None:
    s = Session("tcp://x:1")
    s.sid = "A"
    assert s.accept(frames(wire.encode_reply(4, "A", {})), req_id=5) is None
    assert s.accept(frames(b"\xc1garbage"), req_id=5) is None
    answer = s.accept(frames(wire.encode_reply(5, "A", {"n": 1}), b"payload"), req_id=5)
    assert answer is not None and answer.result == {"n": 1}
    assert [bytes(p) for p in answer.payload] == [b"payload"]


def test_session_raises_typed_errors_including_unreadable_request_replies() -> None:
    s = Session("tcp://x:1")
    with pytest.raises(UnknownKey, match="gone"):
        s.accept(frames(wire.encode_error(5, "A", "unknown_key", "gone")), req_id=5)
    # id 0: the daemon could not read our header; only one request is ever in flight
    with pytest.raises(InvalidArgument, match="too large"):
        s.accept(frames(wire.encode_error(0, "A", "invalid_argument", "too large")), req_id=9)
    with pytest.raises(Unavailable, match=r"within 1\.5s"):
        raise s.timed_out(Call(wire.STATS, {}), 1.5)
    assert s.needs_hello


def test_session_notices_a_restarted_daemon() -> None:
    s = Session("tcp://x:1")
    s.sid, s.needs_hello = "old", False
    assert s.accept(frames(wire.encode_reply(1, "new", {})), req_id=1) is not None
    assert s.needs_hello


def test_arena_is_mapped_only_on_the_same_host(tmp_path: Path) -> None:
    """Mapped when the hello's host is this one and its ``arena_path`` names an arena file
    (``kvserver-<pid>-<hex>``); another host, a missing file or any other file (a hello could
    name the client's own files, which its grants would then have it write) is not mapped
    (``colocated=True``: InvalidState)."""
    arena = tmp_path / "kvserver-1-0a1b2c3d"
    arena.write_bytes(bytes(8192))
    other = tmp_path / "config.toml"
    other.write_bytes(bytes(8192))
    info = {"sid": "s", "host_id": wire.host_id(), "arena_path": str(arena), "arena_size": 8192}
    elsewhere = {**info, "host_id": "other-host/boot"}
    not_an_arena = {**info, "arena_path": str(other)}
    for mode, hello, mapped in [
        (None, info, True),
        (None, elsewhere, False),
        (False, info, False),
        (True, info, True),
        (None, {**info, "arena_path": str(tmp_path / "missing")}, False),
        (None, not_an_arena, False),
        (None, {**info, "arena_path": str(tmp_path / "kvserver-1-0a1b2c3d.sock")}, False),
    ]:
        s = Session("tcp://x:1", colocated=mode)
        proc = s.hello()
        next(proc)
        with pytest.raises(StopIteration):
            proc.send(answer_of(hello))
        assert (s.arena is not None) == mapped, (mode, hello)
        if s.arena is not None:
            s.mapped().write(((0, 4),), b"abcd")
            assert arena.read_bytes()[:4] == b"abcd"
        s.close()
    s = Session("tcp://x:1", colocated=True)
    proc = s.hello()
    next(proc)
    with pytest.raises(InvalidState, match="another host"):
        proc.send(answer_of(elsewhere))
    with pytest.raises(InvalidState, match="not mapped"):
        s.mapped()
    s = Session("tcp://x:1", colocated=True)
    proc = s.hello()
    next(proc)
    with pytest.raises(InvalidState, match="does not name an arena"):
        proc.send(answer_of(not_an_arena))
    assert other.read_bytes() == bytes(8192)


def answer_of(result: dict[str, Any]) -> Answer:
    return Answer(result, [])


# ----------------------------------------------------------------------------- against a daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("client"), "--page-size", "4KiB", "--dram", "16MiB")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.mark.multiprocess
@pytest.mark.parametrize("colocated", [None, False])
def test_sync_client_both_paths(daemon: DaemonProc, colocated: bool | None) -> None:
    keys = make_keys(6, tag=f"sync{colocated}")
    with KVClient(daemon.zmq_address, colocated=colocated) as kv:
        info = kv.hello()
        assert info["protocol_version"] == wire.PROTOCOL_VERSION and info["client"] == kv.client_id
        ns = kv.register_namespace(SPEC)
        assert kv.is_colocated is (colocated is None)
        assert SPEC in kv.namespaces()
        assert kv.store(ns.ns_id, keys, parts(keys)) == keys
        assert kv.lookup(ns.ns_id, keys + make_keys(1, tag="miss")).hit_chunks == 6
        assert as_bytes(kv.load(ns.ns_id, keys, ranks=[1])) == [[p[1]] for p in parts(keys)]
        assert kv.pin(ns.ns_id, keys[:2], ttl_s=30) == 2 and kv.unpin(ns.ns_id, keys[:2]) == 2
        kv.touch(ns.ns_id, keys)
        tokens = list(range(SPEC.block_size * 2))
        assert kv.lookup_tokens(ns.ns_id, tokens, cache_salt="s").num_chunks == 2
        wait_until(lambda: kv.stats()["pinned_pages"] == 0)


@pytest.mark.multiprocess
def test_a_multi_frame_reply_header_is_decoded_once(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get's reply over ZMQ (a header and 8 payload frames), sync and asyncio: its header is
    decoded once, for both its frame budget and its routing (was twice)."""
    keys = make_keys(4, tag="decode-once")
    decoded: list[int] = []
    real = wire.decode_reply

    def counting(frame: bytes | memoryview) -> wire.Reply:
        reply = real(frame)
        decoded.append(reply.req_id)
        return reply

    async def aio_load(ns_id: str) -> list[list[memoryview]]:
        async with AsyncKVClient(daemon.zmq_address, colocated=False) as akv:
            await akv.register_namespace(SPEC)
            decoded.clear()
            return await akv.load(ns_id, keys)

    with KVClient(daemon.zmq_address, colocated=False) as kv:
        ns_id = kv.register_namespace(SPEC).ns_id
        assert kv.store(ns_id, keys, parts(keys)) == keys
        monkeypatch.setattr(wire, "decode_reply", counting)
        decoded.clear()
        assert as_bytes(kv.load(ns_id, keys)) == parts(keys)
        assert len(decoded) == 1, decoded
        assert as_bytes(asyncio.run(aio_load(ns_id))) == parts(keys)
        assert len(decoded) == 1, decoded


@pytest.mark.multiprocess
def test_typed_errors_and_rollback(daemon: DaemonProc) -> None:
    with KVClient(daemon.zmq_address) as kv:
        ns = kv.register_namespace(SPEC)
        with pytest.raises(UnknownNamespace):
            kv.lookup("0000000000000000", [])
        with pytest.raises(UnknownKey):
            kv.prepare_load(ns.ns_id, make_keys(1, tag="absent"))
        with pytest.raises(LeaseError):
            kv.complete_store(10**9)
        keys = make_keys(2, tag="rollback")
        bad = [[b"short", b"short"] for _ in keys]  # the arena write fails: reservation undone
        with pytest.raises(InvalidArgument, match="size"):
            kv.store(ns.ns_id, keys, bad)
        assert kv.stats()["reserved_pages"] == 0
        assert kv.lookup(ns.ns_id, keys).hit_chunks == 0
        with pytest.raises(InvalidArgument, match="one entry of parts per key"):
            kv.put(ns.ns_id, keys, parts(keys)[:1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("colocated", [None, False])
async def test_async_client_both_paths_and_concurrency(
    daemon: DaemonProc, colocated: bool | None
) -> None:
    async with AsyncKVClient(daemon.zmq_address, colocated=colocated) as kv:
        ns = await kv.register_namespace(SPEC)
        assert kv.is_colocated is (colocated is None)
        batches = [make_keys(3, tag=f"aio{colocated}-{i}") for i in range(8)]
        stored = await asyncio.gather(*(kv.store(ns.ns_id, b, parts(b)) for b in batches))
        assert stored == batches
        loaded = await asyncio.gather(*(kv.load(ns.ns_id, b) for b in batches))
        assert [as_bytes(rows) for rows in loaded] == [parts(b) for b in batches]
        grant = await kv.prepare_load(ns.ns_id, batches[0])
        got = await kv.read_parts(ns.ns_id, grant.lease_id, batches[0], 1)
        assert [bytes(v) for v in got] == [p[1] for p in parts(batches[0])]
        await kv.complete_load(grant.lease_id)
        assert (await kv.lookup(ns.ns_id, batches[-1])).hit_chunks == 3


@pytest.mark.multiprocess
def test_async_client_on_uvloop(daemon: DaemonProc) -> None:
    async def main() -> list[list[bytes]]:
        async with AsyncKVClient(daemon.zmq_address, colocated=False) as kv:
            ns = await kv.register_namespace(SPEC)
            keys = make_keys(2, tag="uvloop")
            result = await kv.put(ns.ns_id, keys, parts(keys))
            assert result.stored == keys
            return as_bytes(await kv.get(ns.ns_id, keys))

    assert uvloop.run(main()) == parts(make_keys(2, tag="uvloop"))


# ----------------------------------------------------------------------------- timeouts, restarts


def test_sync_timeout_against_a_dead_port() -> None:
    with KVClient(f"tcp://127.0.0.1:{free_port()}", timeout=0.3) as kv:
        for _ in range(2):  # the socket is replaced after each timeout
            start = time.monotonic()
            with pytest.raises(Unavailable, match="no reply"):
                kv.stats()
            assert time.monotonic() - start < 3.0


async def test_async_timeout_against_a_dead_port() -> None:
    async with AsyncKVClient(f"tcp://127.0.0.1:{free_port()}", timeout=0.3) as kv:
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(Unavailable, match="no reply"):
                await kv.lookup("ns", [])
            assert time.monotonic() - start < 3.0


def restart(d: DaemonProc, tmp_path: Path) -> DaemonProc:
    assert d.terminate() == 0
    return start_daemon(tmp_path, "--zmq-port", str(d.info["zmq_port"]))


@pytest.mark.multiprocess
def test_sync_client_survives_a_daemon_restart_on_the_same_port(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, *port_kept())
    keys = make_keys(3, tag="restart")
    try:
        with KVClient(d.zmq_address, timeout=30) as kv:
            ns = kv.register_namespace(SPEC)
            assert kv.store(ns.ns_id, keys, parts(keys)) == keys
            old_arena = d.arena_path
            d = restart(d, tmp_path)  # nothing in flight: the DEALER reconnects by itself
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 0  # namespace re-registered
            assert kv.is_colocated and kv.hello()["arena_path"] == d.arena_path != old_arena
            assert kv.store(ns.ns_id, keys, parts(keys)) == keys
            assert as_bytes(kv.load(ns.ns_id, keys)) == parts(keys)
            assert d.terminate() == 0
            kv.timeout = 0.3
            with pytest.raises(Unavailable):
                kv.stats()  # daemon down: times out, socket replaced
            d = start_daemon(tmp_path, "--zmq-port", str(d.info["zmq_port"]))
            kv.timeout = 5.0
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 0
            assert kv.put(ns.ns_id, keys, parts(keys)).stored == keys
    finally:
        d.terminate()


@pytest.mark.multiprocess
async def test_async_client_survives_a_daemon_restart_on_the_same_port(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, *port_kept())
    keys = make_keys(3, tag="arestart")
    try:
        async with AsyncKVClient(d.zmq_address, timeout=30) as kv:
            ns = await kv.register_namespace(SPEC)
            assert await kv.store(ns.ns_id, keys, parts(keys)) == keys
            d = await asyncio.to_thread(restart, d, tmp_path)
            assert (await kv.lookup(ns.ns_id, keys)).hit_chunks == 0
            assert await kv.store(ns.ns_id, keys, parts(keys)) == keys
            assert as_bytes(await kv.load(ns.ns_id, keys)) == parts(keys)
            assert (await kv.hello())["arena_path"] == d.arena_path
    finally:
        d.terminate()


# ----------------------------------------------------------------------------- pipelined calls


#: the blocking client on ZMQ (remote) and on the daemon's local channel (co-located).
TRANSPORTS = pytest.mark.parametrize("colocated", [False, None], ids=["zmq", "local"])


@pytest.mark.multiprocess
@TRANSPORTS
def test_submitted_calls_are_collected_in_any_order(
    daemon: DaemonProc, colocated: bool | None
) -> None:
    """Several requests outstanding on one connection: replies read by a blocking call or by
    another Pending's result() are kept for their own Pending; a cancelled one's reply is
    discarded; nothing is mixed up."""
    with KVClient(daemon.zmq_address, colocated=colocated) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.is_local is (colocated is None)
        a, b, c = (make_keys(2, tag=f"pipe-{t}-{colocated}") for t in "abc")
        p_a = kv.submit_prepare_store(ns.ns_id, a)
        p_look = kv.submit_lookup(ns.ns_id, a)
        p_c = kv.submit_prepare_store(ns.ns_id, c)
        p_gone = kv.submit_prepare_store(ns.ns_id, b)
        p_gone.cancel()
        assert kv.stats()["num_leases"] == 3  # blocking: reads (and keeps) the earlier replies
        assert p_a.done() and p_c.done() and p_look.done()
        grant_c = p_c.result(0)  # out of order, without waiting
        assert grant_c is not None and grant_c.keys == c
        assert p_look.result().hit_chunks == 0  # a is reserved, not ready
        grant_a = p_a.result()
        assert grant_a is not None and grant_a.keys == a and grant_a.lease_id != grant_c.lease_id
        done_a = kv.submit_complete_store(grant_a.lease_id, keys=a[:1])
        done_c = kv.submit_complete_store(grant_c.lease_id, success=False)
        assert kv.submit_lookup(ns.ns_id, a).result().hit_chunks == 1  # applied in order
        assert done_c.result() == [] and done_a.result() == a[:1]
        assert kv.complete_store(grant_a.lease_id, keys=a[1:]) == a[1:]
        with pytest.raises(LeaseError):  # the outcome is kept: raised again
            kv.submit_complete_load(grant_a.lease_id).result()
        assert kv.release() == 1  # b's reservation: cancelling does not undo it
        with pytest.raises(InvalidState, match="cancelled"):
            p_gone.result()
        load = kv.submit_prepare_load(ns.ns_id, a)
        lease_id = load.result().lease_id
        assert kv.submit_complete_load(lease_id).result() is None
        assert kv.sent_by_op[wire.PREPARE_STORE] == 3 and kv.sent_by_op[wire.COMPLETE_LOAD] == 2


@pytest.mark.multiprocess
@TRANSPORTS
def test_unreadable_request_error_goes_to_the_oldest_outstanding(
    daemon: DaemonProc, colocated: bool | None
) -> None:
    """A header the daemon cannot read is answered with id 0; replies come in request order,
    so it belongs to the oldest request still outstanding, not to whoever reads it."""
    with KVClient(daemon.zmq_address, colocated=colocated) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.is_local is (colocated is None)
        first = kv.submit_lookup(ns.ns_id, make_keys(1, tag="first"))
        huge = [bytes([i % 251]) * 64 for i in range(300_000)]  # a > 16 MiB header
        bad = kv.submit_lookup(ns.ns_id, huge)
        last = kv.submit_lookup(ns.ns_id, make_keys(1, tag="last"))
        assert last.result().num_chunks == 1
        with pytest.raises(InvalidArgument, match="too large"):
            bad.result()
        assert first.result().num_chunks == 1


@pytest.mark.multiprocess
@TRANSPORTS
def test_submitted_call_times_out_and_fails_the_others(
    tmp_path: Path, colocated: bool | None
) -> None:
    """The daemon is gone after the session was set up: result() gives up after its timeout
    and the socket is replaced, so the other outstanding request fails at once; once a daemon
    listens again the client works. (On the local channel the requests find it closed and
    are queued on ZMQ instead, as a DEALER would queue them.)"""
    d = start_daemon(tmp_path, *port_kept())
    try:
        with KVClient(d.zmq_address, timeout=30, colocated=colocated) as kv:
            ns = kv.register_namespace(SPEC)  # succeeds however loaded the machine is
            assert kv.is_local is (colocated is None)
            kv.timeout = 0.3
            assert d.terminate() == 0
            first = kv.submit_lookup(ns.ns_id, [])  # no hello needed: sent at once
            second = kv.submit_complete_load(7)
            start = time.monotonic()
            with pytest.raises(Unavailable, match="no reply"):
                first.result(timeout=0.2)
            assert second.done()
            with pytest.raises(Unavailable, match="timed out"):
                second.result(timeout=30)
            assert time.monotonic() - start < 3.0
            d = start_daemon(tmp_path, "--zmq-port", str(d.info["zmq_port"]))
            kv.timeout = 5.0
            assert kv.submit_lookup(ns.ns_id, make_keys(1, tag="back")).result().num_chunks == 1
    finally:
        d.terminate()


@pytest.mark.multiprocess
@TRANSPORTS
def test_daemon_restart_between_submit_and_collect(tmp_path: Path, colocated: bool | None) -> None:
    """A reply read before the restart is the old daemon's (its lease is gone: completing it
    is a lease error, and the client renews its session). A request sent while the daemon is
    down is queued by the socket and answered by the new daemon: the namespace is registered
    again and the request retried, giving a usable grant."""
    d = start_daemon(tmp_path, *port_kept())
    keys = make_keys(2, tag="pipe-restart")
    try:
        with KVClient(d.zmq_address, timeout=5.0, colocated=colocated) as kv:
            ns = kv.register_namespace(SPEC)
            assert kv.is_local is (colocated is None)
            old = kv.submit_prepare_store(ns.ns_id, keys)
            kv.stats()  # its reply is in
            d = restart(d, tmp_path)
            grant = old.result(0)
            assert grant is not None and grant.keys == keys
            with pytest.raises(LeaseError):
                kv.submit_complete_store(grant.lease_id).result()
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 0  # session renewed
            assert d.terminate() == 0
            queued = kv.submit_prepare_store(ns.ns_id, keys)
            d = start_daemon(tmp_path, "--zmq-port", str(d.info["zmq_port"]))
            grant = queued.result()
            assert grant is not None and grant.keys == keys
            assert kv.submit_complete_store(grant.lease_id).result() == keys
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 2
            assert kv.is_local is (colocated is None)  # on the new daemon's channel
    finally:
        d.terminate()


@pytest.mark.multiprocess
def test_local_channel_lost_with_requests_outstanding(tmp_path: Path) -> None:
    """Requests written to the local channel of a daemon that then dies fail with Unavailable
    when the channel closes (not after the client's 60 s timeout), all of them at once."""
    d = start_daemon(tmp_path)
    try:
        with KVClient(d.zmq_address, timeout=60.0) as kv:
            ns = kv.register_namespace(SPEC)
            assert kv.is_local
            d.proc.send_signal(signal.SIGSTOP)  # written, never read
            first = kv.submit_lookup(ns.ns_id, make_keys(1, tag="lost-1"))
            second = kv.submit_lookup(ns.ns_id, make_keys(1, tag="lost-2"))
            d.proc.kill()
            d.proc.wait(30)
            with pytest.raises(Unavailable, match="local channel"):
                first.result()
            assert second.done()
            with pytest.raises(Unavailable, match="local channel"):
                second.result()
            assert not kv.is_local
    finally:
        d.kill()  # SIGKILL: also ends a stopped process


@pytest.mark.multiprocess
def test_local_channel_only_when_colocated_and_wanted(daemon: DaemonProc) -> None:
    for colocated, local, expected in (
        (None, True, True),
        (False, True, False),
        (None, False, False),
    ):
        with KVClient(daemon.zmq_address, colocated=colocated, local=local) as kv:
            ns = kv.register_namespace(SPEC)
            keys = make_keys(2, tag=f"which-{colocated}-{local}")
            assert kv.store(ns.ns_id, keys, parts(keys)) == keys
            assert as_bytes(kv.load(ns.ns_id, keys)) == parts(keys)
            assert kv.is_local is expected


@pytest.mark.multiprocess
def test_a_large_put_goes_as_windows_and_is_stored_whole(tmp_path: Path) -> None:
    """A put of more than PUT_WINDOW_BYTES is several messages (sync and asyncio clients),
    each of at most that much payload; every byte is stored; a window's error is raised."""
    spec = make_spec(model="test/windows", part_bytes_override=1 << 20)
    n = 2 * PUT_WINDOW_BYTES // spec.part_bytes + 3  # three windows, the last one short
    d = start_daemon(tmp_path, "--dram", "96MiB")
    try:
        keys = make_keys(n, tag="win")
        data = [pattern(k, 0, spec.part_bytes) for k in keys]
        with KVClient(d.zmq_address, colocated=False, stream=False) as kv:  # ZMQ's windows
            ns = kv.register_namespace(spec)
            r = kv.put(ns.ns_id, keys, data)
            assert (r.stored, r.present, r.rejected) == (keys, [], False)
            assert kv.sent_by_op[wire.PUT] == 3
            assert [bytes(row[0]) for row in kv.get(ns.ns_id, keys)] == data
            with pytest.raises(InvalidArgument):  # the last window's last part is too short
                kv.put(ns.ns_id, make_keys(n, tag="bad"), [*data[:-1], b"short"])

        async def put_async() -> None:
            async with AsyncKVClient(d.zmq_address, colocated=False, stream=False) as akv:
                ns = await akv.register_namespace(spec)
                more = make_keys(n, tag="win-aio")
                r = await akv.put(ns.ns_id, more, [[p] for p in data])  # one buffer per rank
                assert (r.stored, r.present) == (more, [])
                assert akv.sent_by_op[wire.PUT] == 3
                got = await akv.get(ns.ns_id, more)
                assert [bytes(row[0]) for row in got] == data

        asyncio.run(put_async())
    finally:
        assert d.terminate() == 0, d.log()


def test_window_results_merge_in_order() -> None:
    a = PutResult([b"1"], [b"2"], [], rejected=False)
    b = PutResult([b"3"], [], [b"4"], rejected=True)
    assert merge_puts([a, b]) == PutResult([b"1", b"3"], [b"2"], [b"4"], rejected=True)


def test_a_session_uses_the_local_channel_only_where_both_transports_may() -> None:
    """``Session.local_path``, the one test of the sync and asyncio transports: the path once
    the hello is current, the arena mapped and the daemon's local version this client's; None
    for a refused path, another version, no arena, a hello due, or a path other than the
    arena's beside it (a hello naming just any socket)."""
    from kvserver.arena import ArenaView
    from kvserver.wire_local import LOCAL_VERSION
    from tests.kvserver.builders import make_engine

    with make_engine() as engine:
        sock = f"{engine.arena.path}.sock"
        session = Session("tcp://127.0.0.1:1")
        session.server = {"local_path": sock, "local_version": LOCAL_VERSION}
        assert session.local_path() is None  # no hello yet (and no arena)
        session.needs_hello = False
        assert session.local_path() is None  # the arena not mapped: another host
        session.arena = ArenaView.attach(engine.arena.path)
        try:
            assert session.local_path() == sock
            assert session.local_path(refused=sock) is None
            assert session.local_path(refused="/run/other.sock") == sock
            session.server["local_path"] = "/run/kv.sock"
            assert session.local_path() is None
            session.server["local_path"] = sock
            session.server["local_version"] = LOCAL_VERSION + 1
            assert session.local_path() is None
            session.needs_hello = True
            session.server["local_version"] = LOCAL_VERSION
            assert session.local_path() is None
        finally:
            session.close()
