"""The gRPC format of ``kvserver.v1.KVServer``: constants and protobuf conversions, defined once.

Imported by both ends — the daemon's front end (``kvserver/daemon/grpc_server.py``) and the
client (``kvserver/grpc_client.py``) — so the two cannot drift. Pure functions over the
generated messages (``kvserver/_proto``); no channel, no server, no I/O. The API itself is
described in docs/grpc.md.
"""

from __future__ import annotations

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium
from kvserver.namespace import NamespaceSpec

SERVICE_NAME = "kvserver.v1.KVServer"
#: trailing metadata: the kvserver error code of a failed call.
ERROR_CODE_KEY = "kvserver-error-code"
#: trailing metadata of an OUT_OF_RANGE WatchEvents: the oldest seq still available.
OLDEST_SEQ_KEY = "kvserver-oldest-seq"
EVENTS_DROPPED_CODE = "events_dropped"
#: initial metadata of WatchEvents: the daemon's event log id and the first seq it will send.
LOG_ID_KEY = "kvserver-log-id"
FROM_SEQ_KEY = "kvserver-from-seq"
#: largest message either side accepts (a 2M-token Lookup fits).
MAX_MESSAGE_BYTES = 16 << 20

_SPEC_REQUIRED = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size")
_SPEC_OPTIONAL = (
    "chunk_blocks",
    "hash_algo",
    "hash_seed",
    "tp_world_size",
    "kv_factor",
    "part_bytes_override",
)
#: event medium ↔ the proto's ``Medium``
MEDIUM_TO_PROTO: dict[Medium, pb.Medium] = {
    Medium.CPU: pb.MEDIUM_CPU,
    Medium.STORAGE: pb.MEDIUM_STORAGE,
}
MEDIUM_FROM_PROTO: dict[int, Medium] = {v: k for k, v in MEDIUM_TO_PROTO.items()}


def spec_to_proto(spec: NamespaceSpec) -> pb.NamespaceSpec:
    """A fully populated ``kvserver.v1.NamespaceSpec``."""
    values = {name: getattr(spec, name) for name in (*_SPEC_REQUIRED, *_SPEC_OPTIONAL)}
    return pb.NamespaceSpec(label=spec.label, **values)


def spec_from_proto(msg: pb.NamespaceSpec) -> NamespaceSpec:
    """Validated spec; unset optional fields take NamespaceSpec's defaults (InvalidArgument)."""
    values = {name: getattr(msg, name) for name in _SPEC_REQUIRED}
    values.update({name: getattr(msg, name) for name in _SPEC_OPTIONAL if msg.HasField(name)})
    values["label"] = msg.label
    return NamespaceSpec.from_dict(values)


def namespace_to_proto(spec: NamespaceSpec) -> pb.Namespace:
    """``kvserver.v1.Namespace``; ValueError if a value exceeds the proto's integer types."""
    return pb.Namespace(
        namespace_id=spec.ns_id,
        spec=spec_to_proto(spec),
        part_bytes=spec.part_bytes,
        key_size=spec.key_size,
        chunk_tokens=spec.chunk_tokens,
    )


def event_to_proto(event: Event, log_id: str) -> pb.Event:
    """The ``kvserver.v1.Event`` of one event of the daemon's log ``log_id``."""
    msg = pb.Event(
        seq=event.seq,
        log_id=log_id,
        namespace_id=event.ns_id,
        medium=MEDIUM_TO_PROTO.get(event.medium, pb.MEDIUM_UNSPECIFIED),
    )
    if event.type == "BlockStored":
        msg.block_stored.keys.extend(event.keys)
    elif event.type == "BlockRemoved":
        msg.block_removed.keys.extend(event.keys)
    else:
        msg.all_blocks_cleared.SetInParent()
    return msg


def event_from_proto(msg: pb.Event) -> Event:
    """The :mod:`kvserver.events` value of a ``kvserver.v1.Event``."""
    medium = MEDIUM_FROM_PROTO.get(msg.medium, Medium.CPU)
    kind = msg.WhichOneof("kind")
    if kind == "block_stored":
        return BlockStored(msg.seq, msg.namespace_id, tuple(msg.block_stored.keys), medium)
    if kind == "block_removed":
        return BlockRemoved(msg.seq, msg.namespace_id, tuple(msg.block_removed.keys), medium)
    return AllBlocksCleared(msg.seq, msg.namespace_id, medium)
