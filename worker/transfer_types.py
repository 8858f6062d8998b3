"""The transfer engine's value types: a :class:`Transfer` of per-key copies, its direction,
the kinds of copies, and the engine's counters (worker/transfer.py runs them).

Runs in the worker process. A :class:`Transfer` is built by the connector on the worker's
thread, written by the direction's runner while it runs (its results, then ``done``), and read
back by the worker's thread once collected (see worker/transfer.py for the order).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.block_runs import BlockRun
from worker.staging import StagedPart


class Direction(enum.Enum):
    STORE = "store"  # KV blocks → host
    LOAD = "load"  # host → KV blocks


@dataclass(frozen=True, slots=True, eq=False)
class IndexedCopy:
    """Rows along dim 0 picked by ``index`` on one side: a gather ``dst[k] = src[index[k]]``
    or, with ``scatter``, ``dst[index[k]] = src[k]``. ``index`` (int64, on the CPU) has no
    duplicates when ``scatter``; the row shapes of ``src`` and ``dst`` match."""

    src: torch.Tensor
    dst: torch.Tensor
    index: torch.Tensor
    scatter: bool

    @property
    def nbytes(self) -> int:
        dense = self.src if self.scatter else self.dst
        return dense.numel() * dense.element_size()


#: One copy: a ``(src, dst)`` pair of equal shape (``dst.copy_(src)``), an indexed copy, a
#: run of whole blocks between CPU caches and host memory (worker/block_runs.py), or a part to
#: move through the engine's staging buffer (worker/staging.py).
Copy = tuple[torch.Tensor, torch.Tensor] | IndexedCopy | BlockRun | StagedPart


def copy_bytes(copy: Copy) -> int:
    if isinstance(copy, IndexedCopy | BlockRun | StagedPart):
        return copy.nbytes
    return copy[0].numel() * copy[0].element_size()


@dataclass(slots=True, eq=False)
class KeyCopies:
    """The copies of one chunk part, run in order. ``error`` set means planning failed
    already: nothing is copied and the key is reported failed. ``size``: the bytes the copies
    move, when the planner knows it (else summed from ``pairs``)."""

    key: bytes
    pairs: list[Copy] = field(default_factory=list)
    error: str | None = None
    size: int | None = None

    @property
    def nbytes(self) -> int:
        if self.size is not None:
            return self.size
        return sum(copy_bytes(c) for c in self.pairs)


@dataclass(slots=True, eq=False)
class Transfer:
    """One unit of ordered work, reported once.

    ``prepare`` (optional) runs first on the engine's thread and returns the copies (e.g. a
    remote load reads the parts from the daemon, then copies them out); otherwise ``copies``
    are used. ``finish`` (optional) runs on the engine's thread once the copies have landed,
    with the keys that copied fine (e.g. a remote store sends its staging buffer). An exception
    from either fails every key. ``keepalive`` holds buffers the copies use until done.
    """

    direction: Direction
    tag: Any
    keys: list[bytes]
    copies: list[KeyCopies] = field(default_factory=list)
    prepare: Callable[[], list[KeyCopies]] | None = None
    finish: Callable[[list[bytes]], None] | None = None
    keepalive: list[Any] = field(default_factory=list)
    # --- results (written by the engine thread, read after completion) ---
    failed_keys: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    #: None until submitted; then False until the engine's thread has run the transfer and
    #: written the results above (set under the direction's condition, see
    #: :meth:`TransferEngine.wait`). A device engine's copies may still be in flight then.
    done: bool | None = None
    #: when the submitting thread first saw its copies landed (``time.monotonic()``, by
    #: :meth:`TransferEngine.poll` or :meth:`TransferEngine.wait`): never earlier than they
    #: landed, so a reader whose lease deadline is before it knows its copies were done in time
    landed_at: float | None = None
    #: engine-specific completion state (CUDA: the end event).
    state: Any = None


@dataclass(slots=True)
class EngineStats:
    transfers: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    failed_keys: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    #: runs of two or more transfers copied as one group, and the transfers in them.
    groups: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    grouped_transfers: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
