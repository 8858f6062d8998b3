"""The CPU transfer engine: the KV caches and the host memory are both in this process's RAM.

Runs in the worker process; the interface, ordering and grouping are
:class:`~worker.transfer.TransferEngine`'s (worker/transfer.py), shared with the CUDA engine
(worker/transfer_cuda.py). The copies run synchronously on the direction's thread, so a
transfer is finished once it is marked done: runs of whole blocks with numpy
(worker/block_runs.py, neighbours that continue each other merged), plain pairs in one
``torch._foreach_copy_`` per run of them, indexed copies as one native gather or scatter.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.block_runs import BlockRun, run_block_runs
from worker.transfer import Copy, IndexedCopy, Transfer, TransferEngine


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class CpuTransferEngine(TransferEngine):
    """Copies on the direction's thread (see the module docstring). Same interface and
    ordering as the CUDA engine."""

    def _copy_context(self, transfers: list[Transfer], ctxs: list[Any]) -> Any:
        return _NullContext()

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def _copy_batch(self, copies: list[Copy]) -> None:
        # Consecutive block runs go to run_block_runs together (it merges those that continue
        # each other), runs of plain copies to one _foreach_copy_ call (its loop runs in C++).
        if set(map(type, copies)) == {BlockRun}:  # the strided plan: told in one pass in C
            run_block_runs(copies)  # type: ignore[arg-type]
            return
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        runs: list[BlockRun] = []
        for c in copies:
            if type(c) is BlockRun:
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
                    srcs, dsts = [], []
                runs.append(c)
                continue
            if runs:
                run_block_runs(runs)
                runs = []
            if isinstance(c, tuple):
                srcs.append(c[0])
                dsts.append(c[1])
                continue
            if dsts:
                torch._foreach_copy_(dsts, srcs)
                srcs, dsts = [], []
            if not isinstance(c, IndexedCopy):
                raise TypeError("staged parts go through _copy_all")
            self._copy_indexed(c)
        if runs:
            run_block_runs(runs)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _copy_indexed(self, copy: IndexedCopy) -> None:
        # One native call per gather/scatter: a memcpy per row, no Python per row.
        if copy.scatter:
            copy.dst.index_copy_(0, copy.index, copy.src)
        else:
            torch.index_select(copy.src, 0, copy.index, out=copy.dst)
