"""Value types of the service's replies: what :class:`~kvserver.daemon.service.KVService` and
its tier stack (``tier_stack.py``) return to the front ends. Pure data.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Pending(Generic[T]):
    """The rest of an operation that must wait for a lower tier's I/O: ``await run()``.
    Returned instead of the result when the answer is not known without I/O; the ZMQ front end
    runs it as a ``zmq_ops.Deferred``, the gRPC front end awaits it."""

    run: Callable[[], Awaitable[T]]


@dataclass(frozen=True, slots=True)
class LookupHits:
    ns_id: str
    hit_chunks: int
    hit_tokens: int
    num_chunks: int
    #: chunks found per tier, e.g. {"dram": 3, "ssd": 0}
    tiers: dict[str, int]


@dataclass(frozen=True, slots=True)
class PutResult:
    """What :meth:`KVService.put` did: the keys it stored, those already present, those the
    reuse gate filtered; ``rejected`` when the cache could not take them (nothing stored)."""

    stored: list[bytes]
    present: list[bytes]
    filtered: list[bytes]
    rejected: bool


@dataclass(frozen=True, slots=True)
class Fetched:
    """What :meth:`KVService.get` read: key-major parts (one list of views per key and rank of
    ``ranks``) and ``lease_id``, a load lease of the caller's ``client`` that keeps the arena
    views valid (0 when nothing is pinned): the caller ends it (``complete_load``) once the
    views are no longer used."""

    keys: list[bytes]
    ranks: list[int]
    parts: list[list[memoryview]]
    lease_id: int
