"""Storage events: what external indexers (routers, llm-d, Dynamo) need to mirror the cache.

Shapes follow vLLM's KV-event vocabulary (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``) with the storage ``medium`` ("CPU" for the DRAM tier, "DISK" for SSD).
Events are batched: one event per namespace per operation, carrying every affected key.
The engine numbers events with a gap-free sequence so subscribers can resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Medium = Literal["CPU", "DISK"]
MEDIUM_DRAM: Medium = "CPU"
MEDIUM_SSD: Medium = "DISK"


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
