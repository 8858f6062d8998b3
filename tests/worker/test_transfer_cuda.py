"""CUDA specifics: stores wait for the compute stream, the arena mapping is page-locked with
cudaHostRegister and copied into by DMA. The address helper runs everywhere."""

from __future__ import annotations

import ctypes
import mmap

import pytest

torch = pytest.importorskip("torch")

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
