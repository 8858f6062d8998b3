"""Instructions per chunk of the CPU transfer engine's own work, counted by callgrind in one
process: what the engine costs besides the bytes, which the load of a shared machine does not
move (docs/benchmarks.md, "Worker transfer engine vs memcpy (CPU)").

Usage (PYTHONPATH selects the tree measured; to measure an older tree, copy this file into its
benchmarks/ first)::

    PYTHONPATH=TREE python -m benchmarks.transfer_instructions [--reps 10]
    PYTHONPATH=TREE python -m benchmarks.transfer_instructions --wall     # no valgrind: µs/chunk

The chunks of ``bench_transfer.py`` (scattered runs of 4 blocks, parts at scattered arena
slots) with 64-byte pages, so that the bytes cost nothing, store direction, 256 chunks; per
layout (``cross``, ``flash``: per-layer caches cut from one allocation, ``flash-apart``) the
kinds:

- ``plan``: ``plan_copies`` of every chunk (the worker's thread);
- ``engine``: 16 chunks per Transfer, all submitted, then waited for and polled through the
  engine (the worker's thread and the engine's: callgrind counts both);
- ``decode``: the same through the engine with one chunk per Transfer (a decode step's stores,
  one lease per request): what each transfer costs besides its chunk.

Prints instructions per chunk of each kind. The objects made before the kinds are frozen out of
the garbage collector (``gc.freeze``), so that the first kind does not pay a full collection
over the imports.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.callgrind import dump, dump_name, per_call, run_measured

LAYOUTS = ("cross", "flash", "flash-apart")
STEPS = ("plan", "engine", "decode")
KINDS = tuple(f"{layout} {step}" for layout in LAYOUTS for step in STEPS)
PAGE = 64
CHUNK_BLOCKS = 4
CHUNKS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="rounds of each kind (default 10)")
    parser.add_argument("--wall", action="store_true", help="no valgrind: wall µs per chunk")
    parser.add_argument("--out", type=Path, help="callgrind files here (default: a temp dir)")
    parser.add_argument("--measured", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.wall:
        for kind, seconds in run_kinds(args.reps, None).items():
            print(f"{kind:20s} {seconds / args.reps / CHUNKS * 1e6:7.2f} us/chunk")
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="kvserver-callgrind-"))
    if args.measured:
        run_kinds(args.reps, out)
        return
    run_measured(out, "transfer", "benchmarks.transfer_instructions", [
        "--measured",
        "--reps", str(args.reps), "--out", str(out),
    ])  # fmt: skip
    print(f"tree: {os.environ.get('PYTHONPATH', '(installed)')}; callgrind files in {out}")
    for kind, ir in per_call(out, "transfer.*.*", KINDS).items():
        print(f"{kind:20s} {ir / CHUNKS / 1e3:8.2f} k instructions/chunk")


def run_kinds(reps: int, out: Path | None) -> dict[str, float]:
    """Run every kind ``reps`` times; dump callgrind's counters after each (``out``); return
    the wall seconds per kind."""
    import torch

    from benchmarks.bench_transfer import Chunks, engine_run, make_caches, plan_chunks
    from kvserver.arena import SharedArena
    from worker.host import MappedArena
    from worker.layout import CanonicalKVCaches, canonicalize
    from worker.transfer import Direction
    from worker.transfer_factory import make_engine

    torch.set_num_threads(1)
    if out is not None:
        # Under valgrind every thread runs ~50x slower, so the 5 ms GIL switch interval would
        # hand the GIL to the engine's thread in the middle of a burst of submits (groups of a
        # few transfers, each with its wake-up) where a native run submits the whole burst
        # first: no forced switches, the threads hand over where they block, as natively.
        sys.setswitchinterval(10.0)
    store = Direction.STORE
    num_blocks = CHUNKS * CHUNK_BLOCKS * 2
    arena = SharedArena(8 << 20)
    mapped = MappedArena(arena.path, pin=False)
    engine = make_engine(torch.device("cpu"))
    seconds: dict[str, float] = {}
    try:
        for layout in LAYOUTS:
            raw, _, _ = make_caches(layout, PAGE, num_blocks, torch.device("cpu"))
            caches = canonicalize(raw, num_blocks)
            chunks = Chunks.scattered(CHUNK_BLOCKS, num_blocks, CHUNKS)

            def plan(caches: CanonicalKVCaches = caches, chunks: Chunks = chunks) -> None:
                plan_chunks(caches, mapped, store, chunks)

            planned = plan_chunks(caches, mapped, store, chunks)
            singles = plan_chunks(caches, mapped, store, chunks, per_transfer=1)
            fns: dict[str, Callable[[], None]] = {
                "plan": plan, "engine": engine_run(engine, store, planned),
                "decode": engine_run(engine, store, singles),
            }  # fmt: skip
            for fn in fns.values():  # warm-up
                fn()
            gc.collect()
            gc.freeze()  # the process's older objects: no kind pays for traversing them
            dump(out, "warm-up")
            for step, fn in fns.items():
                kind = f"{layout} {step}"
                start = time.perf_counter()
                for _ in range(reps):
                    fn()
                seconds[kind] = time.perf_counter() - start
                dump(out, dump_name(KINDS.index(kind), reps))
            assert engine.num_inflight == 0
    finally:
        engine.close()
        mapped.close()
        arena.close()
    return seconds


if __name__ == "__main__":
    main()
