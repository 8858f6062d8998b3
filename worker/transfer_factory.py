"""Which transfer engine a worker uses: :func:`make_engine` picks one by device.

A module of its own so that the engines' modules import one way: worker/transfer_cuda.py builds
on worker/transfer.py, and only this module knows both. Runs in the worker process.
"""

from __future__ import annotations

import torch

from worker.staging import HOST_KERNEL_MAX_PIECE
from worker.transfer import MAX_GROUP, TransferEngine
from worker.transfer_cpu import CpuTransferEngine


def make_engine(
    device: torch.device,
    *,
    host_kernels: bool = False,
    host_kernel_max_piece: int = HOST_KERNEL_MAX_PIECE,
    max_group: int = MAX_GROUP,
) -> TransferEngine:
    """The engine for KV caches on ``device``: CUDA streams for a CUDA device, else threads.
    ``host_kernels`` (CUDA only here: the CPU engine's default strided copies need no
    staging), ``host_kernel_max_piece``, ``max_group``: see
    :class:`~worker.transfer.TransferEngine`."""
    if device.type == "cuda":
        from worker.transfer_cuda import CudaTransferEngine

        return CudaTransferEngine(
            device,
            host_kernels=host_kernels,
            host_kernel_max_piece=host_kernel_max_piece,
            max_group=max_group,
        )
    return CpuTransferEngine(max_group=max_group)
