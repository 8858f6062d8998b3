"""CUDA specifics: stores wait for the compute stream, the arena mapping is page-locked with
cudaHostRegister and copied into by DMA, CUDA parts go through the device staging buffer and
move the same bytes as the CPU's strided copies. The address helper runs everywhere."""

from __future__ import annotations

import ctypes
import mmap
import random

import pytest

torch = pytest.importorskip("torch")

from tests.worker.staged_scenarios import (  # noqa: E402
    Chunk,
    Scenario,
    caches_on,
    capacity,
    execute,
    random_scenario,
)
from worker.layout import Builder  # noqa: E402
from worker.transfer import Direction, KeyCopies, Transfer  # noqa: E402
from worker.transfer_cuda import buffer_address  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_buffer_address_is_the_mapping_address() -> None:
    """CPU twin of the registration test: the address ctypes reports is where the bytes are."""
    with mmap.mmap(-1, 4096) as m:
        view = memoryview(m)
        addr = buffer_address(view)
        view[10:13] = b"abc"
        assert ctypes.string_at(addr + 10, 3) == b"abc"
        view.release()  # the helper released its own export: the mmap can close


@gpu
@needs_cuda
def test_store_waits_for_the_compute_stream() -> None:
    """A store submitted right after a (slow) kernel wrote the KV reads what it wrote."""
    from worker.transfer_cuda import CudaTransferEngine

    engine = CudaTransferEngine(torch.device("cuda"))
    try:
        src = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        dst = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
        torch.cuda._sleep(50_000_000)  # keeps the compute stream busy
        src.fill_(9)  # the "model" writes the KV, queued behind the sleep
        t = Transfer(Direction.STORE, "s", [b"k"], [KeyCopies(b"k", [(src, dst)])])
        engine.submit(t)
        engine.wait([t])
        assert engine.poll() == [t] and int(dst.min()) == 9 and t.seconds > 0
    finally:
        engine.close()


@gpu
@needs_cuda
def test_registered_arena_is_copied_by_dma() -> None:
    """cudaHostRegister of a shared mapping: async copies in and out, unregistered on close."""
    from kvserver.arena import SharedArena
    from worker.host import MappedArena

    arena = SharedArena(1 << 20)
    try:
        mapped = MappedArena(arena.path, pin=True)
        assert mapped.tensor.is_pinned()
        src = torch.full((4096,), 7, dtype=torch.uint8, device="cuda")
        mapped.tensor[4096:8192].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert arena.read(((4096, 4096),)) == bytes([7]) * 4096
        back = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        back.copy_(mapped.tensor[4096:8192], non_blocking=True)
        torch.cuda.synchronize()
        assert int(back.sum()) == 7 * 4096
        mapped.close()
        mapped.close()
    finally:
        arena.close()


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("builder", "host_kernels"), [("staged", False), ("staged", True), ("contiguous", False)]
)
def test_cuda_transfers_move_the_same_bytes_as_the_cpu(
    builder: Builder, host_kernels: bool
) -> None:
    """GPU twin of tests/worker/test_staging.py: random multi-part transfers (every layout,
    partial loads, repeated ids, extents cut anywhere, staging buffers from under one block to
    large) with the caches on CUDA and pinned host memory, through the CUDA engine: every byte
    as the strided path on the CPU; with ``host_kernels`` the pinned host memory is addressed
    by the gather/scatter kernels themselves."""
    from worker.transfer_cpu import CpuTransferEngine
    from worker.transfer_cuda import CudaTransferEngine

    for seed in range(80):
        s = random_scenario(random.Random(seed))
        reference = CpuTransferEngine()
        engine = CudaTransferEngine(
            torch.device("cuda"), staging_bytes=capacity(s), host_kernels=host_kernels
        )
        try:
            want = execute(s, reference, "cpu", "strided")
            assert execute(s, engine, "cuda", builder, pin=True) == want, f"seed {seed}: {s}"
        finally:
            reference.close()
            engine.close()


@gpu
@needs_cuda
def test_registered_arena_is_addressed_by_kernels() -> None:
    """With ``host_kernels`` the CUDA engine sees the ``cudaHostRegister``'ed arena as a CUDA
    tensor over the same bytes (unified addressing): a kernel's writes land in the arena; plain
    pageable memory gets no such view."""
    from kvserver.arena import SharedArena
    from worker.host import MappedArena
    from worker.transfer_cuda import CudaTransferEngine

    arena = SharedArena(1 << 20)
    engine = CudaTransferEngine(torch.device("cuda"), host_kernels=True)
    try:
        mapped = MappedArena(arena.path, pin=True)
        view = engine._host_view(mapped.tensor)
        assert view is not None and view.device.type == "cuda"
        rows = view.view(-1, 4096)
        src = torch.full((2, 4096), 9, dtype=torch.uint8, device="cuda")
        rows.index_copy_(0, torch.tensor([3, 1], device="cuda"), src)
        torch.cuda.synchronize()
        assert arena.read(((4096, 4096), (3 * 4096, 4096))) == bytes([9]) * 8192
        assert arena.read(((2 * 4096, 4096),)) == bytes(4096)
        assert engine._host_view(torch.zeros(64, dtype=torch.uint8)) is None
        del view, rows
        mapped.close()
    finally:
        engine.close()
        arena.close()


@gpu
@needs_cuda
def test_cuda_parts_are_staged_through_the_staging_buffer() -> None:
    """By default CUDA parts are planned as staged parts, and a transfer of several parts
    moves through the engine's device staging buffer (no per-page fallback)."""
    from worker.layout import plan_copies
    from worker.staging import StagedPart
    from worker.transfer_cpu import CpuTransferEngine
    from worker.transfer_cuda import CudaTransferEngine

    s = Scenario("flash", 8, 2, False, [Chunk([0, 1], 0, []), Chunk([5, 2], 0, [9])], 1, [0],
                 "large", 3)  # fmt: skip
    c = caches_on("flash", 8, 0, "cuda")
    host = torch.zeros(2 * c.block_bytes, dtype=torch.uint8).pin_memory()
    kc = plan_copies(c, b"k", [0, 1], 2, host, [(0, 2 * c.block_bytes)], is_load=False)
    assert len(kc.pairs) == 1 and isinstance(kc.pairs[0], StagedPart)
    reference = CpuTransferEngine()
    engine = CudaTransferEngine(torch.device("cuda"))
    try:
        want = execute(s, reference, "cpu", "strided")
        assert execute(s, engine, "cuda", "staged", pin=True) == want
        buf = engine._staging[Direction.STORE]._buf
        assert buf is not None and buf.device.type == "cuda"
    finally:
        reference.close()
        engine.close()
