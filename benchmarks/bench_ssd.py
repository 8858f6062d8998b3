"""SSD tier: write-down and promotion bandwidth against ``dd`` with O_DIRECT, index rebuild time.

Target: SSD write-down / promotion bandwidth >= 0.7x of ``dd`` with O_DIRECT on the same
filesystem. Everything runs in one run on one directory (``--dir``, default a fresh directory
under /tmp):

- reference: ``dd if=/dev/zero of=DIR/dd.bin bs=CHUNK count=N oflag=direct`` (write) and
  ``dd if=DIR/dd.bin of=/dev/null bs=CHUNK iflag=direct`` (read), with the chunk's payload
  size as the block size, one dd write + read right before each timed round of the tier (this
  disk's speed drifts by 2x within a minute: interleaved, both see the same drift). If the
  filesystem refuses O_DIRECT, dd runs without it and the report says so (the tier then runs
  buffered as well).
- write-down: the real StorageEngine + SsdTier on an event loop (uvloop when installed): DRAM
  full of N chunks, one ``prepare_store`` of N new keys evicts them all; timed from that call
  until every write-back is on disk (staging copy on the loop, checksum + O_DIRECT pwrites on
  the tier's 4 threads, in jobs of several chunks). The reservation is rolled back, so no
  payload is written into DRAM. One untimed warm-up round first (a daemon reuses its staging
  buffers; dd reuses its one buffer too), then the timed rounds: the figure is the median
  bandwidth over the median dd bandwidth; the per-round ratios (tier / the dd run just before)
  are reported too, as the spread.
- promotion: ``promote`` of the N chunks back into the (now empty) DRAM tier: reads + checksum
  verification on threads, copies into the arena, completion.
- rebuild: a directory holding C chunks (written by the store directly), then the time for a
  fresh tier to open it: lock, scan one header per slot, restore the index, re-register the
  saved namespaces. C in 1k..64k (1k..16k with --quick).

Usage: python benchmarks/bench_ssd.py [--dir DIR] [--quick] [--json FILE]
With --json, also writes FILE with the .png suffix (charts) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from tqdm import tqdm

from benchmarks.report import save_report
from kvserver.daemon.tiering import SsdTier
from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig
from kvserver.namespace import NamespaceSpec
from kvserver.ssd import format as fmt
from kvserver.ssd.config import TierConfig
from kvserver.ssd.fileio import aligned_buffer
from kvserver.ssd.store import SlotStore

MiB = 1 << 20
TARGET = 0.7
PAGE = 64 << 10


def spec_for(chunk_bytes: int) -> NamespaceSpec:
    return NamespaceSpec(
        model=f"bench/{chunk_bytes}",
        dtype="bfloat16",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        part_bytes_override=chunk_bytes,
    )


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b".")[:32] for i in range(n)]


# ----------------------------------------------------------------------------- dd reference


def run_dd(argv: list[str]) -> float:
    """Run dd; returns bytes/s as dd reports it (bytes copied / its own elapsed seconds)."""
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out.stderr)
    if m is None:
        raise RuntimeError(f"cannot parse dd output: {out.stderr}")
    return int(m.group(1)) / float(m.group(2))


class DdReference:
    """dd write (oflag=direct) and read (iflag=direct) of ``count`` blocks of ``bs`` bytes, one
    round at a time, so the bench can interleave them with the tier's rounds (this disk's
    speed drifts by 2x within a minute; interleaved, both sides see the same drift)."""

    def __init__(self, directory: Path, bs: int, count: int) -> None:
        self.path, self.bs, self.count = directory / "dd.bin", bs, count
        self.direct = True
        self.writes: list[float] = []
        self.reads: list[float] = []

    def round(self) -> None:
        w = ["dd", "if=/dev/zero", f"of={self.path}", f"bs={self.bs}", f"count={self.count}"]
        r = ["dd", f"if={self.path}", "of=/dev/null", f"bs={self.bs}"]
        if self.direct:
            try:
                self.writes.append(run_dd([*w, "oflag=direct"]))
                self.reads.append(run_dd([*r, "iflag=direct"]))
                return
            except subprocess.CalledProcessError as exc:
                if "Invalid argument" not in exc.stderr:
                    raise
                self.direct = False
                print(
                    "dd: the filesystem refuses O_DIRECT; measuring dd WITHOUT oflag/iflag=direct"
                )
        self.writes.append(run_dd(w))
        self.reads.append(run_dd(r))

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the tier


async def tier_round_trip(
    directory: Path, chunk_bytes: int, count: int, repeats: int, threads: int, dd: DdReference
) -> dict[str, Any]:
    """Median write-down and promotion bandwidth of ``count`` chunks through the real tier;
    each timed round follows a round of ``dd`` (the reference)."""
    spec = spec_for(chunk_bytes)
    dram = -(-chunk_bytes // PAGE) * PAGE * count
    engine = StorageEngine(EngineConfig(dram_bytes=dram, page_size=PAGE))
    slot = fmt.slot_bytes_for(chunk_bytes)
    config = TierConfig(
        str(directory / f"tier-{chunk_bytes}"),
        capacity_bytes=2 * slot * count,
        admission=1,
        io_threads=threads,
        staging_bytes=slot * count,
    )
    tier = SsdTier(engine, config)
    await tier.open()
    engine.on_evict = tier.on_evict
    engine.register_namespace(spec)
    tier.namespaces_changed()
    await tier.wait_idle()
    source = os.urandom(chunk_bytes)
    write_s, read_s = [], []
    try:
        for r in range(repeats + 1):  # round 0 warms up (staging and read buffers, file blocks)
            if r:
                dd.round()
            old, new = keys(count, f"a{r}"), keys(count, f"b{r}")
            grant = engine.prepare_store(spec.ns_id, old)  # fill DRAM (not timed)
            assert grant is not None and len(grant.keys) == count
            for key in grant.keys:
                engine.write_part(grant.lease_id, key, 0, source)
            engine.complete_store(grant.lease_id)
            before = tier.counters.stored_chunks
            start = time.perf_counter()
            grant = engine.prepare_store(spec.ns_id, new)  # evicts all of them: write-down
            await tier.wait_idle()
            if r:
                write_s.append(time.perf_counter() - start)
            assert grant is not None and tier.counters.stored_chunks - before == count
            engine.complete_store(grant.lease_id, success=False)
            start = time.perf_counter()
            await tier.promote(spec.ns_id, old)
            if r:
                read_s.append(time.perf_counter() - start)
            assert all(engine.contains(spec.ns_id, k) for k in old), "promotion incomplete"
            lease = engine.prepare_load(spec.ns_id, old[:1]).lease_id
            assert bytes(engine.read_part(lease, old[0], 0)[0][:64]) == source[:64]
            engine.complete_load(lease)
            grant = engine.prepare_store(spec.ns_id, keys(count, f"c{r}"))  # empty DRAM again
            assert grant is not None
            engine.complete_store(grant.lease_id, success=False)
            await tier.wait_idle()
        assert tier.counters.corrupt_chunks == 0
        nbytes = chunk_bytes * count
        return {
            "io_mode": tier.store.io_mode,
            "write_Bps": nbytes / statistics.median(write_s),
            "read_Bps": nbytes / statistics.median(read_s),
            # per round: tier bandwidth / the dd run just before it
            "write_ratios": [nbytes / t / d for t, d in zip(write_s, dd.writes, strict=True)],
            "read_ratios": [nbytes / t / d for t, d in zip(read_s, dd.reads, strict=True)],
        }
    finally:
        await tier.close()
        engine.close()


# ----------------------------------------------------------------------------- rebuild


def fill_directory(directory: Path, spec: NamespaceSpec, count: int) -> None:
    """``count`` chunks written by the store itself (the fast way to make a big directory)."""
    store = SlotStore(str(directory))
    store.open()
    store.save_namespaces([spec.to_dict()])
    slot = fmt.slot_bytes_for(spec.part_bytes)

    def write(i: int) -> None:
        buf = aligned_buffer(slot)
        buf[fmt.HEADER_BYTES : fmt.HEADER_BYTES + 8] = i.to_bytes(8, "little")
        meta = fmt.ChunkHeader(spec.ns_id, keys(1, f"r{i}")[0], i + 1, slot, spec.part_bytes, 1, 0)
        store.write_chunk(slot, i, meta, buf)

    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(write, range(count)))
    finally:
        store.close()


async def time_open(directory: Path, spec: NamespaceSpec) -> tuple[float, int]:
    engine = StorageEngine(EngineConfig(dram_bytes=4 * MiB, page_size=PAGE))
    tier = SsdTier(engine, TierConfig(str(directory), capacity_bytes=64 << 30))
    start = time.perf_counter()
    await tier.open()
    seconds = time.perf_counter() - start
    recovered = tier.counters.recovered_chunks
    await tier.close()
    engine.close()
    assert spec.ns_id in engine.namespaces
    return seconds, recovered


# ----------------------------------------------------------------------------- driver


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def run(directory: Path, quick: bool) -> dict[str, Any]:
    chunk_sizes = [2 * MiB, 256 << 10]
    total = (128 if quick else 512) * MiB
    repeats = 3 if quick else 5
    rebuild_counts = [1_000, 4_000, 16_000] if quick else [1_000, 4_000, 16_000, 64_000]
    loop = new_loop()
    rows: list[dict[str, Any]] = []
    rebuild: list[dict[str, Any]] = []
    steps = len(chunk_sizes) * 2 + len(rebuild_counts)
    try:
        with tqdm(total=steps, desc="bench_ssd", unit="step") as bar:
            for chunk in chunk_sizes:
                count = total // chunk
                bar.set_postfix_str(f"dd + tier, chunk={chunk >> 10}KiB")
                dd = DdReference(directory, chunk, count)
                try:
                    ours = loop.run_until_complete(
                        tier_round_trip(directory, chunk, count, repeats, threads=4, dd=dd)
                    )
                finally:
                    dd.close()
                bar.update(2)
                ref = {
                    "write_Bps": statistics.median(dd.writes),
                    "read_Bps": statistics.median(dd.reads),
                }
                for what, key in (("write-down", "write_Bps"), ("promotion", "read_Bps")):
                    ratios = ours["write_ratios" if key == "write_Bps" else "read_ratios"]
                    rows.append(
                        {
                            "name": f"{what}, {chunk >> 10} KiB chunks",
                            "chunk_bytes": chunk,
                            "bytes": chunk * count,
                            "value_MBps": ours[key] / 1e6,
                            "reference_MBps": ref[key] / 1e6,
                            "reference": f"dd {'oflag' if key == 'write_Bps' else 'iflag'}"
                            + ("=direct" if dd.direct else " (buffered: no O_DIRECT)"),
                            "ratio": ours[key] / ref[key],
                            "round_ratios": [round(x, 3) for x in ratios],
                            "target": TARGET,
                            "io_mode": ours["io_mode"],
                        }
                    )
            spec = spec_for(4096)
            for count in rebuild_counts:
                bar.set_postfix_str(f"rebuild {count} chunks")
                target = directory / f"rebuild-{count}"
                fill_directory(target, spec, count)
                seconds, recovered = loop.run_until_complete(time_open(target, spec))
                assert recovered == count, (recovered, count)
                rebuild.append(
                    {"chunks": count, "seconds": seconds, "us_per_chunk": seconds / count * 1e6}
                )
                shutil.rmtree(target)
                bar.update()
    finally:
        loop.close()
    return {
        "dir": str(directory),
        "filesystem": filesystem(directory),
        "results": rows,
        "rebuild": rebuild,
    }


def filesystem(directory: Path) -> str:
    try:
        out = subprocess.run(
            ["findmnt", "-n", "-o", "FSTYPE", "-T", str(directory)], capture_output=True, text=True
        )
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def print_table(report: dict[str, Any]) -> None:
    print(f"directory {report['dir']} ({report['filesystem']})")
    print(f"{'what':<32} {'MB/s':>9} {'dd MB/s':>9} {'ratio':>7} {'per round':>11}  reference")
    for r in report["results"]:
        flag = "" if r["ratio"] >= r["target"] else "  (< target)"
        spread = f"{min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f}"
        print(
            f"{r['name']:<32} {r['value_MBps']:>9.0f} {r['reference_MBps']:>9.0f} "
            f"{r['ratio']:>7.2f} {spread:>11}  {r['reference']}, tier {r['io_mode']}{flag}"
        )
    print(f"\n{'index rebuild: chunks':<24} {'seconds':>9} {'us/chunk':>9}")
    for r in report["rebuild"]:
        print(f"{r['chunks']:<24} {r['seconds']:>9.3f} {r['us_per_chunk']:>9.1f}")


def write_chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = report["results"]
    spread = [
        [max(0.0, r["ratio"] - min(r["round_ratios"])) for r in rows],
        [max(0.0, max(r["round_ratios"]) - r["ratio"]) for r in rows],
    ]
    left.barh([r["name"] for r in rows], [r["ratio"] for r in rows], xerr=spread, capsize=3)
    left.axvline(TARGET, color="red", linestyle="--", label=f"target {TARGET}")
    left.set_xlabel("bandwidth / dd O_DIRECT (same run; whiskers: per-round range)")
    left.legend(loc="lower right")
    for y, r in enumerate(rows):
        left.annotate(
            f"{r['ratio']:.2f}",
            (0.02, y),
            color="white",
            fontweight="bold",
            va="center",
        )
    counts = [r["chunks"] for r in report["rebuild"]]
    right.plot(counts, [r["seconds"] for r in report["rebuild"]], marker="o")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("chunks on disk")
    right.set_ylabel("index rebuild (s)")
    right.set_title("restart: header scan + index restore")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="directory on the filesystem to measure")
    parser.add_argument("--quick", action="store_true", help="128 MiB per case, 3 runs")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON here")
    args = parser.parse_args(argv)
    cleanup: Callable[[], None] = lambda: None  # noqa: E731
    if args.dir is None:
        directory = Path(tempfile.mkdtemp(prefix="kvserver-bench-ssd-", dir="/tmp"))
        cleanup = lambda: shutil.rmtree(directory, ignore_errors=True)  # noqa: E731
    else:
        directory = args.dir
        directory.mkdir(parents=True, exist_ok=True)
    try:
        report = run(directory, args.quick)
    finally:
        cleanup()
    print_table(report)
    if args.json is not None:
        save_report(args.json, report, lambda png: write_chart(report, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
