"""Transfer engine: store (KV blocks → arena) and load (arena → KV blocks) bandwidth.

DESIGN.md §5: co-located copies should run at >= 0.8x of a plain copy of the same bytes, and
GPU↔arena copies at >= 0.8x of pinned cudaMemcpy H2D/D2H (only when a GPU is present).
Everything runs in one process, one run:

- the arena: a real kvserver ``SharedArena`` in /dev/shm, mapped as the worker maps it
  (``worker.host.MappedArena``; page-locked with cudaHostRegister on CUDA);
- KV caches on the device in two layouts: ``cross`` (one (blocks, block_bytes) tensor: a chunk
  of consecutive blocks is one copy) and ``flash`` (per layer (2, blocks, ...): one copy per
  block, layer and K/V page). Parts go to scattered arena extents (one per part);
- engine: the real ``TransferEngine`` (threads on CPU, streams + events on CUDA) running the
  copies planned by ``worker.layout.plan_copies``, one Transfer per 16 chunks, all submitted,
  then waited for; timed from the first submit to the last completion;
- reference: one ``copy_`` of the same total bytes between two contiguous tensors (CPU:
  plain memcpy, torch limited to ``--threads`` threads, default 1, for both sides; CUDA:
  pinned host ↔ device, the cudaMemcpy peak).

Usage: python benchmarks/bench_transfer.py [--quick] [--json FILE]
With --json, also writes FILE with the .png suffix (a chart) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

import torch
from tqdm import tqdm

from kvserver.arena import SharedArena
from worker.host import MappedArena
from worker.layout import CanonicalKVCaches, canonicalize, plan_copies
from worker.transfer import Direction, Transfer, TransferEngine, make_engine

MiB = 1 << 20
TARGET = 0.8
CHUNK_BLOCKS = 4
CHUNKS_PER_TRANSFER = 16
LAYERS = 4


def make_caches(layout: str, page: int, num_blocks: int, device: torch.device) -> Any:
    """KV caches whose block holds LAYERS x 2 pages of ``page`` bytes."""
    if layout == "cross":
        t = torch.zeros((num_blocks, LAYERS * 2 * page), dtype=torch.uint8, device=device)
        return {"all": t}
    return {
        f"l{i}": torch.zeros((2, num_blocks, page // 2), dtype=torch.float16, device=device)
        for i in range(LAYERS)
    }


def timed(fn: Callable[[], None], sync: Callable[[], None], rounds: int) -> float:
    """Median seconds of ``rounds`` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_engine(
    engine: TransferEngine,
    caches: CanonicalKVCaches,
    arena: MappedArena,
    direction: Direction,
    num_chunks: int,
    part_bytes: int,
) -> Callable[[], None]:
    rng = random.Random(1)
    blocks = list(range(caches.num_blocks))
    rng.shuffle(blocks)  # chunks of scattered blocks; consecutive within a chunk
    starts = [b - b % CHUNK_BLOCKS for b in blocks[:num_chunks]]
    slots = list(range(num_chunks))
    rng.shuffle(slots)  # parts at scattered arena offsets
    is_load = direction is Direction.LOAD
    transfers: list[list[Any]] = []
    for first in range(0, num_chunks, CHUNKS_PER_TRANSFER):
        keys = []
        for i in range(first, min(first + CHUNKS_PER_TRANSFER, num_chunks)):
            ids = list(range(starts[i], starts[i] + CHUNK_BLOCKS))
            ext = [(slots[i] * part_bytes, part_bytes)]
            key = i.to_bytes(8, "big")
            tensor = arena.tensor
            keys.append(plan_copies(caches, key, ids, CHUNK_BLOCKS, tensor, ext, is_load=is_load))
        transfers.append(keys)

    def go() -> None:
        submitted = []
        for copies in transfers:
            t = Transfer(direction, None, [kc.key for kc in copies], copies)
            engine.submit(t)
            submitted.append(t)
        engine.wait(submitted)
        engine.poll()

    return go


def bench(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    pages = [8 << 10, 32 << 10] if quick else [4 << 10, 16 << 10, 64 << 10]
    total = (32 if quick else 192) * MiB
    rounds = 3 if quick else 5
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows: list[dict[str, Any]] = []
    work = [(lay, p, d) for lay in ("cross", "flash") for p in pages for d in Direction]
    arena = SharedArena(total)
    mapped = MappedArena(arena.path, pin=cuda)
    engine = make_engine(device)
    try:
        for layout, page, direction in tqdm(work, desc=f"transfer ({device.type})"):
            block_bytes = LAYERS * 2 * page
            part = block_bytes * CHUNK_BLOCKS
            num_chunks = total // part
            caches = canonicalize(
                make_caches(layout, page, num_chunks * CHUNK_BLOCKS * 2, device),
                num_chunks * CHUNK_BLOCKS * 2,
            )
            go = run_engine(engine, caches, mapped, direction, num_chunks, part)
            t_engine = timed(go, sync, rounds)
            nbytes = num_chunks * part
            dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            host_buf = mapped.tensor[:nbytes]
            src, dst = (dev_buf, host_buf) if direction is Direction.STORE else (host_buf, dev_buf)

            def ref(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
                dst.copy_(src, non_blocking=cuda)

            t_ref = timed(ref, sync, rounds)
            rows.append({
                "device": device.type, "layout": layout, "page_kib": page >> 10,
                "direction": direction.value, "part_kib": part >> 10,
                "copies_per_chunk": len(caches.segments(list(range(CHUNK_BLOCKS)))),
                "bytes": nbytes,
                "engine_gbps": nbytes / t_engine / 1e9, "reference_gbps": nbytes / t_ref / 1e9,
                "ratio": t_ref / t_engine,
            })  # fmt: skip
            del caches, dev_buf, host_buf, src, dst
    finally:
        engine.close()
        mapped.close()
        arena.close()
    return rows


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['device']}\n{r['layout']} {r['page_kib']}K\n{r['direction']}" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
    ax.axhline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET}x")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("engine / plain copy bandwidth")
    ax.set_title("Transfer engine vs copy_ of the same bytes (CPU) / pinned cudaMemcpy (GPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, less data")
    parser.add_argument("--json", type=Path, help="write results here (+ .png chart)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads for every copy, engine and reference (default 1: the "
        "reference is a single-thread memcpy, DESIGN.md §5)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    rows = [row for d in devices for row in bench(d, args.quick)]
    print(f"{'device':6} {'layout':6} {'page':>6} {'dir':5} {'copies':>6} "
          f"{'engine GB/s':>11} {'ref GB/s':>9} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['device']:6} {r['layout']:6} {r['page_kib']:>5}K {r['direction']:5} "
              f"{r['copies_per_chunk']:>6} {r['engine_gbps']:>11.2f} {r['reference_gbps']:>9.2f} "
              f"{r['ratio']:>6.2f}")  # fmt: skip
    if args.json:
        meta = {
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "quick": args.quick, "target": TARGET, "layers": LAYERS,
            "chunk_blocks": CHUNK_BLOCKS, "chunks_per_transfer": CHUNKS_PER_TRANSFER,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        chart(rows, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
