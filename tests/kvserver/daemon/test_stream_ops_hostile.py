"""Clients' ``put`` and ``get`` on the stream port against a hostile or broken client and a
bad network (``docs/wire.md`` §6, "Client ops"): a real daemon on loopback, raw sockets for
what a client never sends, the real clients for the rest. Each test fails if the daemon lets
one connection harm another's bytes, pins or reservations, or stops serving.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import msgpack
import pytest

from kvserver import wire_stream
from kvserver.client import KVClient
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

TOKEN = "stream-hostile-token-0123456789"
OTHER = "stream-hostile-other-abcdefghij"
SPEC = make_spec(model="stream/hostile", tp_world_size=2)
OTHER_SPEC = make_spec(model="other", tp_world_size=2)
MAX_MESSAGE = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("stream-hostile")
    config = tmp / "kvserver.toml"
    config.write_text(
        f"max_message_bytes = {MAX_MESSAGE}\n"
        f'[[tenants]]\nname = "other"\ntoken = "{OTHER}"\nmodels = ["other"]\n'
    )
    d = start_daemon(tmp / "d", "--dram", "16MiB", "--auth-token", TOKEN, "--config", str(config))
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


class Raw:
    """A raw connection to the stream port, past its hello."""

    def __init__(self, d: DaemonProc, token: str = TOKEN, *, rcvbuf: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(60)
        self.sock.connect(("127.0.0.1", d.info["peer_stream_port"]))
        self.sock.sendall(wire_stream.encode_hello(token))

    def op(self, rid: int, op: str, args: dict[str, object], body: bytes = b"", *,
           announced: int | None = None, client: str | None = None) -> None:  # fmt: skip
        size = len(body) if announced is None else announced
        self.sock.sendall(wire_stream.encode_op_request(rid, op, args, client, size) + body)

    def head(self) -> wire_stream.ReplyHead:
        return wire_stream.decode_reply_head(self.recv(wire_stream.REPLY_HEAD.size), results=True)

    def reply(self) -> tuple[wire_stream.ReplyHead, bytes]:
        head = self.head()
        size = head.count if not head.ok else head.count * head.tp * head.part_bytes
        return head, self.recv(size)

    def result(self, rid: int) -> dict[str, object]:
        head, body = self.reply()
        assert head.request_id == rid
        assert head.result, wire_stream.decode_error(body)
        return dict(msgpack.unpackb(body))

    def recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            assert got, "closed"
            out += got
        return bytes(out)

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return True

    def close(self) -> None:
        self.sock.close()


def args_of(keys: list[bytes], spec: object = SPEC) -> dict[str, object]:
    return {"ns_id": spec.ns_id, "keys": keys}  # type: ignore[attr-defined]


def reserving(d: DaemonProc) -> bool:
    return int(stats(d)["reserved_pages"]) > 0  # type: ignore[call-overload]


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
    raw = Raw(daemon)
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
