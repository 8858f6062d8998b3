"""Tests of kvserver.wire_events without vLLM: the KVEventBatch shape, byte for byte.

vLLM's own decoder accepting these payloads is tested in tests/vllm_plugin/test_kv_events.py;
these hold the shape where vLLM is not installed: an array-like batch of tagged maps.
"""

from __future__ import annotations

import msgpack
import pytest

from kvserver import wire_events
from kvserver.errors import InvalidArgument
from kvserver.events import AllBlocksCleared, BlockRemoved, BlockStored, Medium

KEYS = (b"k" * 32, b"j" * 32)


def test_a_batch_is_an_array_of_ts_and_tagged_maps() -> None:
    events = [
        wire_events.to_wire(BlockStored(1, "ns", KEYS, Medium.CPU), 32),
        wire_events.to_wire(BlockRemoved(2, "ns", KEYS[:1], Medium.STORAGE), 32),
        wire_events.to_wire(AllBlocksCleared(3, "ns", Medium.CPU), 32),
    ]
    raw = msgpack.unpackb(wire_events.encode_batch(12.5, events))
    assert raw == [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": list(KEYS),
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 32,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [KEYS[0]], "medium": "STORAGE"},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]


def test_decode_returns_what_was_encoded() -> None:
    stored = wire_events.to_wire(BlockStored(1, "ns", KEYS, Medium.STORAGE), 16)
    batch = wire_events.decode_batch(wire_events.encode_batch(1.25, [stored]))
    assert batch.ts == 1.25 and batch.events == [stored]
    assert isinstance(batch.events[0], wire_events.StoredEvent)
    assert batch.events[0].medium is Medium.STORAGE


def test_mediums_are_vllms_names() -> None:
    assert [m.value for m in Medium] == ["CPU", "STORAGE"]


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, [1]]),
        msgpack.packb(["x", []]),
        msgpack.packb([1.0, [["BlockStored", [b"k"], None, [], 16, None, "CPU", None]]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [b"k"], "medium": "X"}]]),
        b"\xc1",
    ],
)
def test_decode_rejects_what_is_not_a_batch(payload: bytes) -> None:
    with pytest.raises(InvalidArgument, match="not a KVEventBatch"):
        wire_events.decode_batch(payload)
