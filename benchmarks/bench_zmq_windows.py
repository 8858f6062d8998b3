"""Network tier over ZMQ: a fetch larger than the peer's cap on unsent replies.

Daemon A (``kvserver start --dram 64MiB``: its ``zmq_send_max_unsent`` is a quarter, 16 MiB)
holds 48 MiB of 1 MiB chunks; this process fetches them with the network tier's own classes
(``PeerFetches`` over a real storage engine, ``PeerSettings(stream=False)``: ZMQ, as a daemon
with CURVE), twelve windows of 4 MiB, ``--rounds`` times (B's DRAM is emptied between rounds).
Reported per round: the fetch's wall time and how many of its windows A refused (``capacity``,
from A's ``stats()["zmq_sends"]["refused"]``), and that every byte arrived. It uses only APIs
that main had before the flow control, so a "before" tree runs it as is:

    git -C /work/main archive HEAD | tar -x -C /tmp/before
    cd /tmp/before && PYTHONPATH=$PWD python /path/to/bench_zmq_windows.py --rounds 20

Usage: python benchmarks/bench_zmq_windows.py [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())  # the tree under test: the one it is run from

from benchmarks.harness.daemon import start_daemon
from kvserver.client import KVClient
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig
from kvserver.namespace import NamespaceSpec

MiB = 1 << 20
CHUNKS = 48
SPEC = NamespaceSpec(
    model="bench/zmq-windows", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_dim=64,
    block_size=16, part_bytes_override=MiB,
)  # fmt: skip


def payload(key: bytes) -> bytes:
    return (key * (MiB // len(key) + 1))[:MiB]


def refused(kv: KVClient) -> int:
    return int(kv.stats()["zmq_sends"]["refused"])


async def rounds(address: str, keys: list[bytes], n: int, kv: KVClient) -> list[dict[str, Any]]:
    out = []
    book = PeerBook(PeerSettings(stream=False, timeout_s=30))
    peer = Peer("A", "", address)
    for _ in range(n):
        config = EngineConfig(dram_bytes=64 * MiB, page_size=MiB, policy="lru")
        with StorageEngine(config) as engine:
            engine.register_namespace(SPEC)
            fetches = PeerFetches(engine, book, publish=lambda: None)
            before = refused(kv)
            start = time.perf_counter()
            await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
            ms = (time.perf_counter() - start) * 1e3
            grant = engine.prepare_load(SPEC.ns_id, keys)
            whole = len(grant.keys) == len(keys) and all(
                b"".join(engine.read_part(grant.lease_id, k, 0)) == payload(k) for k in keys
            )
            engine.complete_load(grant.lease_id)
            out.append({"ms": ms, "refused": refused(kv) - before, "bytes_identical": whole})
    await book.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    keys = [f"zw-{i}".encode().ljust(32, b".") for i in range(CHUNKS)]
    with tempfile.TemporaryDirectory(prefix="kvserver-bench-zw-") as tmp:
        a = start_daemon(Path(tmp) / "a", "--dram", "64MiB")
        try:
            with KVClient(a.zmq_address, colocated=False, timeout=60) as kv:
                kv.register_namespace(SPEC)
                for i in range(0, CHUNKS, 8):
                    run = keys[i : i + 8]
                    assert kv.put(SPEC.ns_id, run, [payload(k) for k in run]).stored == run
                load = os.getloadavg()[0]
                got = asyncio.run(rounds(a.zmq_address, keys, args.rounds, kv))
        finally:
            a.terminate()
    report = {
        "benchmark": "zmq_windows",
        "tree": os.getcwd(),
        "load_average_before": load,
        "load_average_after": os.getloadavg()[0],
        "ms_median": statistics.median(r["ms"] for r in got),
        "refused_per_fetch_median": statistics.median(r["refused"] for r in got),
        "refused_total": sum(r["refused"] for r in got),
        "all_bytes_identical": all(r["bytes_identical"] for r in got),
        "rounds": got,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
