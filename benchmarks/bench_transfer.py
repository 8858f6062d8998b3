"""Transfer engine: store (KV blocks → arena) and load (arena → KV blocks) bandwidth.

Target: co-located copies should run at >= 0.8x of a plain copy of the same bytes, and
GPU↔arena copies at >= 0.8x of pinned cudaMemcpy H2D/D2H (only when a GPU is present).
Everything runs in one process, one run:

- the arena: a real kvserver ``SharedArena`` in /dev/shm, mapped as the worker maps it
  (``worker.host.MappedArena``; page-locked with cudaHostRegister on CUDA);
- KV caches on the device in three layouts: ``cross`` (one (blocks, block_bytes) tensor: the
  blocks of a chunk are consecutive bytes), ``flash`` (per layer (2, blocks, ...): K and V
  pages of a block lie apart, in LAYERS tensors, cut from one allocation: evenly spaced, so
  the CPU engine copies all layers at once, worker/block_runs.py) and ``flash-apart`` (the
  same at uneven distances: one copy per layer, as separately allocated caches may be).
  Chunks take scattered runs of consecutive blocks; parts go to scattered arena extents (one
  per part); with ``--fresh``, a prefill on a fresh arena instead: consecutive blocks, one
  chunk after the other, parts back to back (the CPU engine merges their copies);
- engine: the chunks planned as the connector plans them (``worker.layout.plan_copies``, on
  the worker's thread: checks and builds the copies' views; its cost per chunk is reported as
  ``plan_us_per_chunk``, outside ``ratio``), one Transfer per 16 chunks, all submitted, then
  waited for; timed from the first submit to the last completion. ``ratio_with_plan`` adds
  the planning time. The device's own builder (``builder``: ``strided`` on the CPU, ``staged``
  on CUDA: a gather into a device staging buffer per transfer, then one DMA per extent);
  ``alt_ratio`` is the same engine with the other builder (``alt_builder``: ``staged`` on the
  CPU, ``contiguous`` on CUDA, i.e. one ``cudaMemcpyAsync`` per page piece, the CUDA plan
  before the staged one), measured in the same rounds; ``copies`` counts the plan's entries
  for one chunk (a staged part is one); on CUDA ``host_kernels_ratio`` is the staged plan on
  an engine with ``host_kernels`` (the gather/scatter kernels address the page-locked arena
  themselves, one launch per batch instead of one DMA per extent, where the extents average
  at most ``HOST_KERNEL_MAX_PIECE``: the worker's default), and ``kernels_only_ratio`` the
  same with kernels whatever the extents' size, in the same rounds;
- reference: one ``copy_`` of the same total bytes between two contiguous, written tensors
  (CPU: plain memcpy, torch limited to ``--threads`` threads, default 1, for both sides; CUDA:
  pinned host ↔ device, the cudaMemcpy peak);
- pattern (CPU): the same pages moved by one native ``index_select`` / ``index_copy_`` over
  all chunks (no per-copy cost at all): what the scattered pages cost by themselves, a
  ceiling for any engine built from copies (the flash caches are views of one allocation so
  that one call can reach every layer).

The benchmark runs against older trees too (plan_copies without ``array``), for before/after
runs of the same benchmark.

Rounds interleave reference, engine and pattern; each ratio is the median over rounds of the
per-round ratio (the machines are shared: a ratio within one round is stable, absolute speed
is not).

Usage: python benchmarks/bench_transfer.py [--quick] [--json FILE] [--chunk-blocks N]
       [--devices cpu,cuda] [--fresh] [--layouts cross,flash,flash-apart]
With --json, also writes FILE with the .png suffix (a chart) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

import torch
from tqdm import tqdm

from kvserver.arena import SharedArena
from worker.host import MappedArena
from worker.layout import Builder, CanonicalKVCaches, canonicalize, plan_copies
from worker.transfer import MAX_GROUP, Direction, KeyCopies, Transfer, TransferEngine
from worker.transfer_factory import make_engine

MiB = 1 << 20
TARGET = 0.8
CHUNK_BLOCKS = 4  # default; --chunk-blocks
CHUNKS_PER_TRANSFER = 16
LAYERS = 4
LAYOUTS = ("cross", "flash", "flash-apart")


def make_caches(
    layout: str, page: int, num_blocks: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    """KV caches whose block holds LAYERS x 2 pages of ``page`` bytes (random bytes), the
    same memory as rows of pages (``(blocks, block_bytes)`` for ``cross``, rows of ``page``
    for the flash layouts), and the row of block 0 of each view, views in block-byte order."""
    if layout == "cross":
        t = torch.randint(0, 256, (num_blocks, LAYERS * 2 * page), dtype=torch.uint8)
        t = t.to(device)
        return {"all": t}, t, [0]
    # flash: layer i at row 2 * i * blocks; flash-apart: i (i + 1) / 2 more pages further on
    layer_rows = 2 * num_blocks
    gaps = [0] * LAYERS if layout == "flash" else [i * (i + 1) // 2 for i in range(LAYERS)]
    rows = LAYERS * layer_rows + gaps[-1]
    alloc = torch.randint(0, 256, (rows, page), dtype=torch.uint8).to(device)
    firsts = [i * layer_rows + gaps[i] for i in range(LAYERS)]
    layers = [alloc[r : r + layer_rows].view(2, num_blocks, page) for r in firsts]
    caches = {f"l{i}": t.view(torch.float16) for i, t in enumerate(layers)}  # FlashAttention
    return caches, alloc, [r + k * num_blocks for r in firsts for k in range(2)]


@dataclass
class Chunks:
    """The chunks one direction moves: scattered runs of consecutive GPU blocks, parts at
    scattered arena slots."""

    blocks: int  # GPU blocks per chunk
    starts: list[int]  # first GPU block of each chunk
    slots: list[int]  # arena slot (in parts) of each chunk

    @classmethod
    def fresh(cls, blocks: int, num_chunks: int) -> Chunks:
        """A prefill on a fresh arena: consecutive blocks, parts back to back."""
        return cls(blocks, [i * blocks for i in range(num_chunks)], list(range(num_chunks)))

    @classmethod
    def scattered(cls, blocks: int, num_blocks: int, num_chunks: int) -> Chunks:
        rng = random.Random(1)
        runs = list(range(0, num_blocks - blocks + 1, blocks))
        rng.shuffle(runs)
        slots = list(range(num_chunks))
        rng.shuffle(slots)
        return cls(blocks, runs[:num_chunks], slots)


def plan_chunks(
    caches: CanonicalKVCaches,
    arena: MappedArena,
    direction: Direction,
    chunks: Chunks,
    builder: Builder | None = None,
    per_transfer: int = CHUNKS_PER_TRANSFER,
) -> list[list[KeyCopies]]:
    """What the connector does on the worker's thread: ``plan_copies`` per chunk (with
    ``builder``; default: the device's), grouped ``per_transfer`` chunks to a Transfer."""
    is_load = direction is Direction.LOAD
    part = caches.block_bytes * chunks.blocks
    # what the connector passes: the arena as numpy (older trees: no such argument)
    takes_array = "array" in inspect.signature(plan_copies).parameters
    extra: dict[str, Any] = {"array": arena.array} if takes_array else {}
    planned = []
    for first in range(0, len(chunks.starts), per_transfer):
        copies = []
        for i in range(first, min(first + per_transfer, len(chunks.starts))):
            ids = list(range(chunks.starts[i], chunks.starts[i] + chunks.blocks))
            copies.append(plan_copies(
                caches, i.to_bytes(8, "big"), ids, chunks.blocks, arena.tensor,
                [(chunks.slots[i] * part, part)], is_load=is_load, builder=builder, **extra,
            ))  # fmt: skip
        planned.append(copies)
    return planned


def engine_run(
    engine: TransferEngine, direction: Direction, planned: list[list[KeyCopies]]
) -> Callable[[], None]:
    """Submit one Transfer per planned group, then wait for all of them."""

    def go() -> None:
        submitted = []
        for copies in planned:
            t = Transfer(direction, None, [kc.key for kc in copies], copies)
            engine.submit(t)
            submitted.append(t)
        engine.wait(submitted)
        engine.poll()

    return go


def pattern_run(
    rows: torch.Tensor, bases: list[int], arena: MappedArena, direction: Direction, chunks: Chunks
) -> Callable[[], None]:
    """The same pages in one native call between the KV ``rows`` (a block's pages at rows
    ``bases[v] + block``, see :func:`make_caches`) and a contiguous arena range, in part
    order."""
    index = torch.tensor([
        v + s + j for s in chunks.starts for j in range(chunks.blocks) for v in bases
    ])  # fmt: skip
    host = arena.tensor[: index.numel() * rows.shape[1]].view(-1, rows.shape[1])
    wide_rows, wide_host = rows.view(torch.complex128), host.view(torch.complex128)

    def store() -> None:
        torch.index_select(rows, 0, index, out=host)

    def load() -> None:
        wide_rows.index_copy_(0, index, wide_host)

    return store if direction is Direction.STORE else load


def interleaved(
    fns: list[Callable[[], None]], sync: Callable[[], None], rounds: int
) -> list[list[float]]:
    """Per function, the seconds of each round (one warm-up round first); the functions run
    back to back within a round."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds + 1):
        for i, fn in enumerate(fns):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r:
                times[i].append(time.perf_counter() - t0)
    return times


def median_ratio(ref: list[float], other: list[float]) -> float:
    return statistics.median(r / o for r, o in zip(ref, other, strict=True))


def bench(
    device: torch.device,
    quick: bool,
    chunk_blocks: int,
    max_group: int = MAX_GROUP,
    per_transfer: int = CHUNKS_PER_TRANSFER,
    fresh: bool = False,
    layouts: tuple[str, ...] = LAYOUTS,
) -> list[dict[str, Any]]:
    pages = [8 << 10, 32 << 10] if quick else [4 << 10, 16 << 10, 64 << 10]
    total = (32 if quick else 192) * MiB
    rounds = 3 if quick else 15
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows: list[dict[str, Any]] = []
    builder: Builder = "staged" if cuda else "strided"
    alt: Builder = "contiguous" if cuda else "staged"
    work = [(lay, p, d) for lay in layouts for p in pages for d in Direction]
    arena = SharedArena(total)
    mapped = MappedArena(arena.path, pin=cuda)
    engine = make_engine(device, max_group=max_group)
    kernels = make_engine(device, host_kernels=True, max_group=max_group) if cuda else None
    forced = (
        make_engine(device, host_kernels=True, host_kernel_max_piece=1 << 62, max_group=max_group)
        if cuda
        else None
    )
    try:
        for layout, page, direction in tqdm(work, desc=f"transfer ({device.type})"):
            part = LAYERS * 2 * page * chunk_blocks
            num_chunks = total // part
            num_blocks = num_chunks * chunk_blocks * 2
            raw, page_rows, bases = make_caches(layout, page, num_blocks, device)
            caches = canonicalize(raw, num_blocks)
            chunks = (
                Chunks.fresh(chunk_blocks, num_chunks)
                if fresh
                else Chunks.scattered(chunk_blocks, num_blocks, num_chunks)
            )
            nbytes = num_chunks * part
            dev_buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
            host_buf = mapped.tensor[:nbytes]
            src, dst = (dev_buf, host_buf) if direction is Direction.STORE else (host_buf, dev_buf)

            def ref(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
                dst.copy_(src, non_blocking=cuda)

            plan_s = math.inf
            for _ in range(3):  # the least of three: the first call also warms up
                t0 = time.perf_counter()
                planned = plan_chunks(caches, mapped, direction, chunks, builder, per_transfer)
                plan_s = min(plan_s, time.perf_counter() - t0)
            other = plan_chunks(caches, mapped, direction, chunks, alt, per_transfer)
            fns = [ref, engine_run(engine, direction, planned),
                   engine_run(engine, direction, other)]  # fmt: skip
            if kernels is not None and forced is not None:
                fns.append(engine_run(kernels, direction, planned))
                fns.append(engine_run(forced, direction, planned))
            else:
                fns.append(pattern_run(page_rows, bases, mapped, direction, chunks))
            times = interleaved(fns, sync, rounds)
            row = {
                "device": device.type, "layout": layout, "page_kib": page >> 10,
                "direction": direction.value, "part_kib": part >> 10, "builder": builder,
                "copies_per_chunk": len(planned[0][0].pairs), "bytes": nbytes,
                "plan_us_per_chunk": plan_s / num_chunks * 1e6,
                "engine_gbps": nbytes / statistics.median(times[1]) / 1e9,
                "reference_gbps": nbytes / statistics.median(times[0]) / 1e9,
                "ratio": median_ratio(times[0], times[1]),
                "alt_builder": alt, "alt_ratio": median_ratio(times[0], times[2]),
                "ratio_with_plan": statistics.median(times[0])
                / (statistics.median(times[1]) + plan_s),
            }  # fmt: skip
            row["host_kernels_ratio" if cuda else "pattern_ratio"] = median_ratio(
                times[0], times[3]
            )
            if cuda:
                row["kernels_only_ratio"] = median_ratio(times[0], times[4])
            rows.append(row)
            del caches, raw, page_rows, dev_buf, host_buf, src, dst, fns, planned, other
    finally:
        engine.close()
        for extra in (kernels, forced):
            if extra is not None:
                extra.close()
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
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue", label="engine")
    marked = [i for i, r in enumerate(rows) if "pattern_ratio" in r]
    if marked:
        ax.scatter(marked, [rows[i]["pattern_ratio"] for i in marked], marker="_", s=300,
                   color="black", label="pattern: the same pages in one native call")  # fmt: skip
    kern = [i for i, r in enumerate(rows) if "host_kernels_ratio" in r]
    if kern:
        ax.scatter(kern, [rows[i]["host_kernels_ratio"] for i in kern], marker="_", s=300,
                   color="tab:green", label="host_kernels engine")  # fmt: skip
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
        "--chunks-per-transfer", type=int, default=CHUNKS_PER_TRANSFER,
        help=f"chunks per Transfer (default {CHUNKS_PER_TRANSFER}; 1: a decode step's "
        "one-chunk stores, one lease per request)",
    )  # fmt: skip
    parser.add_argument(
        "--max-group", type=int, default=MAX_GROUP,
        help=f"the engines' max_group (default {MAX_GROUP}; 1: no grouping of the queued "
        "transfers, as before it)",
    )  # fmt: skip
    parser.add_argument(
        "--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu",
        help="comma-separated devices to run (default: cpu, and cuda when present)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-blocks", type=int, default=CHUNK_BLOCKS,
        help=f"GPU blocks per chunk (default {CHUNK_BLOCKS})",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads for every copy, engine and reference (default 1: the "
        "reference is a single-thread memcpy)",
    )  # fmt: skip
    parser.add_argument(
        "--fresh", action="store_true",
        help="chunks of a prefill on a fresh arena (consecutive blocks, parts back to back) "
        "instead of scattered blocks and arena slots",
    )  # fmt: skip
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS),
        help=f"comma-separated KV layouts to run (default {','.join(LAYOUTS)})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in args.devices.split(",") if d]
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        parser.error("--devices names cuda, but torch has no usable GPU")
    per_transfer = args.chunks_per_transfer
    layouts = tuple(x for x in args.layouts.split(",") if x)
    if not set(layouts) <= set(LAYOUTS):
        parser.error(f"--layouts: choose among {', '.join(LAYOUTS)}")
    rows = [
        row
        for d in devices
        for row in bench(
            d, args.quick, args.chunk_blocks, args.max_group, per_transfer, args.fresh, layouts
        )
    ]
    print(f"{'device':6} {'layout':11} {'page':>6} {'dir':5} {'builder':8} {'copies':>6} "
          f"{'plan µs':>7} {'engine GB/s':>11} {'ref GB/s':>9} {'ratio':>6} {'+plan':>6} "
          f"{'alt':>16} {'pattern':>7} {'kernels':>7} {'k-only':>6}")  # fmt: skip
    for r in rows:
        pattern = f"{r['pattern_ratio']:>7.2f}" if "pattern_ratio" in r else f"{'-':>7}"
        alt = f"{r['alt_builder']} {r['alt_ratio']:.2f}"
        kern = f"{r['host_kernels_ratio']:>7.2f}" if "host_kernels_ratio" in r else f"{'-':>7}"
        only = f"{r['kernels_only_ratio']:>6.2f}" if "kernels_only_ratio" in r else f"{'-':>6}"
        print(f"{r['device']:6} {r['layout']:11} {r['page_kib']:>5}K {r['direction']:5} "
              f"{r['builder']:8} {r['copies_per_chunk']:>6} {r['plan_us_per_chunk']:>7.1f} "
              f"{r['engine_gbps']:>11.2f} {r['reference_gbps']:>9.2f} "
              f"{r['ratio']:>6.2f} {r['ratio_with_plan']:>6.2f} {alt:>16} "
              f"{pattern} {kern} {only}")  # fmt: skip
    if args.json:
        meta = {
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "quick": args.quick, "target": TARGET, "layers": LAYERS,
            "chunk_blocks": args.chunk_blocks, "chunks_per_transfer": per_transfer,
            "max_group": args.max_group, "fresh": args.fresh, "layouts": list(layouts),
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        chart(rows, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
