"""The ZMQ wire format: data-plane messages and KV events. Shared by the daemon and clients.

Runs in the daemon (``kvserver/daemon/zmq_server.py``) and in every client process
(``kvserver/client``). Pure constants and functions: no sockets, no state, thread-safe.
The format is described for humans in ``docs/wire.md``; every constant lives here.

Data plane (daemon ROUTER, clients DEALER). A message is ``[header, payload*]``::

    request  {"v": 1, "id": int, "op": str, "args": map, "auth"?: str, "client"?: str}
    reply    {"v": 1, "id": int, "sid": str, "ok": true,  "result": map}
             {"v": 1, "id": int, "sid": str, "ok": false, "error": {"code": str, "message": str}}

Call order on the receiving side: :func:`peek_auth` when the daemon requires a token (reads
the header's top-level keys only, skipping every other value without decoding it, so that an
unauthenticated request costs next to nothing whatever it carries) → :func:`unpack_header` →
:func:`request_id_of` (so even a request that fails validation is answered with its id, or 0)
→ :func:`parse_request`, which
type-checks the envelope and the op's arguments against :data:`OPS`. Everything that comes off
a socket is untrusted: each failure raises :class:`~kvserver.errors.InvalidArgument` (or
:class:`~kvserver.errors.UnsupportedVersion`) with a message that names the field.

Events (daemon PUB) use vLLM's KV-event format: ``[topic, seq (8-byte big-endian), payload]``;
the framing is here, the ``KVEventBatch`` payload in :mod:`kvserver.wire_events`.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvserver.errors import InvalidArgument, KVServerError, UnsupportedVersion, error_from_code
from kvserver.prompts import is_packed

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
#: additions to version 1 a daemon announces in ``hello``'s ``capabilities``; a client uses
#: one only against a daemon that announced it (an older daemon refuses the unknown argument).
#: "store_completions": ``prepare_store`` takes ``completions`` (docs/wire.md §2).
CAP_STORE_COMPLETIONS = "store_completions"
#: "packed_store_grant": ``prepare_store`` takes ``packed``, and its grant then comes packed
#: (``kvserver.grants.packed_store_grant_to_wire``; docs/wire.md §2).
CAP_PACKED_STORE_GRANT = "packed_store_grant"
#: "packed_token_ids": ``lookup_tokens`` takes ``token_ids`` packed (one bin of little-endian
#: u32 ids, ``kvserver/prompts.py``) as well as a list (docs/wire.md §2).
CAP_PACKED_TOKEN_IDS = "packed_token_ids"
CAPABILITIES = (CAP_STORE_COMPLETIONS, CAP_PACKED_STORE_GRANT, CAP_PACKED_TOKEN_IDS)
#: most completions one ``prepare_store`` may carry.
MAX_COMPLETIONS = 4096

#: largest header frame accepted (a 2M-token lookup_tokens is ~10 MB of msgpack).
MAX_HEADER_BYTES = 16 << 20
#: longest list in a header (as many keys as a request may carry). Longer ones are refused at
#: their array header, before an item is decoded: a prompt's token ids past it go packed.
MAX_ARRAY_LEN = 1 << 16
#: longest list in a reply (a get's part_frames: one per part, keys x ranks), and largest
#: map (``stats``' per-namespace rows: a map over 64 entries made every client's ``stats``
#: undecodable once 65 namespaces were registered).
MAX_REPLY_ARRAY_LEN = 1 << 21
MAX_MAP_LEN = 64
MAX_STR_LEN = 1 << 16
#: longest chunk key accepted on the wire (the engine checks the exact size per namespace).
MAX_KEY_BYTES = 64
MAX_INT = (1 << 63) - 1
MAX_CLIENT_ID_LEN = 256

# ----------------------------------------------------------------------------- ops

HELLO = "hello"
REGISTER_NAMESPACE = "register_namespace"
NAMESPACES = "namespaces"
LOOKUP = "lookup"
LOOKUP_TOKENS = "lookup_tokens"
TOUCH = "touch"
PREPARE_STORE = "prepare_store"
COMPLETE_STORE = "complete_store"
PREPARE_LOAD = "prepare_load"
COMPLETE_LOAD = "complete_load"
PUT = "put"
GET = "get"
WRITE_PARTS = "write_parts"
READ_PARTS = "read_parts"
PIN = "pin"
UNPIN = "unpin"
STATS = "stats"
RELEASE = "release"

# Argument schema of every op: "name:kind" is required, "name:kind?" optional (nil = absent).
_SCHEMAS = {
    HELLO: "",
    REGISTER_NAMESPACE: "spec:map",
    NAMESPACES: "",
    # local: this daemon's own tiers only, never its peers (a peer's question)
    LOOKUP: "ns_id:str keys:keys record:bool? touch:bool? local:bool?",
    LOOKUP_TOKENS: "ns_id:str token_ids:token_ids cache_salt:str? lora:str_pair?",
    TOUCH: "ns_id:str keys:keys",
    # completions: [[lease_id, success, ranks|nil, keys|nil], ...] applied first, each as a
    # complete_store (capability "store_completions"); packed: the grant in the packed form
    # (capability "packed_store_grant")
    PREPARE_STORE: "ns_id:str keys:keys lease_s:float? completions:completions? packed:bool?",
    COMPLETE_STORE: "lease_id:int success:bool? ranks:ints? keys:keys?",
    PREPARE_LOAD: "ns_id:str keys:keys lease_s:float?",
    COMPLETE_LOAD: "lease_id:int",
    # payload: len(keys) x tp_world_size frames, key-major (key 0 rank 0, key 0 rank 1, ...)
    PUT: "ns_id:str keys:keys lease_s:float?",
    # reply payload: len(keys) x len(ranks) parts, key-major ("part_frames" if split);
    # leading: only the leading run of keys this daemon holds in its own tiers (a peer's
    # fetch: never fetched from its peers in turn), the reply's "keys" say which
    GET: "ns_id:str keys:keys ranks:ints? leading:bool?",
    # payload: one frame per key, this rank's part
    WRITE_PARTS: "lease_id:int keys:keys rank:int complete:bool?",
    # reply payload: one part per key, as GET
    READ_PARTS: "ns_id:str lease_id:int keys:keys rank:int",
    PIN: "ns_id:str keys:keys ttl_s:float",
    UNPIN: "ns_id:str keys:keys",
    STATS: "",
    RELEASE: "",
}

#: op -> {argument: (kind, required)}
OPS: dict[str, dict[str, tuple[str, bool]]] = {
    op: {
        name: (kind.rstrip("?"), not kind.endswith("?"))
        for name, kind in (field.split(":") for field in text.split())
    }
    for op, text in _SCHEMAS.items()
}

#: ops whose request carries payload frames; every other op must carry none.
OPS_WITH_PAYLOAD = frozenset({PUT, WRITE_PARTS})

_ENVELOPE = frozenset({"v", "id", "op", "args", "auth", "client"})

_KIND_TEXT = {
    "str": "a string",
    "int": f"an integer in 0..{MAX_INT}",
    "float": "a finite number",
    "bool": "a boolean",
    "map": "a map",
    "keys": f"a list of byte strings (bin, <= {MAX_KEY_BYTES} bytes each)",
    "ints": f"a list of integers in 0..{MAX_INT}",
    "token_ids": (
        f"a list of at most {MAX_ARRAY_LEN} integers in 0..{MAX_INT}, or packed: a bin of "
        "little-endian u32 ids (capability packed_token_ids)"
    ),
    "str_pair": "a list of two strings",
    "completions": (
        f"a list of at most {MAX_COMPLETIONS} [lease_id: int, success: bool, ranks: [int] or"
        " nil, keys: [bin] or nil]"
    ),
}

# ----------------------------------------------------------------------------- replay / events

#: vLLM's replay protocol: request [b"", start_seq]; replies [b"", seq, payload] then END.
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEQ_BYTES = 8
TOPIC_PREFIX = "kv@"

LOOKUP_FIELDS = ("hit_chunks", "hit_tokens", "num_chunks", "tiers")


def host_id() -> str:
    """Identifies this host (and boot): a client with the daemon's id may map its arena."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True, slots=True)
class Request:
    """A validated request header. ``args`` holds every schema field (None when absent)."""

    req_id: int
    op: str
    args: dict[str, Any]
    auth: str | None = None
    client: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """A validated reply header; ``error`` is set when ``ok`` is false."""

    req_id: int
    sid: str
    ok: bool
    result: dict[str, Any]
    error: KVServerError | None = None


# ----------------------------------------------------------------------------- requests


def unpack_header(
    frame: bytes | memoryview, max_array_len: int = MAX_ARRAY_LEN, max_map_len: int = MAX_MAP_LEN
) -> Any:
    """Decode one untrusted msgpack frame with strict limits (a request's lists: at most
    :data:`MAX_ARRAY_LEN` items, its maps :data:`MAX_MAP_LEN`; a reply's lists and maps:
    ``MAX_REPLY_ARRAY_LEN``). Raises InvalidArgument."""
    size = memoryview(frame).nbytes
    if size == 0:
        raise InvalidArgument("empty header frame")
    if size > MAX_HEADER_BYTES:
        raise InvalidArgument("header frame too large", size=size, max=MAX_HEADER_BYTES)
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_LEN,
            max_bin_len=size,
            max_array_len=max_array_len,
            max_map_len=max_map_len,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        if isinstance(exc, ValueError) and "max_array_len" in str(exc):
            raise InvalidArgument(
                f"a header list has more than {max_array_len} items (a longer prompt's "
                "token_ids go packed: capability packed_token_ids, docs/wire.md)"
            ) from None
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise InvalidArgument(f"malformed msgpack header ({detail})") from None


class _Chunks:
    """A file-like view of a frame for msgpack.Unpacker: it copies only what it is asked for."""

    def __init__(self, frame: bytes | memoryview) -> None:
        self._view = memoryview(frame).cast("B")
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = self._view.nbytes if n < 0 else self._pos + n
        out = bytes(self._view[self._pos : end])
        self._pos += len(out)
        return out


def peek_auth(frame: bytes | memoryview) -> tuple[str | None, int]:
    """The ``auth`` field and request id (0 if none) of an undecoded request header, read at a
    cost that does not depend on what else the header carries: the top-level fields are read
    in order up to ``auth``; only ``v``, ``id`` and ``op`` may come before it, and only with
    scalar values (clients send ``auth`` first: :func:`encode_request`); at anything else (a
    container, ``args``) it stops and the header has no ``auth``. After ``auth`` the scalar
    ``v``, ``id`` and ``op`` that follow it are read too, for the id (an error reply to a header
    that is then refused undecoded carries it). Raises InvalidArgument for a frame that does
    not start as a msgpack map of string keys."""
    view = memoryview(frame).cast("B")
    size = view.nbytes
    if size == 0:
        raise InvalidArgument("empty header frame")
    if size > MAX_HEADER_BYTES:
        raise InvalidArgument("header frame too large", size=size, max=MAX_HEADER_BYTES)
    unpacker = msgpack.Unpacker(
        _Chunks(view),
        read_size=min(size, 256),
        raw=False,
        max_buffer_size=size,
        max_str_len=MAX_STR_LEN,
        max_bin_len=MAX_STR_LEN,
        max_array_len=0,
        max_map_len=MAX_MAP_LEN,
        max_ext_len=0,
    )
    req_id = 0
    auth: Any = None
    found = False
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            pos = unpacker.tell()
            if pos >= size or view[pos] in _CONTAINER_BYTES:
                break
            if key == "auth" and not found:
                auth, found = unpacker.unpack(), True
                continue
            if key not in ("v", "id", "op"):
                break
            value = unpacker.unpack()
            if key == "id" and type(value) is int and 0 < value <= MAX_INT:
                req_id = value
    except (
        ValueError, TypeError, OverflowError, RecursionError, msgpack.OutOfData,
        msgpack.BufferFull,  # a truncated map16/map32 header (b"\xde")
    ) as exc:  # fmt: skip
        if not found:
            raise InvalidArgument(f"malformed msgpack header ({type(exc).__name__})") from None
    return (auth if isinstance(auth, str) else None), req_id


#: first bytes of msgpack maps and arrays (fixmap, fixarray, array16/32, map16/32).
_CONTAINER_BYTES = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])


def request_id_of(obj: Any) -> int:
    """The request id of a decoded header if it has a valid one, else 0 (for error replies)."""
    if isinstance(obj, dict):
        rid = obj.get("id")
        if type(rid) is int and 0 < rid <= MAX_INT:
            return rid
    return 0


def parse_request(obj: Any) -> Request:
    """Validate a decoded request header: version first, then envelope, then the op's args."""
    if not isinstance(obj, dict):
        raise InvalidArgument("header must be a msgpack map")
    version = obj.get("v")
    if type(version) is not int:
        raise InvalidArgument("header field 'v' (protocol version) must be an integer")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"protocol version {version} is not supported", supported=list(SUPPORTED_VERSIONS)
        )
    unknown = set(obj) - _ENVELOPE
    if unknown:
        raise InvalidArgument(f"unknown header fields: {', '.join(sorted(map(str, unknown)))}")
    rid = request_id_of(obj)
    if rid == 0:
        raise InvalidArgument(f"header field 'id' must be an integer in 1..{MAX_INT}")
    op = obj.get("op")
    if not isinstance(op, str):
        raise InvalidArgument("header field 'op' must be a string")
    if op not in OPS:
        raise InvalidArgument(f"unknown op {op[:64]!r}; valid: {', '.join(OPS)}")
    auth = _opt_str(obj, "auth", MAX_STR_LEN)
    client = _opt_str(obj, "client", MAX_CLIENT_ID_LEN)
    if client == "":
        raise InvalidArgument("header field 'client' must not be empty")
    args = obj.get("args")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidArgument("header field 'args' must be a map")
    return Request(rid, op, check_args(op, args), auth, client)


def check_args(op: str, args: dict[str, Any]) -> dict[str, Any]:
    """Type-check ``args`` against ``OPS[op]``; returns every field (None where absent)."""
    schema = OPS[op]
    unknown = set(args) - set(schema)
    if unknown:
        raise InvalidArgument(f"unknown arguments for {op}: {', '.join(sorted(map(str, unknown)))}")
    out: dict[str, Any] = {}
    for name, (kind, required) in schema.items():
        value = args.get(name)
        if value is None:
            if required:
                raise InvalidArgument(f"{op}: missing required argument {name!r}")
        elif not _check_value(kind, value):
            raise InvalidArgument(f"{op}: argument {name!r} must be {_KIND_TEXT[kind]}")
        out[name] = value
    return out


def _is_uint(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_INT


def _check_value(kind: str, value: Any) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return _is_uint(value)
    if kind == "float":
        return type(value) in (int, float) and math.isfinite(value)
    if kind == "bool":
        return type(value) is bool
    if kind == "map":
        return isinstance(value, dict)
    if kind == "keys":  # without a Python loop: requests carry hundreds of keys
        return isinstance(value, list) and (
            not value
            or (set(map(type, value)) == {bytes} and max(map(len, value)) <= MAX_KEY_BYTES)
        )
    if kind == "ints":  # without a Python loop either: lookup_tokens carries 1M token ids
        return isinstance(value, list) and (
            not value
            or (set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= MAX_INT)
        )
    if kind == "token_ids":
        return _check_value("ints", value) or (isinstance(value, bytes) and is_packed(value))
    if kind == "str_pair":
        return isinstance(value, list) and len(value) == 2 and all(type(v) is str for v in value)
    if kind == "completions":
        return (
            isinstance(value, list)
            and len(value) <= MAX_COMPLETIONS
            and all(_is_completion(c) for c in value)
        )
    raise AssertionError(f"unknown argument kind {kind}")


def _is_completion(c: Any) -> bool:
    return (
        isinstance(c, list)
        and len(c) == 4
        and _is_uint(c[0])
        and type(c[1]) is bool
        and (c[2] is None or _check_value("ints", c[2]))
        and (c[3] is None or _check_value("keys", c[3]))
    )


def _opt_str(obj: dict[str, Any], name: str, max_len: int) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise InvalidArgument(f"header field {name!r} must be a string of <= {max_len} chars")
    return value


def encode_request(
    req_id: int,
    op: str,
    args: Mapping[str, Any],
    *,
    auth: str | None = None,
    client: str | None = None,
) -> bytes:
    """Encode a request header (the client side; arguments that are None are omitted). ``auth``
    goes first, so that the daemon's :func:`peek_auth` reads a few bytes only."""
    header: dict[str, Any] = {"auth": auth} if auth else {}
    header |= {"v": PROTOCOL_VERSION, "id": req_id, "op": op}
    header["args"] = {k: v for k, v in args.items() if v is not None}
    if client is not None:
        header["client"] = client
    return _pack(header)


# ----------------------------------------------------------------------------- replies


def encode_reply(req_id: int, sid: str, result: Mapping[str, Any]) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "id": req_id, "sid": sid, "ok": True, "result": result})


def encode_error(req_id: int, sid: str, code: str, message: str) -> bytes:
    error = {"code": code, "message": message}
    return _pack({"v": PROTOCOL_VERSION, "id": req_id, "sid": sid, "ok": False, "error": error})


def decode_reply(frame: bytes | memoryview) -> Reply:
    """Validate a reply header (the client side). Raises InvalidArgument if malformed."""
    obj = unpack_header(frame, MAX_REPLY_ARRAY_LEN, MAX_REPLY_ARRAY_LEN)
    if not isinstance(obj, dict) or obj.get("v") != PROTOCOL_VERSION:
        raise InvalidArgument("reply is not a version-1 header map")
    rid, sid, ok = obj.get("id"), obj.get("sid"), obj.get("ok")
    if type(rid) is not int or not isinstance(sid, str) or type(ok) is not bool:
        raise InvalidArgument("reply header lacks id/sid/ok")
    if ok:
        result = obj.get("result")
        if not isinstance(result, dict):
            raise InvalidArgument("reply result must be a map")
        return Reply(rid, sid, True, result)
    err = obj.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    if not isinstance(code, str) or not isinstance(message, str):
        raise InvalidArgument("error reply lacks code/message")
    return Reply(rid, sid, False, {}, error_from_code(code, message))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- events


def seq_bytes(seq: int) -> bytes:
    """A sequence number as vLLM frames it: 8 bytes, big-endian."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def event_topic(pod: str, model: str) -> bytes:
    """PUB topic ``kv@<pod>@<model>`` (llm-d's convention; ``pod`` names the cache location)."""
    return f"{TOPIC_PREFIX}{pod}@{model}".encode()
