"""Which transfer engine a worker uses: :func:`make_engine` picks one by device.

A module of its own so that the engines' modules import one way: worker/transfer_cuda.py builds
on worker/transfer.py, and only this module knows both. Runs in the worker process.
"""

from __future__ import annotations

import torch

from worker.transfer import CpuTransferEngine, TransferEngine


def make_engine(device: torch.device) -> TransferEngine:
    """The engine for KV caches on ``device``: CUDA streams for a CUDA device, else threads."""
    if device.type == "cuda":
        from worker.transfer_cuda import CudaTransferEngine

        return CudaTransferEngine(device)
    return CpuTransferEngine()
