"""CPU time per chunk of the CPU transfer engine's own work, with pages too small to matter.

bench_transfer.py measures bandwidth, which on our shared 2-core machine moves by ±0.1 between
runs; this measures what the engine costs besides the bytes (planning on the worker's thread,
the copies' calls, the engine threads' bookkeeping) as CPU time, which other processes on the
machine disturb much less. The same chunks as bench_transfer.py (scattered runs of 4 blocks,
parts at scattered arena slots, 16 chunks per Transfer) with 64-byte pages, 1,536 chunks:

- ``plan``: ``plan_copies`` of every chunk (``time.thread_time`` of the planning thread);
- ``copies``: the planned copies run back to back on this thread (``engine._copy_batch``);
- ``engine``: the transfers submitted and waited for through the engine
  (``time.process_time``: this thread and the engine's).

Median over rounds, µs per chunk. Runs against older trees too (as bench_transfer.py).

Usage: python benchmarks/transfer_overhead.py [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

import torch

from benchmarks.bench_transfer import LAYOUTS, Chunks, MiB, engine_run, make_caches, plan_chunks
from kvserver.arena import SharedArena
from worker.host import MappedArena
from worker.layout import canonicalize
from worker.transfer import Direction
from worker.transfer_factory import make_engine

PAGE = 64
CHUNK_BLOCKS = 4
CHUNKS = 1536


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    arena = SharedArena(64 * MiB)
    mapped = MappedArena(arena.path, pin=False)
    engine = make_engine(torch.device("cpu"))
    rows = []
    try:
        for layout in LAYOUTS:
            for direction in Direction:
                num_blocks = CHUNKS * CHUNK_BLOCKS * 2
                raw, _, _ = make_caches(layout, PAGE, num_blocks, torch.device("cpu"))
                caches = canonicalize(raw, num_blocks)
                chunks = Chunks.scattered(CHUNK_BLOCKS, num_blocks, CHUNKS)
                times: dict[str, list[float]] = {"plan": [], "copies": [], "engine": []}
                for _ in range(args.rounds):
                    t0 = time.thread_time()
                    planned = plan_chunks(caches, mapped, direction, chunks)
                    times["plan"].append(time.thread_time() - t0)
                    copies = [c for cs in planned for kc in cs for c in kc.pairs]
                    t0 = time.thread_time()
                    engine._copy_batch(copies)
                    times["copies"].append(time.thread_time() - t0)
                    go = engine_run(engine, direction, planned)
                    t0 = time.process_time()
                    go()
                    times["engine"].append(time.process_time() - t0)
                row: dict[str, Any] = {"layout": layout, "direction": direction.value}
                row |= {k: statistics.median(v) / CHUNKS * 1e6 for k, v in times.items()}
                rows.append(row)
                print(f"{layout:11} {direction.value:5} " + " ".join(
                    f"{k}={row[k]:.2f}" for k in times
                ) + " µs/chunk")  # fmt: skip
    finally:
        engine.close()
        mapped.close()
        arena.close()
    if args.json:
        meta = {"page": PAGE, "chunk_blocks": CHUNK_BLOCKS, "chunks": CHUNKS,
                "rounds": args.rounds, "torch": torch.__version__}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
