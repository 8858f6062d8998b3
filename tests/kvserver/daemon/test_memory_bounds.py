"""Memory stays bounded whatever a peer announces or repeats, measured on a real daemon
process (its RSS from /proc): idle local-channel connections announcing 1 GiB each, a bound on
local connections, refused oversized gRPC requests sent over and over, and a ZMQ message of a
million empty frames."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvserver import wire, wire_local
from kvserver.client import KVClient
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.local_conn import LocalConn
from tests.support.daemon import DaemonProc, raw_dealer, start_daemon

pytestmark = pytest.mark.multiprocess

MIB = 1 << 20


def rss(pid: int, field: str = "VmRSS") -> int:
    """Resident set size of ``pid`` in bytes (``field="VmHWM"``: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {field}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(
        tmp_path_factory.mktemp("bounds"),
        "--dram",
        "32MiB",
        env={"KVSERVER_LOCAL_MAX_CONNECTIONS": "100"},
    )
    yield d
    d.terminate()


def test_idle_connections_announcing_a_gibibyte_each_cost_little(daemon: DaemonProc) -> None:
    """100 connections each send a size field announcing 1 GiB and a few bytes, then wait:
    the daemon's RSS grows by less than 64 MiB, one more connection is closed at once, and a
    well-behaved client is still served."""
    with KVClient(daemon.zmq_address) as kv:
        kv.hello()
        before = rss(daemon.proc.pid)
        conns = [LocalConn(f"{daemon.arena_path}.sock") for _ in range(100)]
        try:
            for conn in conns:
                conn.send_raw(wire_local.SIZE.pack(1 << 30) + bytes(4000))
            extra = LocalConn(f"{daemon.arena_path}.sock")
            assert extra.poll(10_000) and extra.closed_by_peer()
            extra.close()
            assert kv.hello()["protocol_version"] > 0
            grew = rss(daemon.proc.pid) - before
            assert grew < 64 * MIB, grew
        finally:
            for conn in conns:
                conn.close()


def test_oversized_grpc_requests_sent_again_and_again_do_not_grow_memory(
    daemon: DaemonProc,
) -> None:
    """150 sequential 10 MB Lookup requests, each refused: RSS grows by less than 64 MiB."""
    body = bytes([0x0A]) + b"\xff" * 3 + bytes(10_000_000)  # a field announcing more bytes
    with grpc.insecure_channel(
        daemon.grpc_address, options=[("grpc.max_send_message_length", 64 * MIB)]
    ) as channel:
        lookup = channel.unary_unary("/kvserver.v1.KVServer/Lookup")
        codes = set()

        def once() -> None:
            try:
                lookup(body, timeout=20)
            except grpc.RpcError as exc:
                codes.add(exc.code())

        for _ in range(10):  # warm up: the first requests size grpc's own pools
            once()
        before = rss(daemon.proc.pid)
        for _ in range(150):
            once()
        grew = rss(daemon.proc.pid) - before
    assert codes and grpc.StatusCode.OK not in codes
    assert grew < 64 * MIB, grew


def test_a_message_of_a_million_empty_frames_is_refused_without_keeping_them(
    daemon: DaemonProc,
) -> None:
    """A hello followed by 1,000,000 empty frames (2 MB on the wire, from a peer the handshake
    admitted): the daemon kept a zmq.Frame of each until it refused the message, its peak RSS
    +245 MB; now it keeps the header only (zmq_receive.py), the peak is what ZMQ's own queue
    held (~61 MB). The error is unchanged, and the sender and another client are served."""
    token = daemon.token
    sock = raw_dealer(daemon.zmq_address)
    with KVClient(daemon.zmq_address) as kv:
        info = kv.register_namespace(make_spec(model="test/frames"))
        ns, keys = info.ns_id, make_keys(2, tag="frames")
        data = [[bytes([i + 1]) * info.part_bytes] for i in range(2)]
        assert kv.store(ns, keys, data) == keys
        Path(f"/proc/{daemon.proc.pid}/clear_refs").write_text("5")  # the peak := RSS now
        before = rss(daemon.proc.pid)
        header = wire.encode_request(7, wire.HELLO, {}, auth=token)
        sock.send_multipart([header] + [b""] * 1_000_000)
        assert sock.poll(60_000), "no reply"
        reply = wire.decode_reply(sock.recv_multipart()[0])
        peak = rss(daemon.proc.pid, "VmHWM") - before
        assert not reply.ok and reply.req_id == 7 and reply.error is not None
        assert str(reply.error) == "hello takes no payload frames (frames=1000000)"
        assert peak < 150 * MIB, peak
        sock.send(wire.encode_request(8, wire.HELLO, {}, auth=token))
        assert sock.poll(10_000) and wire.decode_reply(sock.recv_multipart()[0]).ok
        assert [[bytes(p) for p in row] for row in kv.load(ns, keys)] == data
    sock.close()


def test_a_local_message_of_two_million_empty_frames_keeps_its_header_only(
    daemon: DaemonProc,
) -> None:
    """The local channel: a hello with 2,000,000 empty frames (16 MB of framing) was cut into
    2M views and LocalFrame objects before it was refused (peak RSS +521 MB, ~6 s of the
    loop); now the framing decides (zmq_receive.local_frames): the same error, a peak of
    about the message itself, and the connection goes on with its next message."""
    conn = LocalConn(f"{daemon.arena_path}.sock", timeout=60)
    try:
        frames = [wire.encode_request(9, wire.HELLO, {}, auth=daemon.token)] + [b""] * 2_000_000
        Path(f"/proc/{daemon.proc.pid}/clear_refs").write_text("5")
        before = rss(daemon.proc.pid)
        conn.send_multipart(frames)
        reply = wire.decode_reply(conn.recv_multipart()[0])
        peak = rss(daemon.proc.pid, "VmHWM") - before
        assert not reply.ok and reply.req_id == 9 and reply.error is not None
        assert str(reply.error) == "hello takes no payload frames (frames=2000000)"
        assert peak < 150 * MIB, peak
        conn.send_multipart([wire.encode_request(10, wire.HELLO, {}, auth=daemon.token)])
        assert wire.decode_reply(conn.recv_multipart()[0]).ok
    finally:
        conn.close()
