"""Which transfer engine a worker uses: :func:`make_engine` picks one by device.

A module of its own so that the engines' modules import one way: worker/transfer_cuda.py builds
on worker/transfer.py, and only this module knows both. Runs in the worker process.
"""

from __future__ import annotations

import torch

from worker.transfer import CpuTransferEngine, TransferEngine


def make_engine(device: torch.device, *, host_kernels: bool = False) -> TransferEngine:
    """The engine for KV caches on ``device``: CUDA streams for a CUDA device, else threads.
    ``host_kernels``: see :class:`~worker.transfer.TransferEngine` (CUDA only here: the CPU
    engine's default strided copies need no staging)."""
    if device.type == "cuda":
        from worker.transfer_cuda import CudaTransferEngine

        return CudaTransferEngine(device, host_kernels=host_kernels)
    return CpuTransferEngine()
