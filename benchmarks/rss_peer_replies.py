"""A fetching daemon's peak RSS while a peer answers a ZMQ ``get`` with more than it may bring
back (session 11, K11).

A real daemon B (``--peers`` a stand-in peer, ZMQ only: ``tests/support/split_part_peer.py``,
run as a module) is asked by a client for 4 chunks of one 4 KiB part; the stand-in answers
with FRAMES payload frames of FRAME_BYTES each (``--mode extra``: as they are; ``part``: all
named as one part). Prints B's peak RSS growth during that ``get`` (VmHWM after
``clear_refs``), how long the ``get`` took, B's peer counters, and whether another client of
B is then served (put and get of its own chunks, byte for byte). Run it from the tree to
measure (B is started from the current directory's ``kvserver``).

    PYTHONPATH=$PWD python3 benchmarks/rss_peer_replies.py --frames 1000000 --frame-bytes 0
    PYTHONPATH=$PWD python3 benchmarks/rss_peer_replies.py --frames 500 --frame-bytes 1048576
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.daemon import start_daemon
from kvserver.client import KVClient
from kvserver.errors import KVServerError
from kvserver.namespace import NamespaceSpec

MIB = 1 << 20
SPEC = NamespaceSpec(
    model="bench/peer-replies", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64,
    block_size=16,
)  # fmt: skip


def status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--frame-bytes", type=int, default=0)
    parser.add_argument("--mode", choices=("extra", "part"), default="extra")
    a = parser.parse_args()
    fake = subprocess.Popen(
        [sys.executable, "-m", "tests.support.split_part_peer", str(a.frames),
         str(a.frame_bytes), a.mode],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert fake.stdout is not None
    address = fake.stdout.readline().strip()
    with tempfile.TemporaryDirectory() as tmp:
        b = start_daemon(Path(tmp), "--dram", "64MiB", "--peers", address,
                         "--peer-stream-port", "-1", "--peer-timeout-s", "30")  # fmt: skip
        try:
            pid = b.proc.pid
            with KVClient(b.zmq_address, colocated=False, timeout=60) as kv:
                kv.register_namespace(SPEC)
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                base, start = status(pid, "VmHWM"), time.monotonic()
                try:
                    print("got", len(kv.get(SPEC.ns_id, keys("asked", 4))), "rows")
                except KVServerError as exc:
                    print("get:", type(exc).__name__)
                took = time.monotonic() - start
                peak = (status(pid, "VmHWM") - base) / MIB
                print(f"B peak RSS +{peak:.0f} MiB, get {took:.2f} s")
                peer = kv.stats()["peer"]
                print({k: peer.get(k) for k in ("peers_suspect", "failures", "placed_chunks")})
            own = keys("own", 3)
            with KVClient(b.zmq_address, colocated=False, timeout=10) as kv:
                kv.register_namespace(SPEC)
                parts = [os.urandom(SPEC.part_bytes) for _ in own]
                assert kv.put(SPEC.ns_id, own, parts).stored == own
                assert [bytes(r[0]) for r in kv.get(SPEC.ns_id, own)] == parts
                print("another client served")
        finally:
            b.kill()
            fake.kill()
            fake.wait()
            fake.stdout.close()


if __name__ == "__main__":
    main()
