"""Planning and building the copies of one chunk part (worker/layout.py ``plan_copies``):
byte-exact stores and loads through the real CPU engine, for every canonical layout, partial
first chunks, fragmented extents cutting blocks and pages anywhere, consecutive, scattered and
repeated block ids, and every builder (strided on the CPU, staged as on CUDA, and the per-piece
contiguous copies), all through the CPU engine."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvserver.errors import InvalidArgument  # noqa: E402
from tests.worker.staged_scenarios import LAYOUTS, kv_tensors  # noqa: E402
from worker.block_runs import BlockRun  # noqa: E402
from worker.layout import Builder, CanonicalKVCaches, canonicalize, plan_copies  # noqa: E402
from worker.transfer import (  # noqa: E402
    Copy,
    Direction,
    IndexedCopy,
    KeyCopies,
    Transfer,
)
from worker.transfer_cpu import CpuTransferEngine  # noqa: E402


def make_caches(kind: str, nb: int, seed: int = 0) -> CanonicalKVCaches:
    """Random KV caches of ``nb`` blocks in one of the layouts canonicalize accepts."""
    caches, block_dim = kv_tensors(kind, nb, seed)
    return canonicalize(caches, nb, block_dim=block_dim)


def block(c: CanonicalKVCaches, b: int) -> bytes:
    return b"".join(v[b].numpy().tobytes() for v in c.views)


def fill(t: torch.Tensor, seed: int) -> None:
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)))  # fmt: skip


def run(engine: CpuTransferEngine, kc: KeyCopies, is_load: bool) -> Transfer:
    direction = Direction.LOAD if is_load else Direction.STORE
    t = Transfer(direction, "t", [kc.key], [kc])
    engine.submit(t)
    engine.wait([t])
    assert engine.poll() == [t]
    return t


@dataclass
class Part:
    """A part of ``chunk_blocks`` blocks cut into extents placed anywhere in ``host`` (a
    slice of a bigger buffer, so its storage offset is not 0)."""

    host: torch.Tensor
    extents: list[tuple[int, int]]

    def data(self) -> bytes:
        return b"".join(self.host[o : o + n].numpy().tobytes() for o, n in self.extents)

    def outside(self) -> bytes:
        """The host bytes no extent covers."""
        mask = torch.ones(self.host.numel(), dtype=torch.bool)
        for o, n in self.extents:
            mask[o : o + n] = False
        return self.host[mask].numpy().tobytes()


def place(part_bytes: int, cuts: list[int], order: list[int], gaps: list[int], lead: int) -> Part:
    """Cut ``[0, part_bytes)`` at ``cuts`` into extents, lay them out in ``order`` with
    ``gaps`` between them, in a host tensor starting ``lead`` bytes into its buffer."""
    bounds = [0, *sorted(set(cuts)), part_bytes]
    lengths = [b - a for a, b in pairwise(bounds)]
    offsets = [0] * len(lengths)
    pos = gaps[-1]
    for k in order:
        offsets[k] = pos
        pos += lengths[k] + gaps[k % len(gaps)]
    buf = torch.full((lead + pos + 3,), 0xEE, dtype=torch.uint8)
    return Part(buf[lead : lead + pos], list(zip(offsets, lengths, strict=True)))


@dataclass
class Scenario:
    kind: str
    nb: int
    chunk_blocks: int
    skip: int
    ids: list[int]
    is_load: bool
    cuts: list[int]
    order: list[int]
    gaps: list[int]
    lead: int
    builder: Builder
    seed: int


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    kind = draw(st.sampled_from(LAYOUTS))
    nb = draw(st.integers(4, 10))
    chunk_blocks = draw(st.integers(1, 4))
    is_load = draw(st.booleans())
    skip = draw(st.integers(0, chunk_blocks - 1)) if is_load else 0
    n = chunk_blocks - skip
    ids_kind = draw(st.sampled_from(["run", "distinct", "any"]))
    if ids_kind == "run":  # consecutive blocks, the usual case
        first = draw(st.integers(0, nb - n))
        ids = list(range(first, first + n))
    elif ids_kind == "distinct":
        ids = draw(st.permutations(range(nb)))[:n]
    else:  # repeats included
        ids = draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n))
    bb = make_caches(kind, nb).block_bytes
    part_bytes = chunk_blocks * bb
    cuts_kind = draw(st.sampled_from(["none", "blocks", "anywhere"]))
    if cuts_kind == "none":  # the usual case: the part in one extent
        cuts = []
    elif cuts_kind == "blocks":  # extents end at block boundaries
        cuts = draw(st.lists(st.integers(1, chunk_blocks).map(lambda k: k * bb), max_size=3))
        cuts = [c for c in cuts if c < part_bytes]
    else:
        cuts = draw(st.lists(st.integers(1, part_bytes - 1), max_size=4))
    order = list(draw(st.permutations(range(len(set(cuts)) + 1))))
    gaps = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    return Scenario(kind, nb, chunk_blocks, skip, ids, is_load, cuts, order, gaps,
                    draw(st.integers(0, 17)),
                    draw(st.sampled_from(["strided", "contiguous", "staged"])),
                    draw(st.integers(0, 1000)))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_copies_move_exactly_the_part_bytes(s: Scenario) -> None:
    """Property: a store writes exactly the part (the blocks' bytes in order) into the
    extents and nothing else; a load writes sub-block ``skip + j`` into ``block_ids[j]`` (the
    last one wins for a repeated id), leaves every other block and the host as they were."""
    c = make_caches(s.kind, s.nb, seed=s.seed)
    bb = c.block_bytes
    part = place(s.chunk_blocks * bb, s.cuts, s.order, s.gaps, s.lead)
    if s.is_load:
        fill(part.host, s.seed + 1)
    before_blocks = [block(c, b) for b in range(s.nb)]
    before_part, before_outside = part.data(), part.outside()
    kc = plan_copies(c, b"k", s.ids, s.chunk_blocks, part.host, part.extents, skip=s.skip,
                     is_load=s.is_load, builder=s.builder)  # fmt: skip
    engine = CpuTransferEngine()
    try:
        t = run(engine, kc, s.is_load)
    finally:
        engine.close()
    assert not t.failed_keys and t.nbytes == len(s.ids) * bb
    assert part.outside() == before_outside
    if not s.is_load:
        assert part.data() == b"".join(block(c, b) for b in s.ids)
        assert [block(c, b) for b in range(s.nb)] == before_blocks
        return
    assert part.data() == before_part
    want = list(before_blocks)
    for j, b in enumerate(s.ids):
        want[b] = before_part[(s.skip + j) * bb : (s.skip + j + 1) * bb]
    assert [block(c, b) for b in range(s.nb)] == want


def planned(c: CanonicalKVCaches, ids: list[int], host: torch.Tensor,
            extents: list[tuple[int, int]], *, is_load: bool,
            builder: Builder | None = None) -> list[Copy]:  # fmt: skip
    """The copies of a whole chunk of ``ids``, built."""
    kc = plan_copies(c, b"k", ids, len(ids), host, extents, is_load=is_load,
                     builder=builder)  # fmt: skip
    return kc.pairs


def test_consecutive_blocks_are_one_block_run() -> None:
    """A run of blocks in one extent of a CPU host: one block run (worker/block_runs.py), for
    every layout, however many blocks and pages."""
    for kind in LAYOUTS:
        c = make_caches(kind, 8)
        host = torch.zeros(5 * c.block_bytes, dtype=torch.uint8)
        copies = planned(c, [2, 3, 4, 5], host, [(7, 4 * c.block_bytes)], is_load=False)
        assert len(copies) == 1 and isinstance(copies[0], BlockRun)
        assert (copies[0].first, copies[0].count, copies[0].at) == (2, 4, 7)


def test_scattered_blocks_are_one_indexed_copy_per_tensor() -> None:
    """Other ids: one gather (store) or scatter (load) per tensor; the scatter moves the
    widest elements the alignment allows."""
    c = make_caches("flash", 8)
    host = torch.zeros(3 * c.block_bytes, dtype=torch.uint8)
    stores = planned(c, [6, 1, 4], host, [(0, 3 * c.block_bytes)], is_load=False)
    loads = planned(c, [6, 1, 4], host, [(0, 3 * c.block_bytes)], is_load=True)
    assert len(stores) == len(loads) == 3
    assert all(isinstance(p, IndexedCopy) and not p.scatter for p in stores)
    assert all(isinstance(p, IndexedCopy) and p.scatter for p in loads)
    assert {p.dst.dtype for p in loads if isinstance(p, IndexedCopy)} == {torch.complex128}


def test_contiguous_builder_gives_contiguous_pieces() -> None:
    """The per-piece copies (a staged part's fallback, what copy_(non_blocking=True) between
    a CUDA device and pinned memory wants): every piece contiguous on both sides; an extent
    boundary inside a page splits it."""
    c = make_caches("flash", 8)
    bb, page = c.block_bytes, c.page_bytes[0]
    host = torch.zeros(4 * bb + 64, dtype=torch.uint8)
    extents = [(64, bb + page // 2), (bb + page // 2 + 64, 3 * bb - page // 2)]
    copies = planned(c, [2, 3, 4, 5], host, extents, is_load=False, builder="contiguous")
    assert all(isinstance(p, tuple) and p[0].is_contiguous() and p[1].is_contiguous()
               for p in copies)  # fmt: skip
    assert sum(p[0].numel() for p in copies if isinstance(p, tuple)) == 4 * bb
    assert len(copies) == len(c.views) * 4 + 1  # one page cut in two


@pytest.mark.parametrize(
    "ids, skip, extents, match",
    [
        ([0, 1, 8], 0, None, "block id"),
        ([0, 1], 0, None, "do not fit"),
        ([0, 1, 2], 3, None, "do not fit"),
        ([0, 1, 2], 0, [(0, 100)], "beyond its extents"),
        ([0, 1, 2], 0, [(10**6, 10**6)], "outside the host"),
    ],
    ids=["block-out-of-range", "too-few-ids", "skip-everything", "short-extents", "off-host"],
)
def test_bad_chunks_are_refused_when_planned(
    ids: list[int], skip: int, extents: list[tuple[int, int]] | None, match: str
) -> None:
    c = make_caches("flash", 8)
    host = torch.zeros(3 * c.block_bytes, dtype=torch.uint8)
    with pytest.raises(InvalidArgument, match=match):
        plan_copies(c, b"k", ids, 3, host, extents or [(0, 3 * c.block_bytes)], skip=skip,
                    is_load=skip > 0)  # fmt: skip
