"""Clients' ``put`` and ``get`` on the stream port against a hostile or broken client and a
bad network (``docs/wire.md`` §6, "Client ops"): a real daemon on loopback, raw sockets for
what a client never sends, the real clients for the rest. Each test fails if the daemon lets
one connection harm another's bytes, pins or reservations, or stops serving.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import termios
import time
from collections.abc import Iterator

import pytest

from kvserver import wire, wire_stream
from kvserver.client import AsyncKVClient, KVClient
from kvserver.errors import UnknownKey, UnknownNamespace
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.daemon.stream_conn import RawStream
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

TOKEN = "stream-hostile-token-0123456789"
OTHER = "stream-hostile-other-abcdefghij"
SPEC = make_spec(model="stream/hostile", tp_world_size=2, block_size=256)
OTHER_SPEC = make_spec(model="other", tp_world_size=2, block_size=256)
MAX_MESSAGE = 1 << 20
#: keys of one put of MAX_MESSAGE bytes (2 parts of 32 KiB a key)
PER_PUT = MAX_MESSAGE // (2 * SPEC.part_bytes)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("stream-hostile")
    config = tmp / "kvserver.toml"
    config.write_text(
        f"max_message_bytes = {MAX_MESSAGE}\n"
        f'[[tenants]]\nname = "other"\ntoken = "{OTHER}"\nmodels = ["other"]\n'
    )
    d = start_daemon(tmp / "d", "--dram", "32MiB", "--auth-token", TOKEN, "--config", str(config))
    try:
        with admin(d) as kv:
            kv.register_namespace(SPEC)
            kv.register_namespace(OTHER_SPEC)
        yield d
    finally:
        d.kill()


def admin(d: DaemonProc, *, stream: bool = False, client_id: str | None = None) -> KVClient:
    return KVClient(d.zmq_address, colocated=False, auth_token=TOKEN, stream=stream,
                    client_id=client_id)  # fmt: skip


def parts_of(keys: list[bytes], salt: int = 0) -> list[list[bytes]]:
    return [[pattern(k, r + 2 * salt, SPEC.part_bytes) for r in range(2)] for k in keys]


def payload(keys: list[bytes], salt: int = 0) -> bytes:
    return b"".join(p for row in parts_of(keys, salt) for p in row)


def stats(d: DaemonProc) -> dict[str, object]:
    with admin(d) as kv:
        return dict(kv.stats())


def _queued(sock: socket.socket) -> int:
    """Bytes in ``sock``'s send queue (the daemon is not reading them)."""
    return int.from_bytes(fcntl.ioctl(sock, termios.TIOCOUTQ, bytes(4)), "little")


def args_of(keys: list[bytes], spec: object = SPEC) -> dict[str, object]:
    return {"ns_id": spec.ns_id, "keys": keys}  # type: ignore[attr-defined]


def reserving(d: DaemonProc) -> bool:
    return int(stats(d)["reserved_pages"]) > 0  # type: ignore[call-overload]


def reserved_bytes(d: DaemonProc) -> int:
    """DRAM reserved and not yet completed (the daemon's 64 KiB pages)."""
    return int(stats(d)["reserved_pages"]) * (64 << 10)  # type: ignore[call-overload]


def readable(d: DaemonProc, keys: list[bytes]) -> list[list[bytes]]:
    with admin(d) as kv:
        return [[bytes(p) for p in row] for row in kv.get(SPEC.ns_id, keys)]


# ---------------------------------------------------------------------- reservations


def test_a_put_being_received_cannot_be_released_by_its_client(daemon: DaemonProc) -> None:
    """The pages a stream put receives into are the daemon's while the bytes arrive: the
    client the request names releasing its leases (its other thread, a restart, a hostile
    peer naming it) does not give them back, so no other put is handed pages still being
    written and the put completes whole."""
    keys, others = make_keys(4, tag="release-a"), make_keys(4, tag="release-b")
    body = payload(keys)
    raw = RawStream(daemon, TOKEN)
    raw.op(1, "put", args_of(keys), body[: len(body) // 2], announced=len(body), client="victim")
    wait_until(lambda: reserving(daemon), timeout=30)
    with admin(daemon, client_id="victim") as kv:
        assert kv.release() == 0
    with admin(daemon) as kv:  # another put: it must not get the pages still being written
        assert kv.put(SPEC.ns_id, others, parts_of(others, 1)).stored == others
    raw.sock.sendall(body[len(body) // 2 :])
    assert raw.result(1)["stored"] == keys
    raw.close()
    assert readable(daemon, others) == parts_of(others, 1)
    assert readable(daemon, keys) == parts_of(keys)


def test_stalled_puts_holding_dram_are_bounded_rolled_back_and_others_stay_served(
    daemon: DaemonProc,
) -> None:
    """Connections that each send a put's header (1 MiB of 32 KiB parts: 2 MiB of 64 KiB
    pages) and then nothing. The pages reserved for them stop at a quarter of the 32 MiB DRAM
    tier (4 puts of the 15: the others are refused ``capacity`` and wait for the payload they
    announced); meanwhile
    another client's put, refused on the stream for the same reason, goes over ZMQ and is
    answered; once each has been silent for --peer-timeout-s it is closed and its
    reservation rolled back (no key of it readable, no page still reserved), and DRAM takes
    puts again."""
    batches = [make_keys(PER_PUT, tag=f"hostage-{i}") for i in range(15)]
    budget = (32 << 20) // 4
    raws = []
    try:
        for keys in batches:
            raw = RawStream(daemon, TOKEN)
            raw.op(1, "put", args_of(keys), b"", announced=len(payload(keys)))
            raws.append(raw)
        wait_until(lambda: reserved_bytes(daemon) == budget, timeout=30)
        probe = make_keys(1, tag="hostage-probe")
        with admin(daemon, stream=True) as kv:
            kv.put(SPEC.ns_id, probe, parts_of(probe))  # stored or rejected: answered
            assert kv.lookup(SPEC.ns_id, batches[0]).hit_chunks == 0
            assert kv.sent_by_op[wire.PUT] == 1  # the stream said capacity: sent over ZMQ
        assert reserved_bytes(daemon) <= budget
        for raw in raws:
            assert raw.closed()
    finally:
        for raw in raws:
            raw.close()
    wait_until(lambda: not reserving(daemon), timeout=60)
    with admin(daemon, stream=True) as kv:
        for keys in batches:
            assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0
        assert kv.put(SPEC.ns_id, batches[0], parts_of(batches[0])).stored == batches[0]
        assert kv.sent_by_op[wire.PUT] == 0


def test_a_get_of_keys_a_stream_put_is_writing_never_sees_them_half_written(
    daemon: DaemonProc,
) -> None:
    keys = make_keys(3, tag="half-read")
    body = payload(keys)
    raw = RawStream(daemon, TOKEN)
    raw.op(1, "put", args_of(keys), body[: len(body) - 10], announced=len(body))
    wait_until(lambda: reserving(daemon), timeout=30)
    with admin(daemon, stream=True) as kv:
        with pytest.raises(UnknownKey):
            kv.get(SPEC.ns_id, keys)
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0
        assert kv.sent_by_op[wire.GET] == 0
    raw.sock.sendall(body[len(body) - 10 :])
    assert raw.result(1)["stored"] == keys
    raw.close()
    assert readable(daemon, keys) == parts_of(keys)


def test_two_puts_of_one_key_at_once_store_one_whole_copy(daemon: DaemonProc) -> None:
    """The second put of a key another connection is receiving stores nothing of it (it is
    not ``stored`` twice); the key ends up with the first put's bytes, whole."""
    keys = make_keys(2, tag="twice")
    first, second = payload(keys), payload(keys, 1)
    a, b = RawStream(daemon, TOKEN), RawStream(daemon, TOKEN)
    a.op(1, "put", args_of(keys), first[:-1], announced=len(first))
    wait_until(lambda: reserving(daemon), timeout=30)
    b.op(1, "put", args_of(keys), second)
    assert b.result(1)["stored"] == []
    a.sock.sendall(first[-1:])
    assert a.result(1)["stored"] == keys
    a.close()
    b.close()
    assert readable(daemon, keys) == parts_of(keys)


@pytest.mark.parametrize("closes", [True, False], ids=["closes", "stops-reading"])
def test_a_client_leaving_mid_get_reply_ends_its_pins(daemon: DaemonProc, closes: bool) -> None:
    """A get of 10 MiB (more than both sockets' buffers: Linux's send buffer grows to 4 MiB)
    whose client reads the reply's head and then closes, or stops reading: the reply is not
    all sent (``client_sent_chunks`` unchanged), its load lease ends (no page stays pinned; at once,
    or after --peer-timeout-s), and the daemon serves the next client."""
    keys = make_keys(10 * PER_PUT, tag=f"midget-{closes}")
    with admin(daemon, stream=True) as kv:
        for i in range(0, len(keys), PER_PUT):
            window = keys[i : i + PER_PUT]
            assert kv.put(SPEC.ns_id, window, parts_of(window)).stored == window
    sent = stats(daemon)["peer_stream"]["client_sent_chunks"]  # type: ignore[index]
    raw = RawStream(daemon, TOKEN, rcvbuf=4096)
    try:
        raw.op(1, "get", args_of(keys))
        assert raw.head().ok
        if closes:
            raw.close()
        wait_until(lambda: stats(daemon)["pinned_pages"] == 0, timeout=60)
        assert stats(daemon)["peer_stream"]["client_sent_chunks"] == sent  # type: ignore[index]
    finally:
        raw.close()
    assert readable(daemon, keys[:2]) == parts_of(keys[:2])


def test_pipelined_requests_on_one_connection_are_answered_in_order(daemon: DaemonProc) -> None:
    keys = make_keys(2, tag="pipeline")
    raw = RawStream(daemon, TOKEN)
    raw.op(1, "put", args_of(keys), payload(keys))
    raw.op(2, "get", args_of(keys))
    raw.op(3, "get", args_of([b"\x02" * 32]))
    raw.op(4, "put", args_of(keys[:1]), payload(keys[:1])[:-1])  # wrong size: refused
    raw.op(5, "get", {**args_of(keys), "ranks": [1]})
    raw.op(6, "put", args_of(keys), payload(keys), client="kvserver-stream-put")
    assert raw.result(1)["stored"] == keys
    head, body = raw.reply()
    assert head.request_id == 2 and head.ok and body == payload(keys)
    head, body = raw.reply()
    assert head.request_id == 3 and isinstance(wire_stream.decode_error(body), UnknownKey)
    head, body = raw.reply()
    assert head.request_id == 4 and "payload size" in str(wire_stream.decode_error(body))
    head, body = raw.reply()
    assert head.request_id == 5 and body == b"".join(row[1] for row in parts_of(keys))
    head, body = raw.reply()  # a client naming the daemon's own lease owner
    assert head.request_id == 6 and wire_stream.decode_error(body).code == "invalid_argument"
    raw.close()


def test_a_tenant_cannot_put_into_a_namespace_it_does_not_see(daemon: DaemonProc) -> None:
    """A tenant's put whose header names another model's namespace: answered as if the
    namespace were not registered, nothing reserved or stored, the stream in step."""
    keys = make_keys(2, tag="foreign")
    raw = RawStream(daemon, OTHER)
    raw.op(1, "put", args_of(keys), payload(keys))
    head, body = raw.reply()
    assert head.request_id == 1 and isinstance(wire_stream.decode_error(body), UnknownNamespace)
    raw.op(2, "put", args_of(keys, OTHER_SPEC), payload(keys))  # its own: stored
    assert raw.result(2)["stored"] == keys
    raw.close()
    with admin(daemon) as kv:
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0


NEAR = wire_stream.encode_hello(TOKEN[:-1] + "x")


@pytest.mark.parametrize(
    "hello",
    [
        pytest.param(wire_stream.HELLO_HEAD.pack(b"KVPH", 1, 255) + b"\xff" * 255, id="long"),
        pytest.param(wire_stream.HELLO_HEAD.pack(b"KVPH", 1, 10) + b"\xc3" * 10, id="not-utf8"),
        pytest.param(NEAR, id="near"),
    ],
)
def test_a_bad_token_is_refused_and_the_connection_closed(daemon: DaemonProc, hello: bytes) -> None:
    sock = socket.create_connection(("127.0.0.1", daemon.info["peer_stream_port"]), 60)
    with sock:
        sock.sendall(hello)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    head = wire_stream.decode_reply_head(data[: wire_stream.REPLY_HEAD.size])
    assert head.request_id == 0 and not head.ok
    assert wire_stream.decode_error(data[wire_stream.REPLY_HEAD.size :]).code == "unauthenticated"


@pytest.mark.parametrize("stored", [True, False], ids=["stored", "refused"])
def test_a_put_arriving_slowly_but_steadily_is_taken(daemon: DaemonProc, stored: bool) -> None:
    """A slow link (here 64 KiB every 0.3 s, the whole megabyte in ~5 s, beyond the daemon's
    2 s --peer-timeout-s but never silent for that long) is not a stalled one: the put is
    stored. The daemon sleeps until much of the payload is in (SO_RCVLOWAT); waking at its
    timeout with bytes unread is progress, not a silent client."""
    keys = make_keys(PER_PUT, tag=f"slow-{stored}")
    body = payload(keys)
    raw = RawStream(daemon, TOKEN)
    if not stored:  # refused (a key named twice): its payload is read and dropped
        raw.op(1, "put", args_of([keys[0], *keys[:-1]]), b"", announced=len(body))
    else:
        raw.op(1, "put", args_of(keys), b"", announced=len(body))
    for i in range(0, len(body), 64 << 10):
        raw.sock.sendall(body[i : i + (64 << 10)])
        time.sleep(0.3)  # the link's pace, not a synchronisation
    if not stored:
        _, body = raw.reply()
        assert "duplicate" in str(wire_stream.decode_error(body))
        keys = keys[-1:]
        raw.op(2, "put", args_of(keys), payload(keys))  # the stream is in step
        assert raw.result(2)["stored"] == keys
    else:
        assert raw.result(1)["stored"] == keys
    raw.close()
    assert readable(daemon, keys[-1:]) == parts_of(keys[-1:])


def test_the_async_client_cancelled_mid_put_leaves_nothing_behind(daemon: DaemonProc) -> None:
    """An AsyncKVClient put cancelled while its payload is stuck in the sockets (the daemon
    stopped with SIGSTOP): the cancellation returns while the daemon is still stopped (the
    link is shut down, the thread awaited), the daemon then rolls the reservation back (or,
    had every byte been sent, stores the keys whole), and the client's next put goes over
    the stream again at once."""
    keys, warm, after = (make_keys(n, tag=f"aio-{t}") for n, t in
                         ((PER_PUT, "cancel"), (1, "warm"), (1, "after")))  # fmt: skip
    pid = daemon.proc.pid

    def queued(kv: AsyncKVClient) -> int:
        link = kv._stream._link
        assert link is not None
        return _queued(link._sock)

    async def main() -> None:
        async with AsyncKVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN,
                                 stream=True, timeout=300) as kv:  # fmt: skip
            await kv.register_namespace(SPEC)
            await kv.put(SPEC.ns_id, warm, parts_of(warm))  # the link is open
            os.kill(pid, signal.SIGSTOP)
            try:
                task = asyncio.create_task(kv.put(SPEC.ns_id, keys, parts_of(keys)))
                while queued(kv) == 0:
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 60)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert (await kv.put(SPEC.ns_id, after, parts_of(after))).stored == after
            assert kv.sent_by_op[wire.PUT] == 0

    asyncio.run(main())
    wait_until(lambda: not reserving(daemon), timeout=60)
    with admin(daemon) as kv:
        hits = kv.lookup(SPEC.ns_id, keys).hit_chunks
    assert hits in (0, len(keys))
    if hits:
        assert readable(daemon, keys) == parts_of(keys)


def test_the_async_client_closed_during_a_stream_put_frees_its_thread(daemon: DaemonProc) -> None:
    """AsyncKVClient.close() while a stream put's worker thread is blocked on the link (the
    daemon stopped): the thread's call ends at once (the link is shut down, which wakes it;
    closing the descriptor alone left it blocked until the call's timeout, 300 s here)."""
    keys, warm = make_keys(PER_PUT, tag="aio-close"), make_keys(1, tag="aio-close-warm")
    pid = daemon.proc.pid

    async def main() -> None:
        kv = AsyncKVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN, stream=True,
                           timeout=300)  # fmt: skip
        await kv.register_namespace(SPEC)
        await kv.put(SPEC.ns_id, warm, parts_of(warm))
        link, lock = kv._stream._link, kv._stream._lock
        assert link is not None and lock is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            task = asyncio.create_task(kv.put(SPEC.ns_id, keys, parts_of(keys)))
            while _queued(link._sock) == 0:
                await asyncio.sleep(0.01)
            await kv.close()
            async with asyncio.timeout(60):  # the stream call (its thread) is over
                while lock.locked():
                    await asyncio.sleep(0.01)
        finally:
            os.kill(pid, signal.SIGCONT)
        task.cancel()  # its fallback, ZMQ on a closed client, is not this test's
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    wait_until(lambda: not reserving(daemon), timeout=60)
