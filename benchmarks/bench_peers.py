"""Network tier: a peer fetch through daemon B, over the peer stream and over ZMQ, against raw
ZMQ between two processes.

Target: peer fetch through another host's daemon >= 0.8x raw ZMQ between two processes.
Everything runs in one run, on loopback:

- the fleet: daemon A (``kvserver start``) holds ``BATCHES`` batches of chunks, stored with
  ``put``; two fetching daemons, each with room for about one and a half batches (so every
  batch is evicted before it is asked for again): B (``--peers A``) fetches over A's peer
  stream (plain TCP, received straight into B's arena: ``docs/wire.md`` §6), B_zmq (``--peers
  A --peer-stream-port -1``) over the ZMQ data plane, as a daemon with CURVE does.
- peer fetch: this process, a co-located client of B (and of B_zmq), calls ``prepare_load`` of
  one batch's keys (then ``complete_load``). B finds them in no local tier, asks A which it
  holds (one ``lookup local=``), fetches them in 4 MiB windows pipelined on one connection,
  checks them and places them in its arena, then grants the load. Timed: ``prepare_load``
  returning, i.e. the chunks in B's DRAM ready for the worker to read in place (the worker's
  own copy out of the arena is not part of a fetch).
- reference: raw pyzmq between two processes: a helper process (``python -m
  benchmarks.bench_peers serve``) with a ROUTER answers a DEALER request from B's stand-in
  (this process) with the same frames (the same count and sizes, sent ``copy=False`` from
  buffers it allocated in advance, received ``copy=False``), and nothing else. The work B does
  around the same bytes (the directory lookup, checks, placing in the arena, the lease) is
  the overhead the ratio shows.
- the floor (context, not the target): the same bytes moved arena pages to arena pages with
  no protocol: a helper process sends them over plain TCP out of a /dev/shm mapping of
  ``BATCHES`` batches (``sendmsg`` of the parts' views, a batch after another, as A's arena),
  and this process receives them with ``recvmsg_into`` (``MSG_WAITALL``, all parts in one
  call) straight into a /dev/shm mapping the size of B's DRAM, rotating as B's pages do. The raw ZMQ
  reference sends from and receives into buffers it reuses every round (hot in the caches);
  any fetch writes into a daemon's arena pages, which are not: ``floor_ratio`` shows what
  that alone costs against the reference.
- context (not the target): the same keys read straight from A with the client's remote
  ``get`` (one hop through kvserver's data plane), in the same rounds.

Each round runs the reference, the floor, the remote get, then both fetches (stream first in
odd rounds, ZMQ first in even ones), so all see the same machine; the figure per chunk size is
the median fetch bandwidth over the median reference bandwidth, with the per-round ratios as
the spread (and their median, ``paired_ratio_median``: each fetch round against the reference
round of the same round, which a drifting load on a shared machine disturbs less). The load
average before and after the run is in the report. Before timing, one fetched batch is read
back through each B and compared byte for byte with what was stored.

Usage: python benchmarks/bench_peers.py [--quick] [--runs N] [--json FILE]
With --json, also writes FILE with the .png suffix (chart) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import socket
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
#: the fetching daemons' DRAM (and the floor's receiving mapping).
B_DRAM = 48 * MiB
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


def start_helper(
    mode: str, workdir: Path, part_bytes: int, n: int, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], Path]:
    """The helper process of a reference (``mode``: ``serve`` or ``serve-tcp``) and the file
    where it wrote its endpoint, once written (bounded by 30 s)."""
    ep = workdir / f"{mode}-{part_bytes}-{time.monotonic_ns()}.ep"  # fresh each run
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_peers", mode, str(ep), str(part_bytes), str(n)],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
    )
    deadline = time.monotonic() + 30
    while not ep.exists() or not ep.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"reference helper ({mode}) did not start")
        time.sleep(0.02)  # waiting for the helper's endpoint, bounded by the deadline
    return proc, ep


class RawPeer:
    """The reference's two processes: the helper (ROUTER) and this one (DEALER)."""

    def __init__(self, workdir: Path, part_bytes: int, n: int, env: dict[str, str]) -> None:
        self.proc, ep = start_helper("serve", workdir, part_bytes, n, env)
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


# ----------------------------------------------------------------------------- the floor


def shm_mapping(size: int) -> mmap.mmap:
    """A prefaulted shared mapping of a /dev/shm file, like a daemon's arena (unlinked)."""
    path = f"/dev/shm/kvserver-bench-peers-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    page = b"\1" * 4096
    for off in range(0, size, len(page)):
        m[off : off + len(page)] = page
    return m


def serve_tcp(endpoint_file: str, part_bytes: int, n: int) -> int:
    """Helper process of the floor: per request byte, ``n`` parts of ``part_bytes`` sent over
    plain TCP out of a /dev/shm mapping of ``BATCHES`` batches, a batch after another (as A
    sends out of its arena), with ``sendmsg`` of the parts' views; b"s" stops it."""
    batch = n * part_bytes
    arena = memoryview(shm_mapping(BATCHES * batch))
    listener = socket.create_server(("127.0.0.1", 0))
    Path(endpoint_file).write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    r = 0
    while conn.recv(1) == b"g":
        base = (r % BATCHES) * batch
        views = [arena[base + i * part_bytes : base + (i + 1) * part_bytes] for i in range(n)]
        while views:
            sent = conn.sendmsg(views[:1024])
            while views and sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            if views and sent:
                views[0] = views[0][sent:]
        r += 1
    return 0


class RawArenaTcp:
    """The floor: the helper's plain TCP stream received with ``recvmsg_into`` (``MSG_WAITALL``,
    every part's view in one call) straight into a /dev/shm mapping the size of B's DRAM,
    rotating as B's pages do: arena pages to arena pages with no protocol at all."""

    def __init__(self, workdir: Path, part_bytes: int, n: int, env: dict[str, str]) -> None:
        self.proc, ep = start_helper("serve-tcp", workdir, part_bytes, n, env)
        self.sock = socket.create_connection(("127.0.0.1", int(ep.read_text())), 30)
        self.sock.settimeout(TIMEOUT_MS / 1000)
        self.part_bytes, self.n = part_bytes, n
        self.arena = memoryview(shm_mapping(B_DRAM))
        self.rounds = 0

    def round(self) -> float:
        size, region = self.part_bytes, B_DRAM // 3  # a batch starts a third further each time
        base = (self.rounds % 3) * region
        self.rounds += 1
        start = time.perf_counter()
        self.sock.sendall(b"g")
        views = [self.arena[(base + i * size) % B_DRAM :][:size] for i in range(self.n)]
        while views:
            got = self.sock.recvmsg_into(views[:1024], 0, socket.MSG_WAITALL)[0]
            while views and got >= views[0].nbytes:
                got -= views.pop(0).nbytes
            if views and got:
                views[0] = views[0][got:]
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.sendall(b"s")
        self.proc.wait(10)
        self.sock.close()


# ----------------------------------------------------------------------------- the fleet


def measure(workdir: Path, part_bytes: int, rounds: int, env: dict[str, str]) -> dict[str, Any]:
    n = BATCH_BYTES // part_bytes
    spec = spec_for(part_bytes)
    a = start_daemon(workdir / f"a-{part_bytes}", "--dram", f"{BATCHES * 40}MiB",
                     env=env)  # fmt: skip
    daemons: list[DaemonProc] = [a]
    ref: RawPeer | None = None
    floor: RawArenaTcp | None = None
    try:
        # B fetches over A's peer stream (the default); B_zmq is told not to (-1: ZMQ only)
        b = start_daemon(workdir / f"b-{part_bytes}", "--dram", f"{B_DRAM // MiB}MiB",
                         "--peers", a.zmq_address, env=env)  # fmt: skip
        daemons.append(b)
        bz = start_daemon(workdir / f"bz-{part_bytes}", "--dram", f"{B_DRAM // MiB}MiB", "--peers",
                          a.zmq_address, "--peer-stream-port", "-1", env=env)  # fmt: skip
        daemons.append(bz)
        batches = [batch_keys(part_bytes, i, n) for i in range(BATCHES)]
        with KVClient(a.zmq_address, colocated=False, timeout=60) as kv:
            ns_id = kv.register_namespace(spec).ns_id
            for keys in batches:
                for i in range(0, n, 8):
                    chunk = keys[i : i + 8]
                    stored = kv.put(ns_id, chunk, [payload(k, part_bytes) for k in chunk]).stored
                    assert stored == chunk, "A could not take the batch"
        ref = RawPeer(workdir, part_bytes, n, env)
        floor = RawArenaTcp(workdir, part_bytes, n, env)
        times: dict[str, list[float]] = {"stream": [], "zmq": [], "ref": [], "get": [],
                                         "floor": []}  # fmt: skip
        with (
            KVClient(b.zmq_address, timeout=60) as kv,
            KVClient(bz.zmq_address, timeout=60) as kvz,
            KVClient(a.zmq_address, colocated=False, timeout=60) as remote,
        ):
            remote.register_namespace(spec)
            for client in (kv, kvz):
                client.register_namespace(spec)
                assert client.is_colocated, "the bench must run on B's host"
                got = client.load(ns_id, batches[0])  # check once: A's bytes, through B
                assert all(bytes(row[0]) == payload(k, part_bytes) for k, row in
                           zip(batches[0], got, strict=True)), "B served other bytes"  # fmt: skip

            def fetch(client: KVClient, keys: list[bytes]) -> float:
                start = time.perf_counter()
                grant = client.prepare_load(ns_id, keys)
                elapsed = time.perf_counter() - start
                client.complete_load(grant.lease_id)
                return elapsed

            for r in range(1, rounds + 1):
                keys = batches[r % BATCHES]
                times["ref"].append(ref.round())
                times["floor"].append(floor.round())
                start = time.perf_counter()
                remote.get(ns_id, keys)  # context: one remote get straight from A
                times["get"].append(time.perf_counter() - start)
                order = [("stream", kv), ("zmq", kvz)]
                for name, client in order if r % 2 else order[::-1]:  # alternate who goes first
                    times[name].append(fetch(client, keys))
            stats, stats_z = kv.stats()["peer"], kvz.stats()["peer"]
        assert stats["stream_fetches"] == stats["fetches"] > 0, stats
        assert stats_z["stream_fetches"] == 0 and stats_z["fetched_chunks"] >= rounds * n, stats_z
    finally:
        if ref is not None:
            ref.close()
        if floor is not None:
            floor.close()
        for d in reversed(daemons):
            d.terminate()
    nbytes = n * part_bytes
    bw = {name: [nbytes / s / MiB for s in ts] for name, ts in times.items()}
    ref_med = statistics.median(bw["ref"])

    def paired(name: str) -> list[float]:
        return [f / r for f, r in zip(bw[name], bw["ref"], strict=True)]

    return {
        "name": f"peer fetch, {part_bytes // 1024} KiB parts x {n}",
        "part_bytes": part_bytes,
        "chunks_per_fetch": n,
        "rounds": rounds,
        "value_MBps": statistics.median(bw["stream"]),
        "reference_MBps": ref_med,
        "ratio": statistics.median(bw["stream"]) / ref_med,
        "round_ratios": paired("stream"),
        "paired_ratio_median": statistics.median(paired("stream")),
        "zmq_MBps": statistics.median(bw["zmq"]),
        "zmq_ratio": statistics.median(bw["zmq"]) / ref_med,
        "zmq_round_ratios": paired("zmq"),
        "zmq_paired_ratio_median": statistics.median(paired("zmq")),
        "floor_MBps": statistics.median(bw["floor"]),
        "floor_ratio": statistics.median(bw["floor"]) / ref_med,
        "stream_over_floor": statistics.median(bw["stream"]) / statistics.median(bw["floor"]),
        "remote_get_MBps": statistics.median(bw["get"]),
        "remote_get_ratio": statistics.median(bw["get"]) / ref_med,
        "fetch_ms_median": statistics.median(times["stream"]) * 1e3,
        "zmq_fetch_ms_median": statistics.median(times["zmq"]) * 1e3,
        "reference_ms_median": statistics.median(times["ref"]) * 1e3,
        "peer_stats": stats,
        "peer_stats_zmq": stats_z,
    }


def run(workdir: Path, quick: bool, env: dict[str, str]) -> dict[str, Any]:
    sizes = [1 * MiB] if quick else [256 << 10, 1 * MiB, 4 * MiB]
    rounds = 6 if quick else 25
    load_before = os.getloadavg()
    results = [measure(workdir, size, rounds, env) for size in sizes]
    return {
        "benchmark": "peers",
        "target": TARGET,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "reference": "raw ZMQ DEALER/ROUTER between two processes, same frames (copy=False)",
        "results": results,
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per chunk size, each run's ratios and their median over the runs."""
    out = []
    for rows in zip(*(r["results"] for r in runs), strict=True):
        entry: dict[str, Any] = {"name": rows[0]["name"], "part_bytes": rows[0]["part_bytes"]}
        for key in ("ratio", "paired_ratio_median", "zmq_ratio", "floor_ratio",
                    "stream_over_floor"):  # fmt: skip
            values = [row[key] for row in rows]
            entry[f"{key}_per_run"] = values
            entry[f"{key}_median"] = statistics.median(values)
        stream_over_zmq = [row["value_MBps"] / row["zmq_MBps"] for row in rows]
        entry["stream_over_zmq_per_run"] = stream_over_zmq
        entry["stream_over_zmq_median"] = statistics.median(stream_over_zmq)
        out.append(entry)
    return out


def print_table(report: dict[str, Any]) -> None:
    for n, run_report in enumerate(report["runs"], 1):
        head = f"{'case':<34} {'stream':>7} {'ZMQ':>6} {'ref':>6} {'ratio':>6} {'round range':>12}"
        print(f"\nrun {n}\n{head} {'paired':>7} {'ZMQ ratio':>10} {'floor':>6} {'get from A':>11}")
        for r in run_report["results"]:
            lo, hi = min(r["round_ratios"]), max(r["round_ratios"])
            flag = "" if r["ratio"] >= TARGET else f"  (below {TARGET})"
            print(
                f"{r['name']:<34} {r['value_MBps']:>7.0f} {r['zmq_MBps']:>6.0f} "
                f"{r['reference_MBps']:>6.0f} {r['ratio']:>6.2f} {lo:>5.2f}-{hi:<5.2f} "
                f"{r['paired_ratio_median']:>7.2f} {r['zmq_ratio']:>9.2f}x "
                f"{r['floor_ratio']:>5.2f}x {r['remote_get_ratio']:>10.2f}x{flag}"
            )
        before, after = run_report["load_average_before"], run_report["load_average_after"]
        print(f"load average before {before[0]:.2f}, after {after[0]:.2f} (1 min)")
    print(f"\nmedian over {len(report['runs'])} run(s), per run in brackets")
    print(f"{'case':<34} {'stream/ref':>11} {'ZMQ/ref':>8} {'floor/ref':>10} {'stream/ZMQ':>11}")
    for e in report["summary"]:
        runs = " ".join(f"{x:.2f}" for x in e["ratio_per_run"])
        print(
            f"{e['name']:<34} {e['ratio_median']:>11.2f} {e['zmq_ratio_median']:>8.2f} "
            f"{e['floor_ratio_median']:>10.2f} {e['stream_over_zmq_median']:>11.2f}  [{runs}]"
        )


def write_chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["summary"]
    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.9 * len(rows)))
    ys = list(range(len(rows)))
    for offset, key, label in (
        (-0.27, "ratio", "fetch through B over the peer stream"),
        (0.0, "zmq_ratio", "fetch through B over ZMQ"),
        (0.27, "floor_ratio", "floor: raw TCP, arena pages to arena pages"),
    ):
        med = [r[f"{key}_median"] for r in rows]
        spread = [
            [max(0.0, m - min(r[f"{key}_per_run"])) for m, r in zip(med, rows, strict=True)],
            [max(0.0, max(r[f"{key}_per_run"]) - m) for m, r in zip(med, rows, strict=True)],
        ]
        ax.barh([y + offset for y in ys], med, height=0.26, xerr=spread, capsize=3, label=label)
    ax.set_yticks(ys, [r["name"] for r in rows])
    ax.axvline(TARGET, color="red", linestyle="--", label=f"target {TARGET}")
    ax.set_xlabel(f"/ raw ZMQ, same run: median of {len(report['runs'])} runs (whiskers: runs)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1], int(argv[2]), int(argv[3]))
    if argv[:1] == ["serve-tcp"]:
        return serve_tcp(argv[1], int(argv[2]), int(argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one chunk size, 6 rounds")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="repeat the whole run N times (fresh daemons each); the summary "
                             "is the median over runs")  # fmt: skip
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
        runs = [run(workdir, args.quick, env) for _ in range(args.runs)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "benchmark": "peers",
        "target": TARGET,
        "reference": runs[0]["reference"],
        "runs": runs,
        "summary": summarize(runs),
    }
    print_table(report)
    if args.json is not None:
        save_report(args.json, report, lambda png: write_chart(report, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
