"""Random KV caches in every layout canonicalize accepts, and random multi-part transfers run
through a transfer engine with a given copy builder (worker/layout.py ``plan_copies``), for
comparing builders and engines byte for byte. Plain ``random`` (no hypothesis), so that the
GPU twins run where only torch and pytest are installed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import pairwise

import torch

from worker.layout import Builder, CanonicalKVCaches, canonicalize, plan_copies
from worker.transfer import Direction, Transfer, TransferEngine

LAYOUTS = ["flash", "blocks_first", "cross", "hnd", "flat", "odd", "flash_shared", "flash_uneven"]


def kv_tensors(kind: str, nb: int, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """Random KV tensors of ``nb`` blocks in layout ``kind``, and their block dimension."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize),
                            dtype=torch.uint8, generator=g)  # fmt: skip
        return raw.view(dtype)

    bs, h, d = 2, 2, 4
    if kind == "flash":  # (2, blocks, block_size, heads, dim) per layer: K and V views
        return {f"l{i}": rand(2, nb, bs, h, d) for i in range(3)}, 1
    if kind == "flash_shared":  # the same, cut from one allocation: evenly spaced layers
        alloc = rand(3, 2, nb, bs, h, d)
        return {f"l{i}": alloc[i] for i in range(3)}, 1
    if kind == "flash_uneven":  # cut from one allocation at uneven distances
        alloc = rand(6, 2, nb, bs, h, d)
        return {f"l{i}": alloc[j] for i, j in enumerate((0, 1, 3))}, 1
    if kind == "blocks_first":  # (blocks, 2, block_size, heads, dim): one view per layer
        return {f"l{i}": rand(nb, 2, bs, h, d) for i in range(2)}, 0
    if kind == "cross":  # one (blocks, layers, 2, ...) tensor: one view
        return {"all": rand(nb, 3, 2, bs, h, d)}, 0
    if kind == "hnd":  # physical HND seen as logical NHD
        return {f"l{i}": rand(2, nb, h, bs, d).transpose(2, 3) for i in range(2)}, 1
    if kind == "flat":  # cross-layer bytes
        return {"all": rand(nb, 96, dtype=torch.uint8)}, 0
    assert kind == "odd"  # pages of different, odd sizes and alignments
    return {
        "a": rand(2, nb, 5, dtype=torch.uint8),
        "b": rand(2, nb, 3, dtype=torch.float32),
        "c": rand(1, nb, 7, dtype=torch.uint8),
    }, 1


def caches_on(kind: str, nb: int, seed: int, device: str) -> CanonicalKVCaches:
    """:func:`kv_tensors` moved to ``device`` (strides kept) and canonicalized."""
    tensors, block_dim = kv_tensors(kind, nb, seed)
    return canonicalize({k: t.to(device) for k, t in tensors.items()}, nb, block_dim=block_dim)


def all_blocks(c: CanonicalKVCaches) -> bytes:
    return b"".join(v.cpu().numpy().tobytes() for v in c.views)


@dataclass
class Chunk:
    ids: list[int]
    skip: int
    cuts: list[int]  # part offsets where its extents are cut


@dataclass
class Scenario:
    kind: str
    nb: int
    chunk_blocks: int
    is_load: bool
    chunks: list[Chunk]
    order_seed: int  # how the extents of all parts are laid out in the host buffer
    gaps: list[int]
    capacity: str  # staging bytes: "tiny" (under a block), "block", "few", "large"
    seed: int


def random_scenario(rng: random.Random) -> Scenario:
    """1-5 parts of one transfer: consecutive or arbitrary (repeated) block ids, partial
    first chunks for loads, extents cut anywhere."""
    kind = rng.choice(LAYOUTS)
    nb = rng.randint(3, 12)
    chunk_blocks = rng.randint(1, 4)
    is_load = rng.random() < 0.5
    bb = caches_on(kind, nb, 0, "cpu").block_bytes
    chunks = []
    for _ in range(rng.randint(1, 5)):
        skip = rng.randint(0, chunk_blocks - 1) if is_load else 0
        n = rng.randint(1, chunk_blocks - skip) if is_load else chunk_blocks
        if rng.random() < 0.5:  # a run of consecutive blocks
            first = rng.randint(0, max(0, nb - n))
            ids = [(first + j) % nb for j in range(n)]
        else:  # anything, repeats included (within and across parts)
            ids = [rng.randrange(nb) for _ in range(n)]
        part = chunk_blocks * bb
        cuts = [rng.randint(1, part - 1) for _ in range(rng.randint(0, 3))] if part > 1 else []
        chunks.append(Chunk(ids, skip, cuts))
    gaps = [rng.choice([0, 0, rng.randint(1, 24)]) for _ in range(rng.randint(1, 4))]
    capacity = rng.choice(["tiny", "block", "few", "large"])
    return Scenario(kind, nb, chunk_blocks, is_load, chunks, rng.randrange(10**6), gaps,
                    capacity, rng.randrange(1000))  # fmt: skip


def layout(s: Scenario, bb: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """Host size and each part's extents: all the extents of all parts, in order or shuffled,
    with gaps (a zero gap puts extents back to back: their copies may merge)."""
    part = s.chunk_blocks * bb
    pieces = []  # (chunk, index, length)
    for k, ch in enumerate(s.chunks):
        bounds = [0, *sorted(set(ch.cuts)), part]
        pieces += [(k, i, b - a) for i, (a, b) in enumerate(pairwise(bounds))]
    rng = random.Random(s.order_seed)
    if rng.random() < 0.5:
        rng.shuffle(pieces)
    extents: list[dict[int, tuple[int, int]]] = [{} for _ in s.chunks]
    pos = s.gaps[0]
    for j, (k, i, n) in enumerate(pieces):
        extents[k][i] = (pos, n)
        pos += n + s.gaps[j % len(s.gaps)]
    return pos + 5, [[e[i] for i in sorted(e)] for e in extents]


def capacity(s: Scenario) -> int:
    """The scenario's staging buffer size in bytes."""
    bb = caches_on(s.kind, s.nb, 0, "cpu").block_bytes
    return {"tiny": max(1, bb - 1), "block": bb, "few": 2 * bb + 3, "large": 1 << 20}[s.capacity]


def execute(
    s: Scenario, engine: TransferEngine, device: str, builder: Builder, pin: bool = False
) -> tuple[bytes, bytes]:
    """Run the scenario's transfer (all parts in one Transfer) on fresh caches on ``device``
    and a fresh host buffer (pinned with ``pin``); the host and KV bytes after."""
    c = caches_on(s.kind, s.nb, s.seed, device)
    size, extents = layout(s, c.block_bytes)
    g = torch.Generator().manual_seed(s.seed + 1)
    host = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    if pin:
        host = host.pin_memory()
    copies = [
        plan_copies(c, bytes([k]), ch.ids, s.chunk_blocks, host, extents[k], skip=ch.skip,
                    is_load=s.is_load, builder=builder)
        for k, ch in enumerate(s.chunks)
    ]  # fmt: skip
    direction = Direction.LOAD if s.is_load else Direction.STORE
    t = Transfer(direction, "t", [kc.key for kc in copies], copies)
    engine.submit(t)
    engine.wait([t])
    assert engine.poll() == [t] and not t.failed_keys
    assert t.nbytes == sum(len(ch.ids) for ch in s.chunks) * c.block_bytes
    return host.numpy().tobytes(), all_blocks(c)
