"""The peer stream: a TCP framing (plain or inside TLS) for daemon-to-daemon chunk fetches.

Runs in the daemon, at both ends: the serving daemon (``kvserver/daemon/stream_server.py``)
and the fetching one (``kvserver/daemon/peers/stream.py``). Pure constants and functions: no
sockets, no state, thread-safe. Described for humans in ``docs/wire.md`` ("Peer stream").

Why a second transport: over ZMQ a fetched chunk is copied three times (the sender's kernel
send, the receiver's kernel receive into ZMQ's own buffer, the receiver's copy into its
arena). On a plain stream the fetching daemon reserves the arena pages first and receives the
payload straight into them (``recv_into``): two copies, those of any TCP transfer. It carries
one operation, a peer's ``get leading=true``. Encryption is TLS under this framing, on the
port of a daemon with a TLS certificate (``kvserver/daemon/stream_io.py``, ``docs/wire.md``
§6); a daemon with CURVE and no certificate opens no stream port, and never dials a plain one.

A connection opens with a hello that carries the token (fetching daemon → serving daemon),
integers big-endian; the server reads nothing else before the token matches::

    magic    4 bytes   b"KVPH"
    version  u8        STREAM_VERSION
    length   u8        bytes of the token that follows, 0 .. 255
    token    utf-8     the admin's or a tenant's token ("" when the server requires none)

then requests, each::

    magic    4 bytes   b"KVPQ"
    version  u8        STREAM_VERSION
    flags    u8        0
    length   u32       bytes of the header that follows, 1 .. MAX_REQUEST_BYTES
    header   msgpack   {"id": int, "ns_id": str, "keys": [bytes, ...]}

A reply (in the order the requests came, one per request)::

    magic    4 bytes   b"KVPR"
    version  u8        STREAM_VERSION
    status   u8        0 ok, 1 error
    tp       u16       ok: parts per chunk (the namespace's TP world size); error: 0
    id       u32       the request's id (mod 2^32)
    count    u32       ok: chunks that follow (the leading run held, <= keys asked);
                       error: bytes of the error that follows
    size     u64       ok: bytes of one part (the namespace's part_bytes); error: 0
    ok:    count x tp parts of ``size`` bytes, chunk-major, rank order, back to back
    error: msgpack {"code": str, "message": str}

Clients (``KVClient`` / ``AsyncKVClient`` not co-located; a daemon announces that its stream
takes them with the ``hello`` capability ``stream_ops``) send a data-plane ``put`` or ``get``
as an **op request** instead, after the same hello::

    magic    4 bytes   b"KVPO"
    version  u8        STREAM_VERSION
    flags    u8        0
    length   u32       bytes of the header that follows, 1 .. MAX_REQUEST_BYTES
    payload  u64       bytes of payload that follow the header (a put's parts; 0 for a get)
    header   msgpack   {"id": int, "op": "put" | "get", "args": map, "client": str?}
    payload  a put's len(keys) x tp parts, key-major, back to back

``args`` are the ZMQ op's (``wire.OPS``: checked by ``wire_requests.check_args``); a ``get``
is answered with an ok reply (``tp``: the ranks sent per chunk), a ``put`` with a result
reply (status 2: ``count`` bytes of a msgpack map, the ZMQ reply's ``result``). A request
refused after its head was read has its payload read and dropped first, so the stream stays
in step.

A stream has no message boundaries of its own: a hello or request whose magic, version or
length is wrong cannot be skipped, so the server answers it with an error and closes the
connection; so it does for a wrong token (its reply has id 0). A request whose header is well
framed but wrong inside (types, a key too long, an unknown namespace, a namespace the token
does not grant) is answered with an error and the stream goes on. No checksums: TCP's, as on the
ZMQ data plane; the fetching daemon checks every reply's shape against what it asked.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvserver.errors import InvalidArgument, KVServerError, UnsupportedVersion, error_from_code
from kvserver.wire_requests import check_args

STREAM_VERSION = 1
HELLO_MAGIC = b"KVPH"
REQUEST_MAGIC = b"KVPQ"
OP_MAGIC = b"KVPO"
REPLY_MAGIC = b"KVPR"
#: magic, version, token length.
HELLO_HEAD = struct.Struct(">4sBB")
#: longest token a hello carries.
MAX_TOKEN_BYTES = 255
#: magic, version, flags, header length.
REQUEST_HEAD = struct.Struct(">4sBBI")
#: what follows an op request's head: its payload's size.
OP_PAYLOAD = struct.Struct(">Q")
#: magic, version, status, tp, id, count, size.
REPLY_HEAD = struct.Struct(">4sBBHIIQ")
STATUS_OK = 0
STATUS_ERROR = 1
#: an op's result map (a client's ``put``); never sent to a fetching daemon.
STATUS_RESULT = 2
#: the ops an op request may carry.
STREAM_OPS = ("put", "get")
#: longest result map a client reads (a put's key lists: 3 x 65,536 keys of 64 bytes).
MAX_RESULT_BYTES = 16 << 20
#: largest request header accepted (a window of 65,536 keys of 64 bytes is ~4.3 MB).
MAX_REQUEST_BYTES = 8 << 20
#: most keys one request may name.
MAX_KEYS = 1 << 16
#: longest chunk key (as on the ZMQ data plane).
MAX_KEY_BYTES = 64
#: longest error message a fetching daemon reads.
MAX_ERROR_BYTES = 64 << 10
MAX_STR_LEN = 1 << 16


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """One ``get leading=true`` on the stream."""

    request_id: int
    ns_id: str
    keys: list[bytes]


@dataclass(frozen=True, slots=True)
class OpRequest:
    """A client's ``put`` or ``get`` on the stream: ``args`` checked as the ZMQ op's, every
    field present (None where absent); ``client`` the lease owner it names, if any."""

    request_id: int
    op: str
    args: dict[str, Any]
    client: str | None


@dataclass(frozen=True, slots=True)
class ReplyHead:
    """A reply's fixed head: ``count`` chunks of ``tp`` parts of ``part_bytes`` follow (ok),
    or an error of ``count`` bytes."""

    ok: bool
    tp: int
    request_id: int
    count: int
    part_bytes: int
    #: a result reply (a client's ``put``): ``count`` bytes of its result map follow.
    result: bool = False


def encode_request(request: FetchRequest) -> bytes:
    """The request's bytes (head and header)."""
    header = msgpack.packb(
        {"id": request.request_id, "ns_id": request.ns_id, "keys": list(request.keys)},
        use_bin_type=True,
    )
    return REQUEST_HEAD.pack(REQUEST_MAGIC, STREAM_VERSION, 0, len(header)) + bytes(header)


def decode_request_head(head: bytes | bytearray | memoryview) -> int:
    """The header length a request's head announces. Raises ``UnsupportedVersion`` or
    ``InvalidArgument`` (the stream cannot go on after either)."""
    return decode_any_head(head)[1]


def decode_any_head(head: bytes | bytearray | memoryview) -> tuple[bool, int]:
    """(an op request, its header length) for a fetch request's or an op request's head (an
    op request's payload size follows it: :data:`OP_PAYLOAD`). Raises as
    :func:`decode_request_head`."""
    magic, version, flags, length = REQUEST_HEAD.unpack(head)
    if magic not in (REQUEST_MAGIC, OP_MAGIC):
        raise InvalidArgument("not a peer stream request (bad magic)", magic=bytes(magic))
    if version != STREAM_VERSION:
        raise UnsupportedVersion(
            "peer stream version not supported", version=version, supported=STREAM_VERSION
        )
    if flags != 0:
        raise InvalidArgument("peer stream request flags must be 0", flags=flags)
    if not 1 <= length <= MAX_REQUEST_BYTES:
        raise InvalidArgument(
            "peer stream request header size out of range", size=length, max=MAX_REQUEST_BYTES
        )
    return magic == OP_MAGIC, int(length)


def encode_op_request(
    request_id: int, op: str, args: dict[str, Any], client: str | None, payload_bytes: int
) -> bytes:
    """An op request's head and header; ``payload_bytes`` of payload are to follow it."""
    fields: dict[str, Any] = {"id": request_id, "op": op, "args": args}
    if client is not None:
        fields["client"] = client
    header = bytes(msgpack.packb(fields, use_bin_type=True))
    head = REQUEST_HEAD.pack(OP_MAGIC, STREAM_VERSION, 0, len(header))
    return head + OP_PAYLOAD.pack(payload_bytes) + header


def decode_op_request(header: bytes | bytearray | memoryview) -> OpRequest:
    """The op request a header holds. Raises ``InvalidArgument`` naming the field at fault
    (its ``request_id`` attribute set when the id was readable); the stream can go on once
    the payload is dropped."""
    d = _unpack_header(header, max_map_len=64)
    request_id = d.get("id")
    if type(request_id) is not int or not 0 < request_id < 1 << 63:
        raise InvalidArgument("stream op header: id must be a positive integer")
    try:
        op, args, client = d.get("op"), d.get("args"), d.get("client")
        unknown = set(d) - {"id", "op", "args", "client"}
        if unknown:
            raise InvalidArgument(f"stream op header: unknown fields {sorted(map(str, unknown))}")
        if op not in STREAM_OPS:
            raise InvalidArgument(f"stream op header: op must be one of {', '.join(STREAM_OPS)}")
        if not isinstance(args, dict):
            raise InvalidArgument("stream op header: args must be a map")
        if client is not None and not (isinstance(client, str) and 0 < len(client) <= 256):
            raise InvalidArgument("stream op header: client must be a string of 1..256 chars")
        return OpRequest(request_id, op, check_args(op, args), client)
    except InvalidArgument as exc:
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise


def encode_hello(token: str) -> bytes:
    """A connection's hello. Raises ``InvalidArgument`` for a token over 255 bytes."""
    raw = token.encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise InvalidArgument("a peer stream token is at most 255 bytes", size=len(raw))
    return HELLO_HEAD.pack(HELLO_MAGIC, STREAM_VERSION, len(raw)) + raw


def decode_hello_head(head: bytes | bytearray | memoryview) -> int:
    """The token length a hello announces. Raises ``UnsupportedVersion`` or
    ``InvalidArgument`` (the connection cannot go on after either)."""
    magic, version, length = HELLO_HEAD.unpack(head)
    if magic != HELLO_MAGIC:
        raise InvalidArgument("not a peer stream hello (bad magic)", magic=bytes(magic))
    if version != STREAM_VERSION:
        raise UnsupportedVersion(
            "peer stream version not supported", version=version, supported=STREAM_VERSION
        )
    return int(length)


def decode_token(raw: bytes | bytearray | memoryview) -> str:
    """A hello's token ("" when it is not UTF-8: no token)."""
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        return ""


def decode_request(header: bytes | bytearray | memoryview) -> FetchRequest:
    """The request a header holds. Raises ``InvalidArgument`` naming the field at fault (the
    stream can go on: the header was read whole)."""
    d = _unpack_header(header, max_map_len=16)
    request_id, ns_id, keys = d.get("id"), d.get("ns_id"), d.get("keys")
    if type(request_id) is not int or not 0 <= request_id < 1 << 63:
        raise InvalidArgument("peer stream header: id must be a non-negative integer")
    if not isinstance(ns_id, str) or not ns_id:
        raise InvalidArgument("peer stream header: ns_id must be a non-empty string")
    if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_KEYS:
        raise InvalidArgument(f"peer stream header: keys must be a list of 1..{MAX_KEYS} keys")
    for key in keys:
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(f"peer stream header: every key must be 1..{MAX_KEY_BYTES} bytes")
    return FetchRequest(request_id, ns_id, keys)


def _unpack_header(header: bytes | bytearray | memoryview, *, max_map_len: int) -> dict[Any, Any]:
    try:
        d = msgpack.unpackb(
            header, raw=False, strict_map_key=True, max_bin_len=MAX_KEY_BYTES,
            max_str_len=MAX_STR_LEN, max_array_len=MAX_KEYS, max_map_len=max_map_len,
        )  # fmt: skip
    except Exception as exc:  # msgpack raises several types for malformed input
        raise InvalidArgument(f"peer stream header is not valid msgpack: {exc}") from None
    if not isinstance(d, dict):
        raise InvalidArgument("peer stream header must be a map")
    return d


def encode_ok(request_id: int, count: int, tp: int, part_bytes: int) -> bytes:
    """The head of an ok reply; ``count x tp`` parts of ``part_bytes`` follow it."""
    return REPLY_HEAD.pack(
        REPLY_MAGIC, STREAM_VERSION, STATUS_OK, tp, request_id & 0xFFFFFFFF, count, part_bytes
    )


def encode_error(request_id: int, error: KVServerError) -> bytes:
    """A whole error reply."""
    body = bytes(msgpack.packb({"code": error.code, "message": str(error)[:MAX_STR_LEN]}))
    head = REPLY_HEAD.pack(
        REPLY_MAGIC, STREAM_VERSION, STATUS_ERROR, 0, request_id & 0xFFFFFFFF, len(body), 0
    )
    return head + body


def encode_result(request_id: int, result: dict[str, Any]) -> bytes:
    """A whole result reply (an op's result map)."""
    body = bytes(msgpack.packb(result, use_bin_type=True))
    head = REPLY_HEAD.pack(
        REPLY_MAGIC, STREAM_VERSION, STATUS_RESULT, 0, request_id & 0xFFFFFFFF, len(body), 0
    )
    return head + body


def decode_result(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A result reply's map. Raises ``InvalidArgument`` when it is not one."""
    try:
        d = msgpack.unpackb(body, raw=False, max_bin_len=MAX_KEY_BYTES, max_str_len=MAX_STR_LEN,
                            max_array_len=MAX_KEYS, max_map_len=64)  # fmt: skip
    except Exception as exc:  # msgpack raises several types for malformed input
        raise InvalidArgument(f"stream result reply is not valid msgpack: {exc}") from None
    if not isinstance(d, dict):
        raise InvalidArgument("stream result reply must be a map")
    return d


def decode_reply_head(head: bytes | bytearray | memoryview, *, results: bool = False) -> ReplyHead:
    """A reply's head (``results``: a client's, which may be a result reply). Raises
    ``InvalidArgument`` / ``UnsupportedVersion``."""
    magic, version, status, tp, request_id, count, size = REPLY_HEAD.unpack(head)
    if magic != REPLY_MAGIC:
        raise InvalidArgument("not a peer stream reply (bad magic)", magic=bytes(magic))
    if version != STREAM_VERSION:
        raise UnsupportedVersion("peer stream reply version not supported", version=version)
    if status == STATUS_RESULT and results:
        if not count <= MAX_RESULT_BYTES:
            raise InvalidArgument("stream result reply too long", size=count)
        return ReplyHead(False, 0, request_id, count, 0, result=True)
    if status not in (STATUS_OK, STATUS_ERROR):
        raise InvalidArgument("peer stream reply has an unknown status", status=status)
    if status == STATUS_ERROR and not count <= MAX_ERROR_BYTES:
        raise InvalidArgument("peer stream error reply too long", size=count)
    return ReplyHead(status == STATUS_OK, tp, request_id, count, size)


def decode_error(body: bytes | bytearray | memoryview) -> KVServerError:
    """The error an error reply carries (a generic one when its body is malformed)."""
    try:
        d: Any = msgpack.unpackb(body, raw=False, max_str_len=MAX_STR_LEN, max_map_len=4)
        return error_from_code(str(d["code"]), str(d["message"]))
    except Exception:  # a malformed error body is still an error
        return KVServerError("peer stream error reply is malformed")


#: a receiver of a stream's payload is woken when this many bytes of it are unread
#: (``SO_RCVLOWAT``), not at every segment: each wake-up costs the sending side's CPU (on
#: loopback the sender runs the receiver's TCP input, its wake-up, and the window updates each
#: read sends back). Towards the payload's end the bound shrinks (:func:`wake_at`), so that
#: what is left to copy after the last byte arrives stays under :data:`TAIL_WAKE_BYTES`.
WAKE_BYTES = 4 << 20
#: the bound below which :func:`wake_at` does not halve it.
TAIL_WAKE_BYTES = 1 << 20


def advance(views: list[memoryview], i: int, moved: int) -> int:
    """After one scattering ``sendmsg`` / ``recvmsg_into`` moved ``moved`` bytes of
    ``views[i:]``: the index of the first view not all moved, that view cut to its rest in
    place (both ends of the stream, and the client's)."""
    while i < len(views) and moved >= views[i].nbytes:
        moved -= views[i].nbytes
        i += 1
    if moved:
        views[i] = views[i][moved:]
    return i


def wake_at(left: int, wake: int) -> int:
    """The unread bytes a receive waits for when ``left`` bytes of a transfer are still to
    come and the socket's bound is ``wake`` (:data:`WAKE_BYTES`, or the kernel's cap on
    ``SO_RCVLOWAT``): ``wake``, or half of
    ``left`` once that is smaller (but not below :data:`TAIL_WAKE_BYTES`), never more than
    ``left``. A 32 MiB reply wakes the thread at most 10 times (4 MiB x 7, 2, 1, 1; a fixed
    4 MiB would leave up to 4 MiB to copy after the last byte), a 1 MiB bound 32 times."""
    return min(wake, left, max(TAIL_WAKE_BYTES, left // 2))


def check_lengths(keys: Sequence[bytes]) -> None:
    """Refuse (``InvalidArgument``) a request this format cannot carry."""
    if not 1 <= len(keys) <= MAX_KEYS:
        raise InvalidArgument(f"a peer stream request names 1..{MAX_KEYS} keys", keys=len(keys))
