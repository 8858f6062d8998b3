"""Storage events: what external indexers (routers, llm-d, Dynamo) need to mirror the cache.

Shapes follow vLLM's KV-event vocabulary (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``) with the storage ``medium`` named as vLLM names it (:class:`Medium`).
Events are batched: one event per namespace per operation, carrying every affected key.
The engine numbers events with a gap-free sequence so subscribers can resume.
How they are published: ``kvserver/wire_events.py`` (the vLLM ``KVEventBatch`` encoding).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


class Medium(enum.StrEnum):
    """Where a chunk is stored, in vLLM's vocabulary (``vllm.distributed.kv_events.MEDIUM_*``).

    A closed enumeration: each tier of the daemon maps to exactly one member, and a new tier
    adds a member here (the gRPC ``Medium`` enum and docs/wire.md follow).
    """

    CPU = "CPU"  # the DRAM tier (the shared-memory arena)
    STORAGE = "STORAGE"  # the SSD tier (vLLM's name for its storage offloading tiers)


MEDIUM_DRAM = Medium.CPU
MEDIUM_SSD = Medium.STORAGE


@dataclass(frozen=True, slots=True)
class BlockStored:
    seq: int
    ns_id: str
    keys: tuple[bytes, ...]
    medium: Medium
    type: Literal["BlockStored"] = "BlockStored"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    seq: int
    ns_id: str
    keys: tuple[bytes, ...]
    medium: Medium
    type: Literal["BlockRemoved"] = "BlockRemoved"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    seq: int
    ns_id: str
    medium: Medium
    type: Literal["AllBlocksCleared"] = "AllBlocksCleared"


Event = BlockStored | BlockRemoved | AllBlocksCleared
