"""The serving daemon's CPU per peer fetch, user and system, against raw ZMQ's sender's in the
same minutes (docs/benchmarks.md, "A's CPU per split fetch, attributed").

Only the two daemons of ``bench_peers``'s stream fetch: A (``kvserver start``, 120 MiB of
DRAM) holds three batches of 32 MiB, B (``--peers A``, 48 MiB) fetches one per
``prepare_load`` of this process (a co-located client of B), the batches in turn, so every
fetch comes from A over its peer stream into B's arena. Alternated with each fetch, a round of
``bench_peers``'s raw ZMQ reference (``benchmarks/harness/raw_zmq.py``, the same frames). The
sending side (A, the reference's helper) and the receiving side (B, this process) are placed
as ``bench_peers --placement`` does (``benchmarks/harness/placement.py``).

Reported per fetch: the wall time (median), A's and the reference sender's CPU per round
(``schedstat``, medians), and the user / system split of A, B and the reference sender over
all the rounds (``/proc/PID/stat``: the kernel samples it per tick, so only the sum over many
rounds means anything), per thread of A as well. Wall times need quiet cores; the CPU per
fetch much less so, and the user / system split shows whether a cost is Python's or the
kernel's.

Usage::

    PYTHONPATH=TREE python benchmarks/peers_sender_cpu.py [--parts 1MiB] [--fetches 100]
        [--placement split] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.daemon import RECORDED_POLICY, start_daemon
from benchmarks.harness.placement import PLACEMENTS, pin_threads, placement, spawning_on
from benchmarks.harness.proc import runtime_ms, ticks
from benchmarks.harness.raw_zmq import RawPeer
from benchmarks.peers_fleet import batch_keys, fill_holder, spec_for
from kvserver.client import KVClient
from kvserver.daemon.config_parse import parse_size

MiB = 1 << 20
BATCH_BYTES = 32 * MiB
BATCHES = 3
WARM_UP = 6


def threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """Each thread of ``pid``: (name, user ticks, system ticks)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        out[int(tid)] = (name, *ticks(pid, int(tid)))
    return out


def segments(pid: int) -> dict[str, int]:
    """TCP segments in and out so far over every TCP socket of ``pid`` (``ss -tinp``'s
    ``segs_in``, ``data_segs_in``, ...: exact counts, not samples); empty without ``ss``."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    totals: dict[str, int] = {}
    mine = False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line; its tcp_info follows, indented
            mine = f"pid={pid}," in line
        elif mine:
            for name, value in re.findall(r"\b((?:data_)?segs_(?:in|out)):(\d+)", line):
                totals[name] = totals.get(name, 0) + int(value)
    return totals


def measure(part_bytes: int, fetches: int, where: str, workdir: Path) -> dict[str, Any]:
    n = BATCH_BYTES // part_bytes
    place = placement(where, os.sched_getaffinity(0))
    pin_threads(os.getpid(), place.receiving)
    env = dict(os.environ)
    with spawning_on(place.sending):
        a = start_daemon(workdir / "a", *RECORDED_POLICY, "--dram", "120MiB", env=env)
    with spawning_on(place.receiving):
        b = start_daemon(workdir / "b", *RECORDED_POLICY, "--dram", "48MiB",
                         "--peers", a.zmq_address, env=env)  # fmt: skip
    ref: RawPeer | None = None
    spec = spec_for(part_bytes)
    batches = [batch_keys(part_bytes, i, n) for i in range(BATCHES)]
    try:
        ns_id = fill_holder(a.zmq_address, spec, batches, part_bytes)
        with spawning_on(place.sending):
            ref = RawPeer(workdir, part_bytes, n, env, 30_000)
        pin_threads(os.getpid(), place.receiving)
        with KVClient(b.zmq_address, timeout=60) as client:
            client.register_namespace(spec)

            def fetch(keys: list[bytes]) -> float:
                start = time.perf_counter()
                grant = client.prepare_load(ns_id, keys)
                elapsed = time.perf_counter() - start
                client.complete_load(grant.lease_id)
                assert len(grant.keys) == len(keys), "a fetch placed fewer chunks"
                return elapsed

            for r in range(WARM_UP):
                fetch(batches[r % BATCHES])
                ref.round()
            pids = {"a": a.proc.pid, "b": b.proc.pid, "ref_sender": ref.proc.pid}
            before = {k: ticks(pid) for k, pid in pids.items()}
            segs = {k: segments(pids[k]) for k in ("a", "ref_sender")}
            a_threads = threads(a.proc.pid)
            load = os.getloadavg()
            wall: dict[str, list[float]] = {"fetch": [], "ref": []}
            cpu: dict[str, list[float]] = {"a": [], "ref_sender": []}
            for r in range(fetches):
                ms = runtime_ms(ref.proc.pid)
                wall["ref"].append(ref.round())
                cpu["ref_sender"].append(runtime_ms(ref.proc.pid) - ms)
                ms = runtime_ms(a.proc.pid)
                wall["fetch"].append(fetch(batches[r % BATCHES]))
                cpu["a"].append(runtime_ms(a.proc.pid) - ms)
            after = {k: ticks(pid) for k, pid in pids.items()}
            segs_after = {k: segments(pids[k]) for k in ("a", "ref_sender")}
            a_after = threads(a.proc.pid)
    finally:
        if ref is not None:
            ref.close()
        a.terminate()
        b.terminate()
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK") / fetches

    def split(u0: int, s0: int, u1: int, s1: int) -> dict[str, float]:
        return {"user": (u1 - u0) * tick_ms, "sys": (s1 - s0) * tick_ms}

    per_thread = {
        f"{name} {tid}": split(u0, s0, *a_after[tid][1:])
        for tid, (name, u0, s0) in a_threads.items()
        if tid in a_after and a_after[tid][1:] != (u0, s0)
    }
    fetch_ms = statistics.median(wall["fetch"]) * 1e3
    ref_ms = statistics.median(wall["ref"]) * 1e3
    return {
        "part_bytes": part_bytes,
        "fetches": fetches,
        "placement": place.describe(),
        "load_average_before": load,
        "load_average_after": os.getloadavg(),
        "fetch_ms_median": fetch_ms,
        "reference_ms_median": ref_ms,
        "ratio": ref_ms / fetch_ms,
        "cpu_ms_median": {k: statistics.median(v) for k, v in cpu.items()},
        "user_sys_ms_per_fetch": {k: split(*before[k], *after[k]) for k in pids},
        "a_threads_user_sys_ms_per_fetch": per_thread,
        # TCP segments per fetch on the sender's sockets: data out, and in: the receiver's
        # ACKs and window updates (each processed by the sender; on loopback on its CPU)
        "segments_per_fetch": {
            k: {name: (segs_after[k][name] - n) / fetches for name, n in segs[k].items()}
            for k in segs
            if segs[k] and segs_after[k]
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="1MiB", help="part size (default 1MiB)")
    parser.add_argument("--fetches", type=int, default=100, help="timed fetches (default 100)")
    parser.add_argument("--placement", choices=PLACEMENTS, default="split")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvserver-sender-cpu-") as tmp:
        out = measure(parse_size(args.parts), args.fetches, args.placement, Path(tmp))
    us = out["user_sys_ms_per_fetch"]
    print(f"{out['part_bytes'] >> 10} KiB parts, {args.placement}, {args.fetches} fetches, load "
          f"{out['load_average_before'][0]:.2f} -> {out['load_average_after'][0]:.2f}: fetch "
          f"{out['fetch_ms_median']:.2f} ms, raw ZMQ {out['reference_ms_median']:.2f} ms "
          f"(ratio {out['ratio']:.2f})")  # fmt: skip
    for who in ("a", "ref_sender"):
        print(f"  {who:10s} CPU {out['cpu_ms_median'][who]:5.2f} ms/fetch "
              f"(user {us[who]['user']:.2f}, sys {us[who]['sys']:.2f})")  # fmt: skip
    print(f"  b          user {us['b']['user']:.2f}, sys {us['b']['sys']:.2f} ms/fetch")
    for who, row in out["segments_per_fetch"].items():
        acks = row["segs_in"] - row["data_segs_in"]
        print(f"  {who:10s} segments per fetch: out {row['segs_out']:.1f}, "
              f"in without data (ACKs, window updates) {acks:.1f}")  # fmt: skip
    for name, row in out["a_threads_user_sys_ms_per_fetch"].items():
        print(f"  A thread {name}: user {row['user']:.2f}, sys {row['sys']:.2f} ms/fetch")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
