"""The gRPC format of ``kvserver.v1.KVServer``: constants and protobuf conversions, defined once.

Imported by both ends — the daemon's front end (``kvserver/daemon/grpc_server.py``) and the
client (``kvserver/grpc_client.py``) — so the two cannot drift. Pure functions over the
generated messages (``kvserver/_proto``); no channel, no server, no I/O. The API itself is
described in docs/grpc.md.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import cast

import numpy

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.engine.types import CutKeys
from kvserver.errors import InvalidArgument
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
#: request metadata carrying the caller's token, ``authorization: Bearer TOKEN``: the daemon's
#: ``KVServer`` and the scheduler's ``Engine`` front door alike (docs/security.md, "Tokens").
AUTH_METADATA_KEY = "authorization"
BEARER = "Bearer "

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


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...] | None:
    """The request metadata presenting ``token``; None for no token."""
    return ((AUTH_METADATA_KEY, BEARER + token),) if token else None


def bearer_token(metadata: Sequence[tuple[str, object]] | None) -> str | None:
    """The token in a request's ``authorization: Bearer`` metadata; None when there is none."""
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY and isinstance(value, str) and value.startswith(BEARER):
            return value[len(BEARER) :]
    return None


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


def keys_to_proto(msg: pb.KeyPrefix, keys: Sequence[bytes], *, packed: bool = True) -> None:
    """Fill ``msg`` with ``keys`` in place: as ``packed_keys`` + ``key_size`` when ``packed``
    and every key has the same length (one field instead of one per key), else as ``keys``
    (where the daemon names a key of the wrong length)."""
    if packed and keys:
        size = len(keys[0])
        if size and list(map(len, keys)).count(size) == len(keys):  # in C: 2,048 keys ~25 us
            msg.packed_keys = b"".join(keys)
            msg.key_size = size
            return
    msg.keys.extend(keys)
    msg.SetInParent()


def keys_from_proto(msg: pb.KeyPrefix, key_size: int, max_keys: int) -> Sequence[bytes]:
    """The chunk keys of ``msg``: ``keys`` as sent (a list; their lengths are the caller's to
    check), or ``packed_keys`` cut into ``key_size``-byte keys (:class:`CutKeys`, which the
    engine's key check trusts). InvalidArgument when both are set,
    when ``msg.key_size`` is not ``key_size`` (the namespace's), when the packed bytes are not
    whole keys, or when either holds more than ``max_keys`` keys (refused at their count, before
    a key is copied out: 5M one-byte ``keys`` made 5M bytes objects, +296 MB, first)."""
    packed = msg.packed_keys
    if not packed and not msg.key_size:
        count = len(msg.keys)  # counted before a Python object is made of any of them
        if count > max_keys:
            raise InvalidArgument("too many keys in one request", count=count, max=max_keys)
        return list(msg.keys)
    if msg.keys:
        raise InvalidArgument("set either keys or packed_keys (with key_size), not both")
    if msg.key_size != key_size:
        raise InvalidArgument(
            f"every key must be {key_size} bytes for this namespace's hash (packed_keys "
            f"with key_size {msg.key_size})"
        )
    count, rest = divmod(len(packed), key_size)
    if rest:
        raise InvalidArgument(
            f"packed_keys is not a whole number of {key_size}-byte keys", length=len(packed)
        )
    if count > max_keys:
        raise InvalidArgument("too many keys in one request", count=count, max=max_keys)
    return CutKeys(packed, key_size)


#: one packed token id: a little-endian uint32
_PACKED_TOKEN = numpy.dtype("<u4")


def tokens_to_proto(msg: pb.TokenPrefix, token_ids: Sequence[int], *, packed: bool) -> None:
    """Fill ``msg.token_ids`` (``packed``: ``msg.packed_token_ids``) in place with
    ``token_ids``. Packed, a numpy array of little-endian uint32 is taken as it is and anything
    else goes through ``array("I")`` (32k ids: ~0.2 ms, where ``extend`` of the repeated field
    takes ~0.5 ms and then writes a varint per id); InvalidArgument for an id that is not an
    int in [0, 2**32)."""
    ids: object = token_ids
    if not packed:
        msg.token_ids.extend(token_ids)
    elif isinstance(ids, numpy.ndarray) and ids.dtype == _PACKED_TOKEN and ids.ndim == 1:
        msg.packed_token_ids = ids.tobytes()
    else:
        try:
            words = array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise InvalidArgument(f"token ids must be ints in [0, 2**32): {exc}") from None
        if sys.byteorder == "big":
            words.byteswap()
        msg.packed_token_ids = words.tobytes()
    msg.SetInParent()


def token_ids_from_proto(msg: pb.TokenPrefix) -> Sequence[int]:
    """The token ids of ``msg`` as one uint32 numpy array (the hasher takes it in bulk, with
    no check per id): ``token_ids`` exported by protobuf in bulk, or ``packed_token_ids``
    viewed in place. InvalidArgument when both are set or the packed bytes are not whole ids."""
    packed = msg.packed_token_ids
    if packed:
        if msg.token_ids:
            raise InvalidArgument("set either token_ids or packed_token_ids, not both")
        if len(packed) % _PACKED_TOKEN.itemsize:
            raise InvalidArgument(
                "packed_token_ids is not a whole number of 4-byte ids", length=len(packed)
            )
        ids = numpy.frombuffer(packed, dtype=_PACKED_TOKEN).astype(numpy.uint32, copy=False)
    else:
        # protobuf hands a repeated uint32 field to numpy in bulk (32k ids: 5 us instead of
        # 0.9 ms for a tuple of ints)
        ids = numpy.asarray(msg.token_ids, dtype=numpy.uint32)
    return cast("Sequence[int]", ids)
