"""Probe (GPU only): CUDA kernels gathering paged KV straight into page-locked host memory.

The next design step for the worker's GPU<->arena copies (docs/benchmarks.md, "GPU (NVIDIA
H200)"): instead of staging on the device and one DMA per arena extent, the gather/scatter
kernels (``index_copy_`` / ``index_select``) address the host memory itself through unified
virtual addressing (zero-copy over PCIe), so a transfer costs a few kernel launches per layer
whatever the number of extents. This probe answers the two questions that decide it:

1. can torch see page-locked host memory as a CUDA tensor (``__cuda_array_interface__`` over
   its pointer), for ``pin_memory()`` buffers and for a ``cudaHostRegister``'ed shared mapping
   like the daemon's arena (flags portable | mapped), and do writes through it land?
2. how fast are such kernels vs pinned ``cudaMemcpy`` of the same bytes (the reference, in the
   same run): ``LAYERS`` per-layer K/V caches, 4-block chunks scattered over the host buffer,
   page sizes 4 / 16 / 64 KiB, bytes checked.

Usage: python3 benchmarks/gpu_zero_copy_probe.py [--json FILE]   (needs CUDA; ~30 s on an H200)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: torch.cuda with its untyped cudart() seen as Any by mypy (as in worker/transfer_cuda.py).
_cuda: Any = torch.cuda
LAYERS = 32
HOST_BYTES = 1 << 30
CHUNK_BLOCKS = 4
#: cudaHostRegisterPortable | cudaHostRegisterMapped
REGISTER_FLAGS = 1 | 2


class _Pointer:
    """A raw device-visible pointer as ``__cuda_array_interface__`` (version 3), bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }  # fmt: skip


def device_view(ptr: int, nbytes: int) -> torch.Tensor:
    """A CUDA uint8 tensor over page-locked host memory at ``ptr`` (no copy)."""
    return torch.as_tensor(_Pointer(ptr, nbytes), device="cuda")


def _median_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = _cuda.Event(enable_timing=True), _cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1000.0)
    return float(sorted(times)[len(times) // 2])


def registered_mapping_works(nbytes: int = 64 << 20) -> str:
    """Question 1 for a shared mapping registered as the worker registers the arena."""
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            host = torch.frombuffer(mm, dtype=torch.uint8)
            err = int(_cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes,
                                                           REGISTER_FLAGS))  # fmt: skip
            if err != 0:
                return f"cudaHostRegister failed: {err}"
            try:
                src = (torch.arange(4096, device="cuda") % 251).to(torch.uint8)
                device_view(host.data_ptr(), nbytes)[:4096].copy_(src)
                torch.cuda.synchronize()
                ok = bool(torch.equal(host[:4096], src.cpu()))
            finally:
                _cuda.cudart().cudaHostUnregister(host.data_ptr())
            del host
            return "writes land" if ok else "WRONG BYTES"
    finally:
        os.close(fd)
        os.unlink(path)


def measure(host: torch.Tensor, page: int) -> dict[str, Any]:
    """Question 2 at one page size."""
    rows_h = device_view(host.data_ptr(), host.numel())[: (host.numel() // page) * page]
    rows_h = rows_h.view(-1, page)
    blocks = min(4096, (512 << 20) // (LAYERS * 2 * page))
    caches = [torch.randint(0, 255, (2, blocks, page), dtype=torch.uint8, device="cuda")
              for _ in range(LAYERS)]  # fmt: skip
    n = blocks // 2
    ids = torch.randperm(blocks, device="cuda")[:n]
    part_rows = CHUNK_BLOCKS * LAYERS * 2  # a part: layers, K then V, its blocks' pages
    slots = torch.randperm(rows_h.shape[0] // part_rows, device="cuda")[: n // CHUNK_BLOCKS]
    base = slots.repeat_interleave(CHUNK_BLOCKS) * part_rows
    within = torch.arange(n, device="cuda") % CHUNK_BLOCKS
    dst = [[base + (layer * 2 + kv) * CHUNK_BLOCKS + within for kv in range(2)]
           for layer in range(LAYERS)]  # fmt: skip
    total = n * LAYERS * 2 * page
    contiguous = torch.empty(total, dtype=torch.uint8, device="cuda")

    def store() -> None:
        for layer in range(LAYERS):
            for kv in range(2):
                rows_h.index_copy_(0, dst[layer][kv], caches[layer][kv].index_select(0, ids))

    def load() -> None:
        for layer in range(LAYERS):
            for kv in range(2):
                caches[layer][kv].index_copy_(0, ids, rows_h.index_select(0, dst[layer][kv]))

    d2h = _median_seconds(lambda: host[:total].copy_(contiguous, non_blocking=True))
    h2d = _median_seconds(lambda: contiguous.copy_(host[:total], non_blocking=True))
    st, ld = _median_seconds(store), _median_seconds(load)
    store()
    torch.cuda.synchronize()
    ok = bool(torch.equal(rows_h.index_select(0, dst[3][1]).cpu(),
                          caches[3][1].index_select(0, ids).cpu()))  # fmt: skip
    return {
        "page": page, "bytes": total, "ref_d2h_gbps": total / d2h / 1e9,
        "ref_h2d_gbps": total / h2d / 1e9, "store_gbps": total / st / 1e9,
        "load_gbps": total / ld / 1e9, "store_ratio": d2h / st, "load_ratio": h2d / ld,
        "bytes_ok": ok,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_zero_copy_probe: needs CUDA")
        return 2
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": LAYERS,
        "registered_mapping": registered_mapping_works(),
    }
    print("cudaHostRegister'ed shared mapping:", result["registered_mapping"])
    host = torch.empty(HOST_BYTES, dtype=torch.uint8).pin_memory()
    result["rows"] = [measure(host, page) for page in (4096, 16384, 65536)]
    for r in result["rows"]:
        print(
            f"page {r['page'] >> 10:>3} KiB: store {r['store_ratio']:.2f}, load "
            f"{r['load_ratio']:.2f} of pinned cudaMemcpy (bytes ok: {r['bytes_ok']})"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
