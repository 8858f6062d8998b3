"""A client's ``get`` over the stream against a daemon whose reply head lies
(``kvserver/client/stream.py``, ``docs/wire.md`` §6 "Client ops"): the head is checked against
what the client asked for before anything is allocated, and when the client does not know the
namespace's geometry the payload is received into buffers allocated as the bytes arrive.

The client is a real one, its ZMQ side on a real daemon; its stream port is a stand-in on
loopback (a real daemon cannot be made to send these heads), named to it in place of the
daemon's. Afterwards the port is set back and the same client object gets the keys right.
What the client allocates is measured with tracemalloc (numpy's buffers are traced).
"""

from __future__ import annotations

import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvserver import wire, wire_stream
from kvserver.client import AsyncKVClient, KVClient
from kvserver.errors import InvalidArgument, KVServerError, Unavailable
from tests.kvserver.builders import make_keys
from tests.kvserver.client.test_client import SPEC, as_bytes, parts
from tests.support.daemon import DaemonProc, start_daemon
from tests.support.stand_in import recv_exactly

pytestmark = pytest.mark.multiprocess

KEYS = make_keys(2, tag="stream-lies")
#: what the client may allocate (Python's heap, numpy's buffers) while it refuses a lie
BOUND = 8 << 20

Head = Callable[[wire_stream.OpRequest], bytes]


class LyingStream:
    """A stand-in stream port: takes one connection, its hello and one op request, answers it
    with ``head(request)`` and ``body``, then (``hang_up`` False) reads until the client
    drops the connection (``dropped`` set), or closes it at once."""

    def __init__(self, head: Head, body: bytes = b"", *, hang_up: bool = False) -> None:
        self._head, self._body, self._hang_up = head, body, hang_up
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.dropped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(60)
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(60)
            try:
                hello = recv_exactly(conn, wire_stream.HELLO_HEAD.size)
                recv_exactly(conn, wire_stream.decode_hello_head(hello))
                _, length = wire_stream.decode_any_head(
                    recv_exactly(conn, wire_stream.REQUEST_HEAD.size)
                )
                recv_exactly(conn, wire_stream.OP_PAYLOAD.size)  # a get's: 0
                request = wire_stream.decode_op_request(recv_exactly(conn, length))
                conn.sendall(self._head(request) + self._body)
                if self._hang_up:
                    return
                while conn.recv(1 << 16):
                    pass
                self.dropped.set()
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=60)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("lies"), "--page-size", "4KiB", "--dram", "16MiB")
    with KVClient(d.zmq_address, colocated=False, stream=False) as kv:
        kv.register_namespace(SPEC)
        assert kv.put(SPEC.ns_id, KEYS, parts(KEYS)).stored == KEYS
    yield d
    assert d.terminate() == 0, d.log()


def ok(count: int, tp: int, part_bytes: int) -> Head:
    return lambda r: wire_stream.encode_ok(r.request_id, count, tp, part_bytes)


def refused(kv: Any, daemon: DaemonProc, fake: LyingStream, call: Callable[[], Any],
            error: type[KVServerError], match: str) -> KVServerError:  # fmt: skip
    """``call`` (a get on ``kv``, its stream port ``fake``) raises ``error`` (``match``) with
    under BOUND allocated meanwhile."""
    kv._s.server["peer_stream_port"] = fake.port  # the stand-in in place of the daemon's
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match) as info:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        kv._s.server["peer_stream_port"] = daemon.info["peer_stream_port"]
    assert peak < BOUND, f"the client allocated {peak >> 20} MiB"
    return info.value


@pytest.mark.parametrize(
    ("head", "ranks", "match"),
    [
        pytest.param(ok(3, 2, SPEC.part_bytes), None, "chunks than keys", id="more-chunks"),
        pytest.param(ok(2, 2, SPEC.part_bytes), [0], "parts per chunk", id="more-ranks"),
        pytest.param(ok(2, 0, SPEC.part_bytes), None, "parts per chunk", id="no-ranks"),
        pytest.param(ok(2, 2, (1 << 30) + 1), None, "larger than the client", id="huge-part"),
        pytest.param(ok(2, 2, 1 << 40), [0, 1], "larger than the client", id="terabytes"),
        pytest.param(
            lambda r: wire_stream.encode_result(r.request_id, {"stored": []}), None,
            "result reply", id="result-reply",
        ),
    ],
)  # fmt: skip
def test_a_lying_get_head_is_refused_before_anything_is_allocated(
    daemon: DaemonProc, head: Head, ranks: list[int] | None, match: str
) -> None:
    """A client that never registered the namespace (its geometry unknown): a head carrying
    more chunks than keys asked, other ranks than asked, parts over the daemon's
    ``max_message_bytes`` (1 GiB), or a result, raises InvalidArgument before any buffer
    is allocated (before: a buffer of the head's count x tp x size, then a wait for bytes
    that never come; a wrong count went over ZMQ instead); the link is dropped, the stream
    not tried again for RETRY_S (the next get goes over ZMQ, answered right)."""
    fake = LyingStream(head)
    try:
        with KVClient(daemon.zmq_address, colocated=False, stream=True, timeout=10) as kv:
            assert kv.hello()["max_message_bytes"] == 1 << 30
            get = lambda: kv.get(SPEC.ns_id, KEYS, ranks=ranks)  # noqa: E731
            refused(kv, daemon, fake, get, InvalidArgument, match)
            assert fake.dropped.wait(30)  # the link closed, not kept for the next call
            sent = kv.sent_by_op[wire.GET]
            want = [[p[r] for r in ranks] for p in parts(KEYS)] if ranks else parts(KEYS)
            assert as_bytes(kv.get(SPEC.ns_id, KEYS, ranks=ranks)) == want
            assert kv.sent_by_op[wire.GET] == sent + 1  # over ZMQ
    finally:
        fake.close()


def test_a_head_announcing_more_than_arrives_costs_one_segment(daemon: DaemonProc) -> None:
    """Geometry unknown: a head announcing 2 chunks of 64 parts of 16 MiB (2 GiB), of which
    1 MiB arrives before the daemon hangs up: Unavailable (a get was outstanding), with one
    receive buffer of SEGMENT_BYTES (64 MiB) allocated (before: the whole 2 GiB at once);
    the next get finds the link dead (over ZMQ), the one after opens a new link to the real
    stream port; both answered right."""
    fake = LyingStream(ok(2, 64, 16 << 20), b"x" * (1 << 20), hang_up=True)
    try:
        with KVClient(daemon.zmq_address, colocated=False, stream=True, timeout=30) as kv:
            kv.hello()
            kv._s.server["peer_stream_port"] = fake.port
            tracemalloc.start()
            try:
                with pytest.raises(Unavailable, match="closed the stream"):
                    kv.get(SPEC.ns_id, KEYS)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
                kv._s.server["peer_stream_port"] = daemon.info["peer_stream_port"]
            assert peak < (64 << 20) + BOUND, f"the client allocated {peak >> 20} MiB"
            assert as_bytes(kv.get(SPEC.ns_id, KEYS)) == parts(KEYS)  # the dead link found
            sent = kv.sent_by_op[wire.GET]
            assert as_bytes(kv.get(SPEC.ns_id, KEYS)) == parts(KEYS)
            assert kv.sent_by_op[wire.GET] == sent  # over the daemon's stream
    finally:
        fake.close()


async def test_the_async_clients_frame_bound_bounds_a_stream_part(daemon: DaemonProc) -> None:
    """``AsyncKVClient(max_frame_bytes=1 MiB)``: a stream head announcing parts of 2 MiB of
    a namespace the client does not know is refused (InvalidArgument naming the bound) before
    anything is allocated, as ZMQ refuses such a frame; the client goes on."""
    fake = LyingStream(ok(2, 2, 2 << 20))
    kv = AsyncKVClient(daemon.zmq_address, colocated=False, max_frame_bytes=1 << 20, timeout=10)
    try:
        await kv.hello()
        kv._s.server["peer_stream_port"] = fake.port
        try:
            with pytest.raises(InvalidArgument, match="larger than the client") as info:
                await kv.get(SPEC.ns_id, KEYS)
        finally:
            kv._s.server["peer_stream_port"] = daemon.info["peer_stream_port"]
        assert info.value.context == {"size": 2 << 20, "max": 1 << 20}
        assert as_bytes(await kv.get(SPEC.ns_id, KEYS)) == parts(KEYS)
    finally:
        await kv.close()
        fake.close()
