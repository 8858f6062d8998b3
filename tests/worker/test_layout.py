"""Layout canonicalization: every supported paged layout becomes per-block byte rows that alias
the original tensors, with the block dimension found from the strides."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvserver.errors import InvalidArgument  # noqa: E402
from worker.layout import canonicalize, split_extents  # noqa: E402

NB, BS, H, D = 6, 4, 2, 8  # blocks, tokens per block, kv heads, head dim
LAYERS = 3


def filled(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).remainder(2039).to(dtype).reshape(shape)


def raw(t: torch.Tensor) -> bytes:
    """The bytes of a (contiguous) tensor."""
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


def block(caches: object, b: int) -> bytes:
    return b"".join(raw(v[b]) for v in caches.views)  # type: ignore[attr-defined]


def test_flash_attention_layout_splits_k_and_v() -> None:
    """(2, num_blocks, block_size, heads, dim) per layer: K and V views, K first, per layer."""
    layers = {f"l{i}": filled(2, NB, BS, H, D) + i for i in range(LAYERS)}
    c = canonicalize(layers, NB)
    page = BS * H * D * 2
    assert len(c.views) == 2 * LAYERS and c.page_bytes == (page,) * (2 * LAYERS)
    assert c.block_bytes == 2 * LAYERS * page and c.offsets[1] == page
    assert c.names[:2] == ("l0", "l0")
    for b in range(NB):
        want = b"".join(raw(layers[f"l{i}"][kv, b]) for i in range(LAYERS) for kv in (0, 1))
        assert block(c, b) == want


def test_block_first_layout_is_one_view_per_layer() -> None:
    """(num_blocks, 2, block_size, heads, dim): the whole block is one page."""
    layers = [filled(NB, 2, BS, H, D) * (i + 1) for i in range(LAYERS)]
    c = canonicalize(layers, NB)
    assert len(c.views) == LAYERS and c.page_bytes == (2 * BS * H * D * 2,) * LAYERS
    for b in range(NB):
        assert block(c, b) == b"".join(raw(t[b]) for t in layers)


def test_cross_layer_tensor_is_one_view() -> None:
    """(num_blocks, layers * page) uint8: already canonical, one segment per run of blocks."""
    t = filled(NB, LAYERS * 128, dtype=torch.float32).to(torch.uint8)
    c = canonicalize({"all": t}, NB)
    assert len(c.views) == 1 and c.block_bytes == LAYERS * 128
    assert c.views[0].data_ptr() == t.data_ptr()
    assert c.segments([2, 3, 4]) == [(0, 2 * c.block_bytes, 0, 3 * c.block_bytes)]


def test_same_model_same_block_bytes_across_layouts() -> None:
    """A per-layer FlashAttention cache and a cross-layer (blocks, layers, 2, ...) cache of
    the same KV produce identical block bytes (so they can share stored parts)."""
    cross = filled(NB, LAYERS, 2, BS, H, D)
    per_layer = {f"l{i}": cross[:, i].transpose(0, 1).contiguous() for i in range(LAYERS)}
    a, b = canonicalize(per_layer, NB), canonicalize([cross], NB)
    assert a.block_bytes == b.block_bytes
    assert all(block(a, i) == block(b, i) for i in range(NB))


def test_block_dimension_comes_from_strides() -> None:
    """A logical (2, num_blocks, ...) view of a block-major allocation is one view per layer
    (physically the block dimension is outermost); a permuted HND view keeps physical order."""
    alloc = filled(NB, 2, BS, H, D)
    logical = alloc.transpose(0, 1)  # looks like FlashAttention, is block-major underneath
    c = canonicalize([logical], NB)
    assert len(c.views) == 1 and c.views[0].data_ptr() == alloc.data_ptr()
    assert block(c, 3) == raw(alloc[3])
    hnd = filled(2, NB, H, BS, D)  # physical heads-before-tokens
    c2 = canonicalize([hnd.transpose(2, 3)], NB)  # logical NHD
    assert len(c2.views) == 2 and block(c2, 1) == raw(hnd[0, 1]) + raw(hnd[1, 1])


def test_views_alias_the_caches() -> None:
    t = filled(2, NB, BS, H, D)
    c = canonicalize([t], NB)
    c.views[1][4].fill_(0)
    assert raw(t[1, 4]) == bytes(BS * H * D * 2) and raw(t[0, 4]) != bytes(BS * H * D * 2)


def test_ambiguous_block_dimension_needs_a_hint() -> None:
    t = filled(2, 2, BS, H, D)  # num_blocks == 2 == the K/V dimension
    with pytest.raises(InvalidArgument, match="block_dim"):
        canonicalize([t], 2)
    c = canonicalize([t], 2, block_dim=1)
    assert len(c.views) == 2 and block(c, 1) == raw(t[0, 1]) + raw(t[1, 1])


@pytest.mark.parametrize(
    "caches, num_blocks",
    [
        ([], NB),
        ([torch.zeros(NB, 2, 10)[:, :, :8]], NB),  # padded: not dense
        ([torch.zeros(NB + 1, 8)], NB),  # no dimension of num_blocks
        ([torch.zeros(NB, 8)], 0),
    ],
    ids=["empty", "padded", "no-block-dim", "zero-blocks"],
)
def test_invalid_layouts_are_refused(caches: list[torch.Tensor], num_blocks: int) -> None:
    with pytest.raises(InvalidArgument):
        canonicalize(caches, num_blocks)


def test_segments_interleave_views_and_honour_skip() -> None:
    c = canonicalize([filled(2, NB, BS, H, D)], NB)
    page = c.page_bytes[0]
    # sub-blocks 1 and 2 of a part from GPU blocks 5 and 0: K then V for each, no merging
    assert c.segments([5, 0], first_sub=1) == [
        (0, 5 * page, 2 * page, page),
        (1, 5 * page, 3 * page, page),
        (0, 0, 4 * page, page),
        (1, 0, 5 * page, page),
    ]
    with pytest.raises(InvalidArgument, match="block id"):
        c.segments([NB])


def test_split_extents_maps_part_ranges_to_arena_pieces() -> None:
    extents = [(1000, 100), (5000, 50), (200, 100)]
    assert split_extents(extents, 0, 250) == [(1000, 0, 100), (5000, 100, 50), (200, 150, 100)]
    assert split_extents(extents, 90, 70) == [(1090, 90, 10), (5000, 100, 50), (200, 150, 10)]
    assert split_extents(extents, 160, 90) == [(210, 160, 90)]
    with pytest.raises(InvalidArgument):
        split_extents(extents, 200, 51)


@pytest.mark.parametrize("layout", ["flash", "blocks_first", "cross", "hnd"])
def test_groups_are_the_views_of_each_tensor(layout: str) -> None:
    """One group per registered tensor: its rows alias that tensor, row ``[b, k]`` is view
    ``first + k``'s page of block ``b``, and the groups tile the block bytes in order."""
    if layout == "flash":
        tensors = [filled(2, NB, BS, H, D) + i for i in range(LAYERS)]
    elif layout == "blocks_first":
        tensors = [filled(NB, 2, BS, H, D) * (i + 1) for i in range(LAYERS)]
    elif layout == "cross":
        tensors = [filled(NB, LAYERS, 2, BS, H, D)]
    else:
        tensors = [filled(2, NB, H, BS, D).transpose(2, 3) for _ in range(LAYERS)]
    c = canonicalize(tensors, NB)
    assert len(c.groups) == len(tensors)
    assert sum(g.count for g in c.groups) == len(c.views)
    offset = 0
    for g, t in zip(c.groups, tensors, strict=True):
        assert g.rows.shape == (NB, g.count, g.page) and g.offset == offset
        assert g.rows.data_ptr() == t.data_ptr()
        for k in range(g.count):
            assert c.page_bytes[g.first + k] == g.page and c.offsets[g.first + k] == offset
            assert all(torch.equal(g.rows[b, k], c.views[g.first + k][b]) for b in range(NB))
            offset += g.page
    assert offset == c.block_bytes
