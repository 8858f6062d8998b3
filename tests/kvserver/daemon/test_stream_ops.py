"""Clients' ``put`` and ``get`` on the daemon's stream port (``docs/wire.md`` §6, "Client
ops"): a real ``kvserver start`` on loopback, the real clients, and raw sockets for the bad
input a client never sends (a truncated payload, a malformed or oversized header, a wrong
version or token). After each bad input the daemon still serves everyone else, and nothing
half received becomes readable.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver import wire, wire_stream
from kvserver.client import AsyncKVClient, KVClient
from kvserver.crypto import TlsClient, make_tls_cert
from kvserver.daemon.stream_io import Closed, PlainIO
from kvserver.errors import (
    InvalidArgument,
    KVServerError,
    PermissionDenied,
    UnknownKey,
    UnknownNamespace,
    error_from_code,
)
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.daemon.stream_conn import RawStream
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

TOKEN = "stream-ops-token-0123456789"
READER = "stream-ops-reader-abcdefghij"
OTHER = "stream-ops-other-abcdefghijk"
SPEC = make_spec(model="stream/ops", tp_world_size=2)
MAX_MESSAGE = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("stream-ops")
    config = tmp / "kvserver.toml"
    config.write_text(
        f"max_message_bytes = {MAX_MESSAGE}\n"
        f'[[tenants]]\nname = "reader"\ntoken = "{READER}"\nmodels = ["*"]\nread_only = true\n'
        f'[[tenants]]\nname = "other"\ntoken = "{OTHER}"\nmodels = ["other"]\n'
    )
    d = start_daemon(tmp / "d", "--dram", "16MiB", "--auth-token", TOKEN, "--config", str(config))
    try:
        yield d
    finally:
        d.kill()


def client(d: DaemonProc, token: str = TOKEN, stream: bool = True) -> KVClient:
    kv = KVClient(d.zmq_address, colocated=False, auth_token=token, stream=stream)
    kv.register_namespace(SPEC)
    return kv


def parts_of(keys: list[bytes]) -> list[list[bytes]]:
    return [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in keys]


def stream_stats(d: DaemonProc) -> dict[str, int]:
    with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN, stream=False) as kv:
        return dict(kv.stats()["peer_stream"])


def reserved_pages(d: DaemonProc) -> int:
    with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN, stream=False) as kv:
        return int(kv.stats()["reserved_pages"])


# ---------------------------------------------------------------------- the clients


def test_put_and_get_go_over_the_stream_with_zmqs_results(daemon: DaemonProc) -> None:
    keys = make_keys(6, tag="roundtrip")
    before = stream_stats(daemon)
    with client(daemon) as kv:
        first = kv.put(SPEC.ns_id, keys[:2], parts_of(keys[:2]))
        assert first.stored == keys[:2] and not first.rejected
        # a partial store: the present keys' bytes are read and dropped, the stream in step
        r = kv.put(SPEC.ns_id, keys, parts_of(keys))
        assert r.stored == keys[2:] and r.present == keys[:2] and r.filtered == []
        got = kv.get(SPEC.ns_id, keys)
        assert [[bytes(p) for p in row] for row in got] == parts_of(keys)
        only = kv.get(SPEC.ns_id, keys[3:], ranks=[1])
        assert [[bytes(p) for p in row] for row in only] == [[p[1]] for p in parts_of(keys[3:])]
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 6
        with pytest.raises(UnknownKey):  # a missing key, as over ZMQ
            kv.get(SPEC.ns_id, [*keys, b"\x01" * 32])
        assert kv.get(SPEC.ns_id, keys[:1])[0][0] == parts_of(keys[:1])[0][0]  # still in step
        assert kv.sent_by_op[wire.PUT] == 0 and kv.sent_by_op[wire.GET] == 0
    after = stream_stats(daemon)
    assert after["client_received_chunks"] - before["client_received_chunks"] == 6
    assert after["client_sent_chunks"] - before["client_sent_chunks"] == 6 + 3 + 1
    assert after["client_errors"] - before["client_errors"] == 1
    assert after["requests"] == before["requests"]  # peers' fetches only
    assert after["sent_chunks"] == before["sent_chunks"]


def test_a_put_over_max_message_bytes_goes_over_the_stream_in_windows(
    daemon: DaemonProc,
) -> None:
    """One stream request over the daemon's max_message_bytes would be refused and the stream
    closed: the client cuts the put into windows within it (kvserver/client/stream_put.py;
    before, the whole put went over ZMQ, here to ZMQ's refusal), none over ZMQ, the link stays
    open, every chunk still held reads back."""
    keys = make_keys(MAX_MESSAGE // (2 * SPEC.part_bytes) + 1, tag="large")
    with client(daemon) as kv:
        kv.put(SPEC.ns_id, keys[:1], parts_of(keys[:1]))
        before = stream_stats(daemon)
        r = kv.put(SPEC.ns_id, keys, parts_of(keys))
        assert r.stored == keys[1:] and r.present == keys[:1] and not r.rejected
        after = stream_stats(daemon)
        assert after["client_requests"] - before["client_requests"] >= 2
        assert after["client_received_chunks"] - before["client_received_chunks"] == len(keys) - 1
        assert kv.sent_by_op[wire.PUT] == 0 and after["connections"] == before["connections"]
        # its pages (whole pages per part) pass this daemon's DRAM: later windows evict earlier
        # ones' chunks; every chunk still held reads back exact
        held = [k for k in keys if kv.lookup(SPEC.ns_id, [k]).hit_chunks]
        assert len(held) >= len(keys) // 4
        got = kv.get(SPEC.ns_id, held)
        assert [[bytes(p) for p in row] for row in got] == parts_of(held)


def test_stream_off_or_not_announced_goes_over_zmq(daemon: DaemonProc) -> None:
    keys = make_keys(2, tag="zmq")
    with KVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN, stream=False) as kv:
        kv.register_namespace(SPEC)
        assert kv.put(SPEC.ns_id, keys, parts_of(keys)).stored == keys
        assert bytes(kv.get(SPEC.ns_id, keys)[1][0]) == parts_of(keys)[1][0]
        assert kv.sent_by_op[wire.PUT] == 1 and kv.sent_by_op[wire.GET] == 1
    with client(daemon) as kv:  # an older daemon: no capability in its hello
        kv._s.server["capabilities"].remove(wire.CAP_STREAM_OPS)
        assert bytes(kv.get(SPEC.ns_id, keys)[0][1]) == parts_of(keys)[0][1]
        assert kv.sent_by_op[wire.GET] == 1


def test_a_daemon_without_a_stream_port_is_used_over_zmq(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--dram", "8MiB", "--peer-stream-port", "-1", "--no-auth")
    try:
        keys = make_keys(2, tag="nostream")
        with KVClient(d.zmq_address, colocated=False, stream=True) as kv:
            kv.register_namespace(SPEC)
            assert kv.put(SPEC.ns_id, keys, parts_of(keys)).stored == keys
            assert bytes(kv.get(SPEC.ns_id, keys)[1][1]) == parts_of(keys)[1][1]
            assert kv.sent_by_op[wire.PUT] == 1 and kv.sent_by_op[wire.GET] == 1
    finally:
        d.kill()


def test_tenants_are_checked_on_the_stream(daemon: DaemonProc) -> None:
    keys = make_keys(2, tag="tenants")
    with client(daemon) as kv:
        kv.put(SPEC.ns_id, keys, parts_of(keys))
    with KVClient(daemon.zmq_address, colocated=False, auth_token=READER, stream=True) as kv:
        kv.hello()
        assert bytes(kv.get(SPEC.ns_id, keys)[0][0]) == parts_of(keys)[0][0]
        with pytest.raises(PermissionDenied):
            kv.put(SPEC.ns_id, make_keys(1, tag="ro"), parts_of(make_keys(1, tag="ro")))
        assert kv.sent_by_op[wire.PUT] == 0 and kv.sent_by_op[wire.GET] == 0
    with KVClient(daemon.zmq_address, colocated=False, auth_token=OTHER, stream=True) as kv:
        kv.hello()
        with pytest.raises(UnknownNamespace):  # not its model: as if not registered
            kv.get(SPEC.ns_id, keys)


def test_a_wrong_token_falls_back_to_zmq_which_refuses_it(daemon: DaemonProc) -> None:
    keys = make_keys(1, tag="wrongtoken")
    with client(daemon) as kv:
        kv.put(SPEC.ns_id, keys, parts_of(keys))
        kv._s.auth_token = "not-the-token-0123456789"  # the stream's hello is refused
        kv._stream.close()
        with pytest.raises(KVServerError):
            kv.get(SPEC.ns_id, keys)
    assert stream_stats(daemon)["refused_hellos"] >= 1


def test_the_async_client_uses_the_stream(daemon: DaemonProc) -> None:
    keys = make_keys(4, tag="aio")

    async def main() -> None:
        async with AsyncKVClient(
            daemon.zmq_address, colocated=False, auth_token=TOKEN, stream=True
        ) as kv:
            await kv.register_namespace(SPEC)
            puts = [kv.put(SPEC.ns_id, [k], parts_of([k])) for k in keys]
            assert [r.stored for r in await asyncio.gather(*puts)] == [[k] for k in keys]
            got = await kv.get(SPEC.ns_id, keys)
            assert [[bytes(p) for p in row] for row in got] == parts_of(keys)
            assert kv.sent_by_op[wire.PUT] == 0 and kv.sent_by_op[wire.GET] == 0

    asyncio.run(main())


# ---------------------------------------------------------------------- bad input


def put_args(keys: list[bytes]) -> dict[str, object]:
    return {"ns_id": SPEC.ns_id, "keys": keys}


def payload(keys: list[bytes]) -> bytes:
    return b"".join(p for row in parts_of(keys) for p in row)


def still_serving(d: DaemonProc, tag: str) -> None:
    keys = make_keys(1, tag=tag)
    with client(d) as kv:
        assert kv.put(SPEC.ns_id, keys, parts_of(keys)).stored == keys
        assert bytes(kv.get(SPEC.ns_id, keys)[0][1]) == parts_of(keys)[0][1]
        assert kv.sent_by_op[wire.PUT] == 0


def test_a_payload_cut_short_stores_nothing_and_releases_its_pages(daemon: DaemonProc) -> None:
    with client(daemon):
        pass  # the namespace registered
    keys = make_keys(3, tag="cut")
    raw = RawStream(daemon, TOKEN)
    raw.op(1, "put", put_args(keys), payload(keys)[:-100], announced=len(payload(keys)))
    raw.sock.close()  # EOF with 100 bytes of the last chunk missing
    wait_until(lambda: reserved_pages(daemon) == 0, timeout=30)
    with client(daemon) as kv:
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0
    still_serving(daemon, "after-cut")


def test_refused_requests_keep_the_stream_in_step(daemon: DaemonProc) -> None:
    with client(daemon):
        pass
    keys = make_keys(2, tag="instep")
    body = payload(keys)
    raw = RawStream(daemon, TOKEN)
    raw.sock.sendall(  # a header that is not msgpack, with a payload to drop
        wire_stream.REQUEST_HEAD.pack(wire_stream.OP_MAGIC, 1, 0, 3)
        + wire_stream.OP_PAYLOAD.pack(len(body)) + b"\xc1\xc1\xc1" + body
    )  # fmt: skip
    rid, err = raw.error()
    assert rid == 0 and isinstance(err, InvalidArgument)
    raw.op(2, "put", put_args(keys), body[:-1])  # a payload of the wrong size
    rid, err = raw.error()
    assert rid == 2 and "payload size" in str(err)
    raw.op(3, "put", {"ns_id": SPEC.ns_id, "keys": keys, "bogus": 1}, body)
    assert raw.error()[0] == 3
    raw.op(4, "put", put_args([keys[0], keys[0]]), body)
    assert "duplicate" in str(raw.error()[1])
    raw.op(5, "get", put_args(keys), b"x" * 10)
    assert "no payload" in str(raw.error()[1])
    raw.op(6, "lookup", put_args(keys), body)
    assert raw.error()[0] == 6
    raw.op(7, "put", {"ns_id": "nope", "keys": keys}, body)
    assert isinstance(raw.error()[1], UnknownNamespace)
    raw.op(8, "put", put_args(keys), body)  # and a good one is stored
    head, result = raw.reply()
    assert head.result and msgpack.unpackb(result)["stored"] == keys
    raw.op(9, "get", {"ns_id": SPEC.ns_id, "keys": keys})
    head, parts = raw.reply()
    assert head.ok and head.count == 2 and head.tp == 2 and parts == body
    raw.sock.close()


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(wire_stream.REQUEST_HEAD.pack(wire_stream.OP_MAGIC, 2, 0, 10), id="version"),
        pytest.param(
            wire_stream.REQUEST_HEAD.pack(wire_stream.OP_MAGIC, 1, 0, 9 << 20), id="header"
        ),
        pytest.param(
            wire_stream.REQUEST_HEAD.pack(wire_stream.OP_MAGIC, 1, 0, 10)
            + wire_stream.OP_PAYLOAD.pack(MAX_MESSAGE + 1), id="payload",
        ),
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", id="magic"),
    ],
)  # fmt: skip
def test_unframeable_requests_get_an_error_and_the_connection_closes(
    daemon: DaemonProc, first: bytes
) -> None:
    raw = RawStream(daemon, TOKEN)
    raw.sock.sendall(first)
    rid, err = raw.error()
    assert rid == 0 and err.code in ("invalid_argument", "unsupported_version")
    assert raw.closed()
    raw.sock.close()
    still_serving(daemon, f"after-{first.hex()}")


@pytest.mark.parametrize("token", ["wrong-token-0123456789", ""])
def test_a_wrong_or_missing_token_is_refused_before_any_op(daemon: DaemonProc, token: str) -> None:
    keys = make_keys(1, tag=f"token-{token}")
    raw = RawStream(daemon, token)
    raw.op(1, "put", put_args(keys), payload(keys))
    rid, err = raw.error()
    assert rid == 0 and err.code == "unauthenticated"
    assert raw.closed()
    raw.sock.close()
    with client(daemon) as kv:
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=st.binary(max_size=300), cut=st.integers(min_value=-30, max_value=100))
def test_junk_after_an_op_head_never_stores_a_partial_chunk(
    daemon: DaemonProc, junk: bytes, cut: int
) -> None:
    """An op request whose header and payload are arbitrary bytes, cut anywhere: whatever
    the daemon answers, no key of it becomes readable unless its bytes all arrived, and
    the daemon serves a well-formed request right after."""
    keys = make_keys(1, tag=f"junk-{junk.hex()[:40]}-{cut}")
    request = wire_stream.encode_op_request(1, "put", put_args(keys), None, len(payload(keys)))
    data = (request + payload(keys))[: len(request) + cut] + junk
    raw = RawStream(daemon, TOKEN)
    raw.sock.sendall(data)
    raw.sock.shutdown(socket.SHUT_WR)
    while raw.sock.recv(1 << 16):
        pass  # the daemon answered what it could and closed
    raw.sock.close()
    with client(daemon) as kv:
        assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0
    wait_until(lambda: reserved_pages(daemon) == 0, timeout=30)


def test_error_codes_round_trip() -> None:
    """The client rebuilds the daemon's typed error from an error reply."""
    err = wire_stream.decode_error(wire_stream.encode_error(7, UnknownKey("x"))[24:])
    assert type(err) is type(error_from_code("unknown_key", "x")) and str(err) == "x"


def test_over_a_tls_stream_port_with_the_ca_and_over_zmq_without(tmp_path: Path) -> None:
    """A daemon with a TLS certificate has a TLS stream port only: a client given its CA
    puts and gets over it (the payload read into the pages through OpenSSL); one without a
    CA, or with a CA that does not sign the daemon's certificate, uses ZMQ."""
    cert, key = make_tls_cert(str(tmp_path / "fleet"), "fleet", ["127.0.0.1"])
    rogue, _ = make_tls_cert(str(tmp_path / "rogue"), "rogue", ["127.0.0.1"])
    d = start_daemon(tmp_path / "d", "--dram", "8MiB", "--auth-token", TOKEN,
                     "--tls-cert-file", cert, "--tls-key-file", key)  # fmt: skip
    try:
        big = make_keys(8, tag="tls")  # 64 KiB a key: more than one TLS record per part
        spec = make_spec(model="stream/tls", tp_world_size=2, block_size=256)
        data = [[pattern(k, r, spec.part_bytes) for r in range(2)] for k in big]
        with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN, stream=True,
                      stream_tls=TlsClient(cert).ssl_context()) as kv:  # fmt: skip
            kv.register_namespace(spec)
            assert kv.put(spec.ns_id, big, data).stored == big
            assert [[bytes(p) for p in row] for row in kv.get(spec.ns_id, big)] == data
            assert kv.sent_by_op[wire.PUT] == 0 and kv.sent_by_op[wire.GET] == 0
        for tls in (None, TlsClient(rogue).ssl_context()):
            with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN, stream=True,
                          stream_tls=tls) as kv:  # fmt: skip
                kv.register_namespace(spec)
                assert [[bytes(p) for p in row] for row in kv.get(spec.ns_id, big)] == data
                assert kv.sent_by_op[wire.GET] == 1
        with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN, stream=False) as kv:
            stats = kv.stats()["peer_stream"]
        assert stats["tls"] and stats["client_received_chunks"] == 8
        assert stats["refused_handshakes"] >= 1
    finally:
        d.kill()


def test_a_payload_not_all_in_within_its_bound_is_given_up() -> None:
    """``read_into`` gives up (Closed) once ``within_s`` has passed although each read's own
    timeout has not: a client trickling its bytes cannot keep writing into pages past the
    reservation's lease."""

    async def main() -> float:
        a, b = socket.socketpair()
        with a, b:
            a.setblocking(False)
            io = PlainIO(a, timeout_s=60.0)
            b.sendall(b"x" * 100)  # some bytes, then silence
            start = time.monotonic()
            with pytest.raises(Closed):
                await io.read_into([memoryview(bytearray(1000))], within_s=0.2)
            return time.monotonic() - start

    assert asyncio.run(main()) < 30.0  # the 60 s per-read timeout did not decide it
