"""KV events on the wire: vLLM's ``KVEventBatch`` as msgspec structs. Shared by the daemon
(``kvserver/daemon/zmq_events.py`` encodes) and subscribers (tests, indexers in Python decode).

Pure structs and functions: no sockets, no state, thread-safe. Framing (topic, 8-byte seq,
replay protocol) is in :mod:`kvserver.wire`; the format is described in ``docs/wire.md`` §5.

The payload is exactly what ``msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.
KVEventBatch)`` accepts (vLLM 0.32, 0.33; the tests decode with vLLM's own classes):

* the batch is array-like, ``[ts, [event, ...]]`` (``data_parallel_rank`` omitted: default);
* each event is a **map** tagged by its class name, ``{"type": "BlockStored", ...}``, with
  every field vLLM declares without a default present (``None`` where the daemon has no
  value) and the defaulted ones omitted, as vLLM's own encoder (``omit_defaults``) does;
* ``medium`` is :class:`~kvserver.events.Medium` (``"CPU"``, ``"STORAGE"``) as a string.

msgspec rather than hand-built msgpack arrays: the structs *are* the schema (field order,
tags, defaults, omissions follow from them as they do for vLLM), and decoding validates.
"""

from __future__ import annotations

import msgspec

from kvserver.errors import InvalidArgument
from kvserver.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium

#: a block hash as vLLM publishes it (``ExternalBlockHash``): our chunk keys are bytes.
BlockHash = bytes | int


class KVEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the tagged events (the tag is the class name, as vLLM's ``KVCacheEvent``)."""


class StoredEvent(KVEvent, tag="BlockStored"):
    """Chunks became readable in ``medium``. The daemon knows keys, not tokens: ``token_ids``
    is empty and ``parent_block_hash`` / ``lora_*`` are None; ``block_size`` is the chunk's
    token count (one of our keys covers a chunk)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: Medium | None
    lora_name: str | None


class RemovedEvent(KVEvent, tag="BlockRemoved"):
    """Chunks left ``medium`` (evicted, discarded, rolled back)."""

    block_hashes: list[BlockHash]
    medium: Medium | None


class ClearedEvent(KVEvent, tag="AllBlocksCleared"):
    """Every chunk left (the publisher's whole cache was reset)."""


WireEvent = StoredEvent | RemovedEvent | ClearedEvent


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One PUB payload: ``[ts, events]``; ``data_parallel_rank`` is never set by the daemon."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def to_wire(event: Event, block_size: int) -> WireEvent:
    """The wire struct of one engine event; ``block_size`` is its namespace's chunk tokens."""
    if isinstance(event, BlockStored):
        return StoredEvent(list(event.keys), None, [], block_size, None, event.medium, None)
    if isinstance(event, BlockRemoved):
        return RemovedEvent(list(event.keys), event.medium)
    if isinstance(event, AllBlocksCleared):
        return ClearedEvent()
    raise AssertionError(f"unknown event {event!r}")


def encode_batch(ts: float, events: list[WireEvent]) -> bytes:
    """A ``KVEventBatch`` payload stamped ``ts``."""
    return _ENCODER.encode(KVEventBatch(ts, events))


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode a payload (subscribers, tests). Raises InvalidArgument if it is not a batch."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidArgument(f"not a KVEventBatch: {exc}") from None
