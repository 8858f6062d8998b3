"""GPU probe: the transfer engine's staged copies with and without ``host_kernels`` as the
number of chunks per transfer grows (issue 15 item 5; docs/benchmarks.md, GPU section).

bench_transfer.py submits 16 chunks per Transfer; this probe reuses its caches, chunk layout
and planning (``benchmarks.bench_transfer``) with 16, 64 and 256 chunks per Transfer, over
128 MiB, FlashAttention pages of 4, 16 and 64 KiB and cross-layer 4 KiB pages, both
directions. Reference: one pinned ``cudaMemcpy`` of the same bytes in the same round; each
figure is the median over ``--rounds`` of reference time / engine time. Needs CUDA.

Usage: python3 benchmarks/gpu_transfer_size_probe.py [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import benchmarks.bench_transfer as bt
from kvserver.arena import SharedArena
from worker.host import MappedArena
from worker.layout import canonicalize
from worker.transfer import Direction
from worker.transfer_factory import make_engine

TOTAL = 128 << 20
CASES = (("flash", 4 << 10), ("flash", 16 << 10), ("flash", 64 << 10), ("cross", 4 << 10))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    dev = torch.device("cuda")
    arena = SharedArena(TOTAL)
    mapped = MappedArena(arena.path, pin=True)
    engines = {"staged": make_engine(dev), "kernels": make_engine(dev, host_kernels=True)}
    rows = []
    try:
        for per_transfer in (16, 64, 256):
            for layout, page in CASES:
                for direction in Direction:
                    part = bt.LAYERS * 2 * page * bt.CHUNK_BLOCKS
                    chunks_n = TOTAL // part
                    blocks = chunks_n * bt.CHUNK_BLOCKS * 2
                    raw, _, _ = bt.make_caches(layout, page, blocks, dev)
                    caches = canonicalize(raw, blocks)
                    chunks = bt.Chunks.scattered(bt.CHUNK_BLOCKS, blocks, chunks_n)
                    planned = bt.plan_chunks(
                        caches, mapped, direction, chunks, "staged", per_transfer
                    )
                    nbytes = chunks_n * part
                    dev_buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
                    host_buf = mapped.tensor[:nbytes]
                    src, dst = (
                        (dev_buf, host_buf) if direction is Direction.STORE else (host_buf, dev_buf)
                    )

                    def ref(s: torch.Tensor = src, d: torch.Tensor = dst) -> None:
                        d.copy_(s, non_blocking=True)

                    fns: dict[str, Callable[[], None]] = {"ref": ref}
                    for name, engine in engines.items():
                        fns[name] = bt.engine_run(engine, direction, planned)
                    times: dict[str, list[float]] = {k: [] for k in fns}
                    for _ in range(args.rounds):
                        for name, fn in fns.items():
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            fn()
                            torch.cuda.synchronize()
                            times[name].append(time.perf_counter() - t0)
                    row: dict[str, Any] = {"chunks_per_transfer": per_transfer, "layout": layout,
                           "page_kib": page >> 10, "direction": direction.value}  # fmt: skip
                    for name in engines:
                        row[name] = statistics.median(
                            r / o for r, o in zip(times["ref"], times[name], strict=True)
                        )
                    rows.append(row)
                    print(f"{per_transfer:>4} chunks/transfer {layout:5} {page >> 10:>3}K "
                          f"{direction.value:5} staged {row['staged']:.2f} "
                          f"kernels {row['kernels']:.2f}", flush=True)  # fmt: skip
                    del raw, caches, planned, dev_buf, host_buf, src, dst, fns
    finally:
        for engine in engines.values():
            engine.close()
        mapped.close()
        arena.close()
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
