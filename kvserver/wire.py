"""The ZMQ wire format: data-plane messages and KV events. Shared by the daemon and clients.

Runs in the daemon (``kvserver/daemon/zmq_server.py``) and in every client process
(``kvserver/client``). Pure constants and functions: no sockets, no state, thread-safe.
The format is described for humans in ``docs/wire.md``. One format in three modules, by concept;
every public name of the other two is re-exported here, so both ends import ``kvserver.wire``:

- :mod:`kvserver.wire_schema`: the vocabulary: version, capabilities, limits, op names and
  their argument schemas (:data:`OPS`), the validated :class:`Request` / :class:`Reply`;
- :mod:`kvserver.wire_requests`: decoding and validating an untrusted request header (the call
  order on the receiving side: :func:`peek_auth` → :func:`unpack_header` →
  :func:`request_id_of` → :func:`parse_request`; every failure is an
  :class:`~kvserver.errors.InvalidArgument` naming the field, or
  :class:`~kvserver.errors.UnsupportedVersion`);
- here: encoding requests and replies, decoding a reply (the client side), the KV events'
  framing, and :func:`host_id`.

Data plane (daemon ROUTER, clients DEALER). A message is ``[header, payload*]``::

    request  {"v": 1, "id": int, "op": str, "args": map, "auth"?: str, "client"?: str}
    reply    {"v": 1, "id": int, "sid": str, "ok": true,  "result": map}
             {"v": 1, "id": int, "sid": str, "ok": false, "error": {"code": str, "message": str}}

Events (daemon PUB) use vLLM's KV-event format: ``[topic, seq (8-byte big-endian), payload]``;
the framing is here, the ``KVEventBatch`` payload in :mod:`kvserver.wire_events`.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import msgpack

from kvserver.errors import InvalidArgument, error_from_code
from kvserver.wire_requests import (
    check_args,
    parse_request,
    peek_auth,
    peek_op,
    request_id_of,
    unpack_header,
)
from kvserver.wire_schema import (
    CAP_PACKED_LOAD_GRANT,
    CAP_PACKED_STORE_GRANT,
    CAP_PACKED_TOKEN_IDS,
    CAP_STORE_COMPLETIONS,
    CAP_STREAM_OPS,
    CAPABILITIES,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    GET,
    HELLO,
    LOOKUP,
    LOOKUP_TOKENS,
    MAX_ARRAY_LEN,
    MAX_CLIENT_ID_LEN,
    MAX_COMPLETIONS,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    MAX_INT,
    MAX_KEY_BYTES,
    MAX_MAP_LEN,
    MAX_REPLY_ARRAY_LEN,
    MAX_STR_LEN,
    NAMESPACES,
    OPS,
    OPS_WITH_PAYLOAD,
    PIN,
    PREPARE_LOAD,
    PREPARE_STORE,
    PROTOCOL_VERSION,
    PUT,
    READ_PARTS,
    REGISTER_NAMESPACE,
    RELEASE,
    STATS,
    SUPPORTED_VERSIONS,
    TOUCH,
    UNPIN,
    WRITE_PARTS,
    Reply,
    Request,
)

#: the format's public names: the other two modules' are re-exported, so that both ends
#: import ``kvserver.wire`` only.
__all__ = [
    "CAPABILITIES",
    "CAP_PACKED_LOAD_GRANT",
    "CAP_PACKED_STORE_GRANT",
    "CAP_PACKED_TOKEN_IDS",
    "CAP_STORE_COMPLETIONS",
    "CAP_STREAM_OPS",
    "COMPLETE_LOAD",
    "COMPLETE_STORE",
    "GET",
    "HELLO",
    "LOOKUP",
    "LOOKUP_FIELDS",
    "LOOKUP_TOKENS",
    "MAX_ARRAY_LEN",
    "MAX_CLIENT_ID_LEN",
    "MAX_COMPLETIONS",
    "MAX_FRAMES",
    "MAX_HEADER_BYTES",
    "MAX_INT",
    "MAX_KEY_BYTES",
    "MAX_MAP_LEN",
    "MAX_REPLY_ARRAY_LEN",
    "MAX_STR_LEN",
    "NAMESPACES",
    "OPS",
    "OPS_WITH_PAYLOAD",
    "PIN",
    "PREPARE_LOAD",
    "PREPARE_STORE",
    "PROTOCOL_VERSION",
    "PUT",
    "READ_PARTS",
    "REGISTER_NAMESPACE",
    "RELEASE",
    "REPLAY_END_SEQ",
    "SEQ_BYTES",
    "STATS",
    "SUPPORTED_VERSIONS",
    "TOPIC_PREFIX",
    "TOUCH",
    "UNPIN",
    "WRITE_PARTS",
    "Reply",
    "Request",
    "check_args",
    "decode_reply",
    "encode_error",
    "encode_reply",
    "encode_request",
    "event_topic",
    "host_id",
    "parse_request",
    "peek_auth",
    "peek_op",
    "request_id_of",
    "seq_bytes",
    "unpack_header",
]

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
