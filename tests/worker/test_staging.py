"""Staged copies (worker/staging.py): many parts of one transfer gathered into (or scattered
from) a staging buffer, then one copy per host extent. The staged path is plain torch, so the
property runs it on CPU tensors through the CPU engine and compares every byte with the
strided path (random layouts, partial first chunks, repeated ids, extents cut anywhere and
adjacent or apart, staging buffers too small for a batch or even for one block); its twin marked
``gpu`` (tests/worker/test_transfer_cuda.py) runs the same scenarios with the caches on CUDA
through the CUDA engine."""

from __future__ import annotations

import logging
import random

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.worker.staged_scenarios import (  # noqa: E402
    Chunk,
    Scenario,
    capacity,
    execute,
    random_scenario,
)
from worker.staging import (  # noqa: E402
    StagedPart,
    StagingBuffer,
    _batches,
    _host_kernel,
    _spans,
)
from worker.transfer import Direction  # noqa: E402
from worker.transfer_cpu import CpuTransferEngine  # noqa: E402


@settings(max_examples=250, deadline=None)
@given(st.randoms(use_true_random=False))
def test_staged_transfers_move_the_same_bytes_as_strided_ones(rng: random.Random) -> None:
    s = random_scenario(rng)
    reference = CpuTransferEngine()
    staged = CpuTransferEngine(staging_bytes=capacity(s))
    try:
        want = execute(s, reference, "cpu", "strided")
        assert execute(s, staged, "cpu", "staged") == want
    finally:
        reference.close()
        staged.close()


@settings(max_examples=250, deadline=None)
@given(st.randoms(use_true_random=False))
def test_host_kernels_move_the_same_bytes_as_strided_copies(rng: random.Random) -> None:
    """CPU twin of the CUDA engine's ``host_kernels``: a staged batch's extent pieces move as
    one indexed gather/scatter over rows of the host tensor instead of one copy each."""
    s = random_scenario(rng)
    reference = CpuTransferEngine()
    kernels = CpuTransferEngine(staging_bytes=capacity(s), host_kernels=True)
    try:
        want = execute(s, reference, "cpu", "strided")
        assert execute(s, kernels, "cpu", "staged") == want
    finally:
        reference.close()
        kernels.close()


def test_host_kernels_run_one_kernel_per_batch_in_rows_of_the_common_size() -> None:
    """A batch of pieces spread over the host moves as one kernel; rows are the largest size
    dividing every offset and length; a single piece stays one plain copy."""
    for is_load in (False, True):
        s = Scenario("flash", 8, 2, is_load, [Chunk([0, 1], 0, []), Chunk([5, 2], 0, [9])], 1,
                     [0], "large", 3)  # fmt: skip
        reference, kernels = CpuTransferEngine(), CpuTransferEngine(host_kernels=True)
        try:
            assert execute(s, kernels, "cpu", "staged") == execute(s, reference, "cpu", "strided")
            d = Direction.LOAD if is_load else Direction.STORE
            assert kernels._staging[d].kernel_batches == 1
        finally:
            reference.close()
            kernels.close()
    host = torch.arange(64, dtype=torch.uint8)
    buf = torch.zeros(24, dtype=torch.uint8)
    spans = [(host, 40, 0, 8), (host, 8, 8, 16)]
    scatter = _host_kernel(spans, buf, 24, lambda h: h, 16, False)
    gather = _host_kernel(spans, buf, 24, lambda h: h, 16, True)
    assert scatter is not None and gather is not None
    gather()
    assert buf.tolist() == [*range(40, 48), *range(8, 24)]
    buf.fill_(200)
    scatter()
    assert host[40:48].tolist() == [200] * 8 and host[8:24].tolist() == [200] * 16
    assert host[24:40].tolist() == list(range(24, 40))  # nothing else written
    assert _host_kernel(spans[:1], buf, 8, lambda h: h, 16, False) is None
    assert _host_kernel(spans, buf, 24, lambda h: None, 16, False) is None
    other = torch.arange(64, dtype=torch.uint8)
    assert _host_kernel([spans[0], (other, 0, 8, 16)], buf, 24, lambda h: h, 16, False) is None
    # large pieces (mean above max_piece) go as one DMA each: 12 bytes mean here
    assert _host_kernel(spans, buf, 24, lambda h: h, 16, False, max_piece=12) is not None
    assert _host_kernel(spans, buf, 24, lambda h: h, 16, False, max_piece=11) is None


def part(ids: list[int], is_load: bool, groups: tuple[object, ...] = (), bb: int = 10,
         first: int = 0, pieces: tuple[tuple[int, int, int], ...] = ()) -> StagedPart:  # fmt: skip
    return StagedPart(groups, bb, tuple(ids), first, torch.empty(0), pieces, is_load,  # type: ignore[arg-type]
                      lambda: [])  # fmt: skip


def rows(batches: list[tuple[object, int]]) -> list[object]:
    """Each batch as its (block ids) list, or "fallback" for a part run by itself."""
    out: list[object] = []
    row = 0
    for b, at in batches:
        assert at == row  # where the batch starts in all the parts' ids (none skipped)
        row += len(b.block_ids) if isinstance(b, StagedPart) else sum(hi - lo for _, lo, hi in b)
        if isinstance(b, StagedPart):
            out.append("fallback")
        else:
            assert isinstance(b, list)
            out.append([i for p, lo, hi in b for i in p.block_ids[lo:hi]])
    return out


def test_batches_fill_the_buffer_and_split_parts_at_sub_blocks() -> None:
    parts = [part([0, 1, 2, 3], False), part([4, 5, 6, 7], False), part([8], False)]
    assert rows(_batches(parts, 50)) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]  # 5 blocks of 10
    assert rows(_batches(parts, 9)) == ["fallback"] * 3  # not even one block fits


def test_a_load_batch_never_names_a_block_twice() -> None:
    """The later sub-block wins, as with the per-piece copies: a repeat starts a new batch."""
    parts = [part([1, 2, 1], True), part([3, 2], True)]
    assert rows(_batches(parts, 1000)) == [[1, 2], [1, 3, 2]]
    stores = [part([1, 2, 1], False), part([3, 2], False)]  # a gather may repeat
    assert rows(_batches(stores, 1000)) == [[1, 2, 1, 3, 2]]


def test_parts_of_other_caches_are_not_batched_together() -> None:
    a, b = (object(),), (object(),)
    assert rows(_batches([part([1], False, a), part([2], False, b)], 1000)) == [[1], [2]]


def test_copies_of_adjacent_extents_merge_across_parts() -> None:
    """Two parts whose extents continue each other in one host tensor: one copy; a part
    starting at sub-block 1 (a partial load) maps its pieces from its first bytes on."""
    host = torch.empty(100, dtype=torch.uint8)
    p1 = StagedPart((), 10, (1, 2), 0, host, ((0, 0, 15), (40, 15, 5)), False, lambda: [])
    p2 = StagedPart((), 10, (3, 4), 0, host, ((45, 0, 20),), False, lambda: [])
    spans = [(h, s, n) for _, h, s, n in _spans([(p1, 0, 2), (p2, 0, 2)], 10)]
    assert spans == [(0, 0, 15), (40, 15, 25)]
    p3 = StagedPart((), 10, (5,), 1, host, ((70, 10, 10),), True, lambda: [])
    assert [(h, s, n) for _, h, s, n in _spans([(p3, 0, 1)], 10)] == [(70, 0, 10)]
    halves = [(h, s, n) for _, h, s, n in _spans([(p1, 1, 2)], 10)]  # the second block only
    assert halves == [(10, 0, 5), (40, 5, 5)]


def test_no_staging_memory_falls_back_to_per_piece_copies(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault injection: the buffer cannot be allocated (out of device memory); the parts move
    page by page instead, byte for byte the same, and the failure is logged once."""
    s = Scenario("flash", 6, 2, False, [Chunk([4, 1], 0, [7]), Chunk([2, 3], 0, [])], 3, [0, 4],
                 "large", 5)  # fmt: skip
    want = None
    reference = CpuTransferEngine()
    try:
        want = execute(s, reference, "cpu", "strided")
    finally:
        reference.close()
    real_empty = torch.empty

    def empty(*args: object, **kw: object) -> torch.Tensor:
        if kw.get("device") is not None:
            raise torch.OutOfMemoryError("injected")
        return real_empty(*args, **kw)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(torch, "empty", empty)
    engine = CpuTransferEngine()
    try:
        with caplog.at_level(logging.WARNING, logger="worker.staging"):
            assert execute(s, engine, "cpu", "staged") == want
            assert execute(s, engine, "cpu", "staged") == want
        assert sum("no staging buffer" in r.getMessage() for r in caplog.records) == 1
    finally:
        engine.close()


def test_staging_buffer_is_allocated_once_per_direction() -> None:
    buf = StagingBuffer(64)
    a = buf.get(torch.device("cpu"))
    assert a is not None and a.numel() == 64 and buf.get(torch.device("cpu")) is a
    buf.release()
    with pytest.raises(ValueError):
        StagingBuffer(0)
