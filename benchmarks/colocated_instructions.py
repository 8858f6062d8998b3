"""Instructions per co-located batch of ``kvserver bench`` (store + load over the local channel),
step by step, counted by callgrind in the daemon and in the client: what the co-located round
costs besides its copies, which the load of a shared machine does not move (docs/benchmarks.md,
"Daemon data plane and Lookup").

Usage (PYTHONPATH selects the tree measured, daemon and client; to measure an older tree, copy
this file into its benchmarks/ first)::

    PYTHONPATH=TREE python -m benchmarks.colocated_instructions [--rounds 3] [--sizes 256KiB]

Runs in its own processes: this one starts the client under ``valgrind --tool=callgrind`` (itself
again, with ``--client``); the client starts ``kvserver start`` under callgrind too (the bench's
daemon: ``--policy`` the bench's default, ``chain``, unless given; DRAM 256 MiB, so that after
the warm-up every batch evicts as many chunks as it stores, as in the bench once its warm-up
has cycled the arena), then runs ``--rounds`` rounds of
``benchmarks.bench_daemon._colocated_round`` per size (64 MiB per batch) with
``callgrind_control --dump`` in both processes after each step: ``prepare_store``, the
writes (one ``KVClient.write`` per part), ``complete_store``, ``prepare_load``, the reads (one
``readinto`` per part), ``complete_load``. A step's figure is the mean over the rounds, less an
empty step's (two dumps back to back: what a dump itself costs). ``memcpy`` is the bench's
reference round (``daemon_refs.memcpy_round``) counted the same way, in the client only.
Prints instructions per batch and per chunk for each step and process. Needs valgrind; takes
~2-4 minutes.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.bench_daemon import DEFAULT_POLICY
from benchmarks.harness.callgrind import daemon_ready, run_measured

if TYPE_CHECKING:
    from kvserver.client import KVClient

STEPS = (
    "prepare_store", "writes", "complete_store", "prepare_load", "reads", "complete_load",
)  # fmt: skip
BATCH_BYTES = 64 << 20
DRAM = "256MiB"
START_TIMEOUT_S = 300.0
_TRIGGER = re.compile(r"^desc: Trigger: .*step:(.+?)\s*$", re.M)
_SUMMARY = re.compile(r"^summary: (\d+)$", re.M)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per size (default 3)")
    parser.add_argument("--sizes", default="256KiB,2MiB,8MiB", help="part sizes")
    parser.add_argument("--out", type=Path, help="callgrind files here (default: a temp dir)")
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"the daemon's (default {DEFAULT_POLICY})",
    )
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from kvserver.daemon.config_parse import parse_size

    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    out = args.out or Path(tempfile.mkdtemp(prefix="kvserver-callgrind-"))
    if args.client:
        _client(sizes, args.rounds, out, args.policy)
        return
    run_measured(out, "client", "benchmarks.colocated_instructions", [
        "--client", "--rounds", str(args.rounds), "--sizes", args.sizes, "--out", str(out),
        "--policy", args.policy,
    ])  # fmt: skip
    print(f"tree: {os.environ.get('PYTHONPATH', '(installed)')}; policy {args.policy}; "
          f"callgrind files in {out}")  # fmt: skip
    totals = {who: _sums(out, f"{who}.*.*") for who in ("daemon", "client")}
    rounds = args.rounds
    for size in sizes:
        n = max(1, BATCH_BYTES // size)
        print(f"{size >> 10} KiB x {n}: M instructions per batch (k per chunk)")
        for who in ("daemon", "client"):
            sums = totals[who]
            empty = sums.get(f"{size}:empty", 0) / rounds
            row = {s: sums.get(f"{size}:{s}", 0) / rounds - empty for s in STEPS}
            cells = "  ".join(f"{s} {v / 1e6:.3f} ({v / n / 1e3:.1f})" for s, v in row.items())
            print(f"  {who:6s} total {sum(row.values()) / 1e6:7.3f}  {cells}")
            if who == "client":
                memcpy = sums.get(f"{size}:memcpy", 0) / rounds - empty
                copies = row["writes"] + row["reads"]
                print(
                    f"  client memcpy round {memcpy / 1e6:.3f}; the writes and reads less it "
                    f"{(copies - memcpy) / 1e6:+.3f} ({(copies - memcpy) / n / 1e3:+.1f} per chunk)"
                )


def _sums(out: Path, pattern: str) -> dict[str, float]:
    """Instructions summed per step name over the dumps of ``out`` matching ``pattern``."""
    sums: dict[str, float] = defaultdict(float)
    for path in out.glob(pattern):
        text = path.read_text(errors="replace")[:4096]
        trigger, total = _TRIGGER.search(text), _SUMMARY.search(text)
        if trigger is not None and total is not None:
            sums[trigger.group(1)] += int(total.group(1))
    return sums


def _client(sizes: list[int], rounds: int, out: Path, policy: str) -> None:
    """The measured client (runs under callgrind): start the daemon, warm up, run, dump."""
    import random

    from benchmarks.bench_daemon import _spec, _split
    from benchmarks.daemon_refs import memcpy_round, page_aligned
    from kvserver.client import KVClient

    work = Path(tempfile.mkdtemp(prefix="kvserver-callgrind-daemon-"))
    ready = work / "ready.json"
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/daemon.%p",
        sys.executable, "-m", "kvserver.cli", "start", "--host", "127.0.0.1",
        "--grpc-port", "0", "--zmq-port", "0", "--pub-port", "0", "--dram", DRAM,
        "--policy", policy,  # the bench's daemon's: bench_daemon.DEFAULT_POLICY
        "--ready-file", str(ready), "--log-level", "WARNING",
    ]  # fmt: skip
    daemon = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def dump(name: str) -> None:
        for pid in (daemon.pid, os.getpid()):
            subprocess.run(["callgrind_control", "--dump", f"step:{name}", str(pid)],
                           check=True, capture_output=True)  # fmt: skip

    try:
        info = daemon_ready(daemon, ready, START_TIMEOUT_S)
        with KVClient(f"tcp://127.0.0.1:{info['zmq_port']}", colocated=True, timeout=600) as kv:
            src_buf = page_aligned(BATCH_BYTES, random.Random(0).randbytes(BATCH_BYTES))
            dst_buf = page_aligned(BATCH_BYTES)
            stage = page_aligned(BATCH_BYTES)
            for size in sizes:
                ns_id = kv.register_namespace(_spec(size, "bw")).ns_id
                n = max(1, BATCH_BYTES // size)
                src, dst = _split(src_buf, size, n), _split(dst_buf, size, n)
                for _ in range(5):  # 256 MiB of DRAM: full from the fifth batch on
                    _steps(kv, ns_id, src, dst, lambda step: None)
                memcpy_round(src, stage, dst)
                dump("warm-up")
                named = functools.partial(_dump_step, dump, size)
                for _ in range(rounds):
                    _steps(kv, ns_id, src, dst, named)
                    dump(f"{size}:empty")
                    memcpy_round(src, stage, dst)
                    dump(f"{size}:memcpy")
                _steps(kv, ns_id, src, dst, lambda step: None)
                if bytes(dst_buf[: n * size]) != bytes(src_buf[: n * size]):
                    raise SystemExit("the co-located load returned different bytes")
    finally:
        daemon.terminate()
        daemon.wait(START_TIMEOUT_S)


def _dump_step(dump: Callable[[str], None], size: int, step: str) -> None:
    dump(f"{size}:{step}")


def _steps(
    kv: KVClient,
    ns_id: str,
    src: list[memoryview],
    dst: list[memoryview],
    done: Callable[[str], None],
) -> None:
    """``bench_daemon._colocated_round``, step by step, ``done(step)`` after each."""
    from benchmarks.bench_daemon import _keys

    keys = _keys(len(src))
    done("before")
    store = kv.prepare_store(ns_id, keys)
    done(STEPS[0])
    if store is None or store.keys != keys:
        raise SystemExit("prepare_store did not grant every key")
    for ext, part in zip(store.locations, src, strict=True):
        kv.write(ext[0], part)
    done(STEPS[1])
    kv.complete_store(store.lease_id)
    done(STEPS[2])
    load = kv.prepare_load(ns_id, keys)
    done(STEPS[3])
    for ext, out in zip(load.locations, dst, strict=True):
        kv.readinto(ext[0], out)
    done(STEPS[4])
    kv.complete_load(load.lease_id)
    done(STEPS[5])


if __name__ == "__main__":
    main()
