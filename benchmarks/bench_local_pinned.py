"""Round trips of a co-located client with the daemon pinned to one CPU: local channel vs ZMQ.

What it measures: the daemon (``kvserver start``) runs on one CPU (``--daemon-cpu``, every
thread it starts), this process on another (``--client-cpu``). Two KVClients of this process,
co-located (they map the arena): one on the daemon's local channel (a Unix socket), one forced
onto ZMQ (``local=False``). Each times N round trips of a cheap op (``lookup`` of one key) and
N ``prepare_store`` + ``complete_store`` pairs of one key. Three configurations:

- ``pinned``: as above, nothing else of ours on the daemon's CPU;
- ``contended``: ``--competitors`` CPU-bound processes (5 ms bursts, 0.2 ms sleeps) share the
  daemon's CPU, as other work does on a shared core (or a CPU limit without an exclusive cpuset);
- ``free``: nothing pinned (client and daemon may use every CPU).

Reference, in the same configuration: a raw AF_UNIX ping-pong (64 bytes each way, blocking
``recv``) between this process and a child process placed like the daemon: the floor a round
trip of the local channel can reach, and what the placement alone does to it. Ratios (median
over the reference's median) are against it; ">1 ms" is the share of round trips over 1 ms.

Run: ``PYTHONPATH=. python3 -m benchmarks.bench_local_pinned [--n 2000] [--configs
pinned,contended,free] [--competitors 2] [--json benchmarks/results/local_pinned.json]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.harness.daemon import RECORDED_POLICY, DaemonProc, start_daemon
from benchmarks.report import save_report
from kvserver.client import KVClient
from kvserver.namespace import NamespaceSpec


def _pin(cpu: int | None) -> None:
    os.sched_setaffinity(0, {cpu} if cpu is not None else set(range(os.cpu_count() or 1)))


@contextmanager
def _daemon(cpu: int | None, own: int | None) -> Iterator[DaemonProc]:
    """A daemon on ``cpu`` (inherited affinity: every thread it starts); this process then
    goes (back) to ``own``."""
    with tempfile.TemporaryDirectory(prefix="bench-pin-") as tmp:
        _pin(cpu)
        try:
            proc = start_daemon(
                Path(tmp), "--dram", "256MiB", "--log-level", "WARNING", *RECORDED_POLICY
            )
        finally:
            _pin(own)
        try:
            yield proc
        finally:
            proc.terminate()


def _echo(path: str, cpu: int | None) -> None:
    """The reference's server: echo every 64-byte message on one accepted connection."""
    _pin(cpu)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    conn, _ = srv.accept()
    while True:
        data = conn.recv(64, socket.MSG_WAITALL)
        if not data:
            return
        conn.sendall(data)


def _times(n: int, one: Callable[[], object]) -> list[float]:
    for _ in range(min(200, n)):  # warm-up
        one()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        one()
        out.append(time.perf_counter() - start)
    return out


def _ref_times(n: int, cpu: int | None) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="bench-pin-ref-") as tmp:
        path = str(Path(tmp) / "echo.sock")
        child = mp.get_context("fork").Process(target=_echo, args=(path, cpu), daemon=True)
        child.start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for _ in range(500):
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.01)  # the child binds; bounded by the loop
        msg = b"x" * 64

        def ping() -> None:
            sock.sendall(msg)
            sock.recv(64, socket.MSG_WAITALL)

        try:
            return _times(n, ping)
        finally:
            sock.close()
            child.join(5)


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    n = len(s) - 1
    return {"median_us": statistics.median(s) * 1e6, "p90_us": s[int(0.9 * n)] * 1e6,
            "p99_us": s[int(0.99 * n)] * 1e6,
            "over_1ms": sum(x > 1e-3 for x in s) / len(s)}  # fmt: skip


def _compete(cpu: int | None, seconds: float) -> None:
    """A competitor: CPU-bound 5 ms bursts with 0.2 ms sleeps, on ``cpu``, for ``seconds``."""
    _pin(cpu)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        while time.perf_counter() - start < 5e-3:
            pass
        time.sleep(2e-4)


@contextmanager
def _competitors(k: int, cpu: int | None) -> Iterator[None]:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_compete, args=(cpu, 600.0), daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join(5)


def _client_times(kv: KVClient, n: int) -> dict[str, list[float]]:
    spec = NamespaceSpec(model="kvserver-bench/pin", dtype="uint8", num_layers=1, num_kv_heads=1,
                         head_dim=1, block_size=16, part_bytes_override=4096)  # fmt: skip
    ns_id = kv.register_namespace(spec).ns_id
    key = os.urandom(32)

    def pair() -> None:
        grant = kv.prepare_store(ns_id, [os.urandom(32)])
        assert grant is not None
        kv.complete_store(grant.lease_id)

    return {"lookup": _times(n, lambda: kv.lookup(ns_id, [key])), "store_pair": _times(n, pair)}


def run(n: int, free: bool, client_cpu: int, daemon_cpu: int, competitors: int) -> dict[str, Any]:
    own = None if free else client_cpu
    dcpu = None if free else daemon_cpu
    _pin(own)
    rows: dict[str, Any] = {}
    with _daemon(dcpu, own) as d, _competitors(competitors, dcpu):
        rows["reference_unix_pingpong"] = _stats(_ref_times(n, dcpu))
        for name, local in (("local", True), ("zmq", False)):
            with KVClient(d.zmq_address, local=local, auth_token=d.token) as kv:
                kv.hello()
                times = _client_times(kv, n)
                if kv.is_local != local:
                    raise SystemExit(f"client {name}: is_local={kv.is_local}")
            for op, xs in times.items():
                rows[f"{name}/{op}"] = _stats(xs)
    ref = rows["reference_unix_pingpong"]["median_us"]
    for row in rows.values():
        row["ratio"] = row["median_us"] / ref
    placement = "nothing pinned" if free else f"client cpu {client_cpu}, daemon cpu {daemon_cpu}"
    return {"placement": placement, "competitors": competitors, "n": n,
            "loadavg": os.getloadavg(), "rows": rows}  # fmt: skip


CONFIGS = {"pinned": (False, 0), "contended": (False, None), "free": (True, 0)}


def write_chart(runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.6), squeeze=False)
    for ax, run_ in zip(axes[0], runs, strict=True):
        names = list(run_["rows"])
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [run_["rows"][n]["median_us"] for n in names], width=0.4,
               label="median")  # fmt: skip
        ax.bar([x + 0.2 for x in xs], [run_["rows"][n]["p99_us"] for n in names], width=0.4,
               label="p99")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [n.replace("reference_unix_pingpong", "raw unix") for n in names],
                      rotation=30, ha="right", fontsize=7)  # fmt: skip
        ax.set_title(f"{run_['config']}: {run_['placement']}", fontsize=8)
        ax.set_ylabel("µs per round trip (log)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="round trips per measure (default 2000)")
    ap.add_argument("--configs", default="pinned,contended,free",
                    help="which of pinned, contended, free (default: all three)")  # fmt: skip
    ap.add_argument(
        "--competitors",
        type=int,
        default=2,
        help="CPU-bound processes on the daemon's CPU when contended (default 2)",
    )
    ap.add_argument("--client-cpu", type=int, default=0)
    ap.add_argument("--daemon-cpu", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = []
    for config in args.configs.split(","):
        free, competitors = CONFIGS[config]
        k = args.competitors if competitors is None else competitors
        out = {"config": config, **run(args.n, free, args.client_cpu, args.daemon_cpu, k)}
        runs.append(out)
        load = ", ".join(f"{x:.2f}" for x in out["loadavg"])
        print(f"{config}: {out['placement']}; {k} competitors; n={args.n}; load {load}")
        print(f"{'measure':26} {'median µs':>10} {'p90 µs':>9} {'p99 µs':>9} {'>1 ms':>7} "
              f"{'x ref':>6}")  # fmt: skip
        for name, row in out["rows"].items():
            print(f"{name:26} {row['median_us']:10.1f} {row['p90_us']:9.1f} "
                  f"{row['p99_us']:9.1f} {row['over_1ms']:7.1%} {row['ratio']:6.2f}")  # fmt: skip
    if args.json is not None:
        save_report(args.json, {"runs": runs}, lambda png: write_chart(runs, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
