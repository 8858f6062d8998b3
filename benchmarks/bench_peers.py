"""Network tier: a peer fetch through daemon B against raw ZMQ between two processes.

Target: peer fetch through another host's daemon >= 0.8x raw ZMQ between two processes.
Everything runs in one run, on loopback:

- the fleet: daemon A (``kvserver start``) holds ``BATCHES`` batches of chunks, stored with
  ``put``; daemon B (``kvserver start --peers A``) holds none of them and has room for about
  one and a half batches, so every batch is evicted from B before it is asked for again.
- peer fetch: this process, a co-located client of B, calls ``prepare_load`` of one batch's
  keys on B (then ``complete_load``). B finds them in no local tier, asks A which it holds
  (one ``lookup local=``), fetches them (one ``get leading=``: the parts as ZMQ frames), checks
  them and copies them into its arena, then grants the load. Timed: ``prepare_load`` returning,
  i.e. the chunks in B's DRAM ready for the worker to read in place (the worker's own copy out
  of the arena is not part of a fetch).
- reference: raw pyzmq between two processes: a helper process (``python -m
  benchmarks.bench_peers serve``) with a ROUTER answers a DEALER request from B's stand-in
  (this process) with the same frames (the same count and sizes, sent ``copy=False`` from
  buffers it allocated in advance, received ``copy=False``), and nothing else. The work B does
  around the same bytes (the directory lookup, checks, the copy into the arena, the lease) is
  the overhead the ratio shows.
- context (not the target): the same keys read straight from A with the client's remote
  ``get`` (one hop through kvserver's data plane), in the same rounds: what a fetch costs on
  top of the remote path it is built on.

The two are measured in alternation (reference round, fetch round, ...) so both see the same
machine; the figure per chunk size is the median fetch bandwidth over the median reference
bandwidth, with the per-round ratios as the spread (and their median, ``paired_ratio_median``:
each fetch round against the reference round just before it, which a drifting load on a shared
machine disturbs less). Before timing, one fetched batch is read back through B and compared
byte for byte with what was stored.

Usage: python benchmarks/bench_peers.py [--quick] [--json FILE]
With --json, also writes FILE with the .png suffix (chart) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

import zmq

from benchmarks.harness.daemon import DaemonProc, start_daemon
from benchmarks.report import save_report
from kvserver.client import KVClient
from kvserver.daemon.malloc import MALLOC_ENV, tune_malloc
from kvserver.namespace import NamespaceSpec

MiB = 1 << 20
TARGET = 0.8
BATCH_BYTES = 32 * MiB
BATCHES = 3
TIMEOUT_MS = 30_000


def spec_for(part_bytes: int) -> NamespaceSpec:
    return NamespaceSpec(
        model=f"bench/peers-{part_bytes}",
        dtype="bfloat16",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        part_bytes_override=part_bytes,
    )


def batch_keys(part_bytes: int, batch: int, n: int) -> list[bytes]:
    return [f"{part_bytes}-{batch}-{i}".encode().ljust(32, b".")[:32] for i in range(n)]


def payload(key: bytes, nbytes: int) -> bytes:
    return (key * (nbytes // len(key) + 1))[:nbytes]


# ----------------------------------------------------------------------------- reference


def serve(endpoint_file: str, part_bytes: int, n: int) -> int:
    """Helper process: a ROUTER answering every request with ``n`` frames of ``part_bytes``."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    frames = [bytearray(payload(b"ref%d" % i, part_bytes)) for i in range(n)]
    Path(endpoint_file).write_text(f"tcp://127.0.0.1:{port}")
    while True:
        ident, request = router.recv_multipart(copy=False)
        if request.bytes == b"stop":
            return 0
        router.send_multipart([ident.bytes, b"header", *frames], copy=False)


class RawPeer:
    """The reference's two processes: the helper (ROUTER) and this one (DEALER)."""

    def __init__(self, workdir: Path, part_bytes: int, n: int, env: dict[str, str]) -> None:
        ep = workdir / f"ref-{part_bytes}.ep"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_peers", "serve", str(ep),
             str(part_bytes), str(n)],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not ep.exists() or not ep.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("reference peer did not start")
            time.sleep(0.02)  # waiting for the helper's endpoint, bounded by the deadline
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        self.dealer.connect(ep.read_text())
        self.n = n

    def round(self) -> float:
        start = time.perf_counter()
        self.dealer.send(b"get")
        frames = self.dealer.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
        assert len(frames) == self.n + 1
        return elapsed

    def close(self) -> None:
        self.dealer.send(b"stop")
        self.proc.wait(10)
        self.dealer.close()
        self.ctx.term()


# ----------------------------------------------------------------------------- the fleet


def measure(workdir: Path, part_bytes: int, rounds: int, env: dict[str, str]) -> dict[str, Any]:
    n = BATCH_BYTES // part_bytes
    spec = spec_for(part_bytes)
    a = start_daemon(workdir / f"a-{part_bytes}", "--dram", f"{BATCHES * 40}MiB",
                     env=env)  # fmt: skip
    b: DaemonProc | None = None
    ref: RawPeer | None = None
    try:
        b = start_daemon(workdir / f"b-{part_bytes}", "--dram", "48MiB",
                         "--peers", a.zmq_address, env=env)  # fmt: skip
        batches = [batch_keys(part_bytes, i, n) for i in range(BATCHES)]
        with KVClient(a.zmq_address, colocated=False, timeout=60) as kv:
            ns_id = kv.register_namespace(spec).ns_id
            for keys in batches:
                for i in range(0, n, 8):
                    chunk = keys[i : i + 8]
                    stored = kv.put(ns_id, chunk, [payload(k, part_bytes) for k in chunk]).stored
                    assert stored == chunk, "A could not take the batch"
        ref = RawPeer(workdir, part_bytes, n, env)
        fetch_s: list[float] = []
        ref_s: list[float] = []
        get_s: list[float] = []
        with (
            KVClient(b.zmq_address, timeout=60) as kv,
            KVClient(a.zmq_address, colocated=False, timeout=60) as remote,
        ):
            remote.register_namespace(spec)
            kv.register_namespace(spec)
            assert kv.is_colocated, "the bench must run on B's host"
            got = kv.load(ns_id, batches[0])  # check once: the bytes A holds, through B
            assert all(bytes(row[0]) == payload(k, part_bytes) for k, row in
                       zip(batches[0], got, strict=True)), "B served other bytes"  # fmt: skip
            for r in range(1, rounds + 1):
                ref_s.append(ref.round())
                keys = batches[r % BATCHES]
                start = time.perf_counter()
                remote.get(ns_id, keys)  # context: one remote get straight from A
                get_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                grant = kv.prepare_load(ns_id, keys)
                fetch_s.append(time.perf_counter() - start)
                kv.complete_load(grant.lease_id)
            stats = kv.stats()["peer"]
        assert stats["fetched_chunks"] >= rounds * n, stats
    finally:
        if ref is not None:
            ref.close()
        for d in (b, a):
            if d is not None:
                d.terminate()
    nbytes = n * part_bytes
    fetch_bw = [nbytes / s / MiB for s in fetch_s]
    ref_bw = [nbytes / s / MiB for s in ref_s]
    get_bw = [nbytes / s / MiB for s in get_s]
    return {
        "name": f"peer fetch, {part_bytes // 1024} KiB parts x {n}",
        "part_bytes": part_bytes,
        "chunks_per_fetch": n,
        "rounds": rounds,
        "value_MBps": statistics.median(fetch_bw),
        "reference_MBps": statistics.median(ref_bw),
        "ratio": statistics.median(fetch_bw) / statistics.median(ref_bw),
        "round_ratios": [f / r for f, r in zip(fetch_bw, ref_bw, strict=True)],
        "paired_ratio_median": statistics.median(
            f / r for f, r in zip(fetch_bw, ref_bw, strict=True)
        ),
        "remote_get_MBps": statistics.median(get_bw),
        "remote_get_ratio": statistics.median(get_bw) / statistics.median(ref_bw),
        "fetch_ms_median": statistics.median(fetch_s) * 1e3,
        "reference_ms_median": statistics.median(ref_s) * 1e3,
        "peer_stats": stats,
    }


def run(workdir: Path, quick: bool, env: dict[str, str]) -> dict[str, Any]:
    sizes = [1 * MiB] if quick else [256 << 10, 1 * MiB, 4 * MiB]
    rounds = 6 if quick else 25
    results = [measure(workdir, size, rounds, env) for size in sizes]
    return {
        "benchmark": "peers",
        "target": TARGET,
        "reference": "raw ZMQ DEALER/ROUTER between two processes, same frames (copy=False)",
        "results": results,
    }


def print_table(report: dict[str, Any]) -> None:
    head = f"{'case':<34} {'MB/s':>8} {'ref MB/s':>9} {'ratio':>6} {'round range':>12}"
    print(f"\n{head} {'paired':>7} {'get from A':>11}")
    for r in report["results"]:
        lo, hi = min(r["round_ratios"]), max(r["round_ratios"])
        flag = "" if r["ratio"] >= TARGET else f"  (below {TARGET})"
        print(
            f"{r['name']:<34} {r['value_MBps']:>8.0f} {r['reference_MBps']:>9.0f} "
            f"{r['ratio']:>6.2f} {lo:>5.2f}-{hi:<5.2f} {r['paired_ratio_median']:>7.2f} "
            f"{r['remote_get_ratio']:>10.2f}x{flag}"
        )


def write_chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["results"]
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.6 * len(rows)))
    spread = [
        [max(0.0, r["ratio"] - min(r["round_ratios"])) for r in rows],
        [max(0.0, max(r["round_ratios"]) - r["ratio"]) for r in rows],
    ]
    ax.barh([r["name"] for r in rows], [r["ratio"] for r in rows], xerr=spread, capsize=3)
    ax.axvline(TARGET, color="red", linestyle="--", label=f"target {TARGET}")
    ax.set_xlabel("fetch through B / raw ZMQ, same run (whiskers: per-round range)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1], int(argv[2]), int(argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one chunk size, 6 rounds")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON here")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave every process on glibc's allocator defaults")  # fmt: skip
    args = parser.parse_args(argv)
    env = dict(os.environ)
    if not args.default_malloc:
        env.update(MALLOC_ENV)
        tune_malloc()  # this process receives the reference's frames: tuned as B is
    workdir = Path(tempfile.mkdtemp(prefix="kvserver-bench-peers-", dir="/tmp"))
    try:
        report = run(workdir, args.quick, env)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(report)
    if args.json is not None:
        save_report(args.json, report, lambda png: write_chart(report, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
