"""Translations between vLLM's scheduler objects and the kvserver connector's.

- :class:`VllmStep` reads a vLLM ``SchedulerOutput`` as the
  :class:`~scheduler.kv_connector_types.ScheduledStep` the scheduler connector plans from
  (KV cache group 0: the plug-in stores models with a single group).
- :class:`EventSource` turns the connector's storage events (chunk keys) into vLLM's
  ``BlockStored`` / ``BlockRemoved`` KV events, with the block hashes, parent hash and token
  ids of each stored chunk, as vLLM publishes its own (a removed chunk by its block hashes
  too).

No vLLM import at module level: vLLM's types are read by attribute.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserver.events import BlockRemoved, BlockStored, Event

#: kvserver keeps chunks in host memory (DRAM) or on its SSD tier.
MEDIUM = "CPU"


@dataclass(slots=True)
class StepRequest:
    """One request of a step: its whole block table (new) or its new blocks (cached)."""

    req_id: str
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def new_block_ids(self) -> list[int]:
        return self.block_ids


@dataclass(slots=True)
class VllmStep:
    """A vLLM ``SchedulerOutput`` as a ScheduledStep. A resumed (preempted, now scheduled
    again) request carries its whole new block table, so it is listed with the new ones."""

    num_scheduled_tokens: dict[str, int]
    new_reqs: list[StepRequest] = field(default_factory=list)
    cached_reqs: list[StepRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, out: Any) -> VllmStep:
        step = cls(dict(out.num_scheduled_tokens), preempted_req_ids=sorted(
            out.preempted_req_ids or ()
        ))  # fmt: skip
        for new in out.scheduled_new_reqs:
            step.new_reqs.append(
                StepRequest(new.req_id, list(new.block_ids[0]), new.num_computed_tokens)
            )
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            ids = list(blocks[0]) if blocks is not None else []
            (step.new_reqs if req_id in resumed else step.cached_reqs).append(
                StepRequest(req_id, ids, computed)
            )
        return step


@dataclass(slots=True)
class _ChunkInfo:
    block_hashes: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    lora_name: str | None


class EventSource:
    """Remembers what each stored chunk holds (recorded when its store ships) to describe it
    in vLLM's event format once the daemon has made it ready."""

    #: chunks remembered at most (a store that never completes is forgotten eventually).
    MAX_CHUNKS = 1 << 16

    def __init__(self, block_size: int, chunk_blocks: int) -> None:
        self.block_size = block_size
        self.chunk_blocks = chunk_blocks
        self._chunks: dict[bytes, _ChunkInfo] = {}
        #: req_id -> (its block hashes, block hash -> position)
        self._index: dict[str, tuple[Sequence[bytes], dict[bytes, int]]] = {}

    def index(self, request: Any) -> dict[bytes, int]:
        """Position of each block hash of ``request`` (kept until :meth:`forget`): what
        :meth:`record` and the fan-out of a removed chunk of the request read."""
        hashes: Sequence[bytes] = request.block_hashes
        entry = self._index.get(request.request_id)
        if entry is None or entry[0] is not hashes or len(entry[1]) > len(hashes):
            entry = self._index[request.request_id] = (hashes, {})
        index = entry[1]
        if len(index) < len(hashes):
            index.update((bytes(h), i) for i, h in enumerate(hashes[len(index) :], len(index)))
        return index

    def record(self, request: Any, keys: Iterable[bytes]) -> None:
        """``keys``: chunk keys of ``request`` whose stores are shipped this step."""
        hashes: Sequence[bytes] = request.block_hashes
        index = self.index(request)
        bs, cb = self.block_size, self.chunk_blocks
        lora = getattr(request, "lora_request", None)
        tokens = request.all_token_ids
        for key in keys:
            last = index.get(key)
            if last is None or last + 1 < cb:
                continue
            first = last + 1 - cb
            self._chunks[key] = _ChunkInfo(
                [bytes(h) for h in hashes[first : last + 1]],
                bytes(hashes[first - 1]) if first else None,
                list(tokens[first * bs : (last + 1) * bs]),
                None if lora is None else str(lora.lora_name),
            )
        while len(self._chunks) > self.MAX_CHUNKS:
            del self._chunks[next(iter(self._chunks))]

    def forget(self, req_id: str) -> None:
        self._index.pop(req_id, None)

    def convert(self, events: Iterable[Event], make: Any) -> list[Any]:
        """kvserver events -> vLLM KV events; ``make``: (BlockStored, BlockRemoved, hash_fn)
        of vLLM, passed in so this module needs no vLLM import."""
        stored_cls, removed_cls, ext = make
        out: list[Any] = []
        for event in events:
            if isinstance(event, BlockStored):
                for key in event.keys:
                    info = self._chunks.pop(key, None)
                    if info is None:
                        info = _ChunkInfo([key], None, [], None)
                    out.append(stored_cls(
                        block_hashes=[ext(h) for h in info.block_hashes],
                        parent_block_hash=None if info.parent is None else ext(info.parent),
                        token_ids=info.token_ids, block_size=self.block_size, lora_id=None,
                        medium=MEDIUM, lora_name=info.lora_name,
                    ))  # fmt: skip
            elif isinstance(event, BlockRemoved):
                hashes = [h for key in event.keys for h in self._blocks_of(key)]
                out.append(removed_cls(block_hashes=[ext(h) for h in hashes], medium=MEDIUM))
        return out

    def _blocks_of(self, key: bytes) -> list[bytes]:
        """The block hashes of chunk ``key`` (a BlockStored names all of them, so its removal
        does too, as vLLM's own connectors fan a removal out), read from an indexed request
        that holds it (the one whose pin found it gone); ``[key]`` when none does."""
        cb = self.chunk_blocks
        for hashes, index in self._index.values():
            last = index.get(key)
            if last is not None and last + 1 >= cb:
                return [bytes(h) for h in hashes[last + 1 - cb : last + 1]]
        return [key]
