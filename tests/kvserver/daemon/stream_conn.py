"""A raw connection to a daemon's stream port, for the tests of its client ops
(``docs/wire.md`` §6, "Client ops"): what a client never sends, and the replies read byte by
byte. Shared by ``test_stream_ops.py`` and ``test_stream_ops_hostile.py``."""

from __future__ import annotations

import socket

import msgpack

from kvserver import wire_stream
from kvserver.errors import KVServerError
from tests.support.daemon import DaemonProc


class RawStream:
    """A connection to ``d``'s stream port, past its hello (``hello=False``: not sent);
    ``rcvbuf``: its receive buffer (a client that stops reading)."""

    def __init__(self, d: DaemonProc, token: str, *, hello: bool = True, rcvbuf: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(60)
        self.sock.connect(("127.0.0.1", d.info["peer_stream_port"]))
        if hello:
            self.sock.sendall(wire_stream.encode_hello(token))

    def __enter__(self) -> RawStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def op(self, rid: int, op: str, args: dict[str, object], body: bytes = b"", *,
           announced: int | None = None, client: str | None = None) -> None:  # fmt: skip
        """An op request with ``body`` behind it (``announced``: the payload size its head
        says, when not ``len(body)``)."""
        size = len(body) if announced is None else announced
        self.sock.sendall(wire_stream.encode_op_request(rid, op, args, client, size) + body)

    def head(self) -> wire_stream.ReplyHead:
        return wire_stream.decode_reply_head(self.recv(wire_stream.REPLY_HEAD.size), results=True)

    def reply(self) -> tuple[wire_stream.ReplyHead, bytes]:
        head = self.head()
        size = head.count if not head.ok else head.count * head.tp * head.part_bytes
        return head, self.recv(size)

    def result(self, rid: int) -> dict[str, object]:
        """The result reply (a put's) to request ``rid``."""
        head, body = self.reply()
        assert head.request_id == rid
        assert head.result, wire_stream.decode_error(body)
        return dict(msgpack.unpackb(body))

    def error(self) -> tuple[int, KVServerError]:
        """(request id, error) of an error reply."""
        head, body = self.reply()
        assert not head.ok and not head.result
        return head.request_id, wire_stream.decode_error(body)

    def recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            assert got, "closed"
            out += got
        return bytes(out)

    def closed(self) -> bool:
        """Whether the daemon closed the connection (what is read next is its end)."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return True
