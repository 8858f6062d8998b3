"""The ZMQ wire protocol's vocabulary: version, capabilities, limits, ops and their argument
schemas, and the validated header types. Part of the format module :mod:`kvserver.wire`, which
re-exports every public name here (import them from there).

Runs in the daemon and in every client process. Pure constants and frozen value types: no I/O,
no state, thread-safe. Every limit and op name of the data plane lives here, in one place;
``docs/wire.md`` describes them for humans. The checks that apply the schemas to untrusted
input are in :mod:`kvserver.wire_requests`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserver.errors import KVServerError

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
#: "packed_load_grant": ``prepare_load`` takes ``packed``, and its grant then comes packed
#: (``kvserver.grants.packed_load_grant_to_wire``; docs/wire.md §2).
CAP_PACKED_LOAD_GRANT = "packed_load_grant"
#: the stream port (docs/wire.md §6) takes clients' put and get (op requests).
CAP_STREAM_OPS = "stream_ops"
CAPABILITIES = (
    CAP_STORE_COMPLETIONS, CAP_PACKED_STORE_GRANT, CAP_PACKED_TOKEN_IDS, CAP_PACKED_LOAD_GRANT,
    CAP_STREAM_OPS,
)  # fmt: skip
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
#: most frames of one request: a header plus one payload frame per part of the largest request
#: (2^21 parts; the local channel's framing has the same bound, ``kvserver/wire_local.py``).
MAX_FRAMES = (1 << 21) + 1
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
    # (capability "packed_load_grant")
    PREPARE_LOAD: "ns_id:str keys:keys lease_s:float? packed:bool?",
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
