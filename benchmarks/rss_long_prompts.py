"""Where the daemon's RSS goes while it serves 1M-token packed prompts over ZMQ (session 10).

``bench_abuse.py``'s ``auth_1m_tokens_packed`` row saw the daemon's RSS grow 74 MiB in 6 s of
1M-token ``lookup_tokens``. This runs the same requests one at a time, from one client, against
a fresh daemon (64 MiB DRAM, as there) and prints its VmRSS after 1, 2, 4, ... requests: a
growth that stops is bounded, one that goes on with the requests is a leak. ``--distinct``
sends a new prompt each time (no segment of it cached) instead of the same one; ``--no-tune``
starts the daemon without the glibc settings of ``kvserver/daemon/malloc.py``; ``--trim``
asks the daemon's allocator to give free memory back at the end (``malloc_trim(0)`` through
gdb, when gdb may attach) and prints the RSS after, which tells memory in use from memory freed
but kept by malloc.

    PYTHONPATH=$PWD python3 benchmarks/rss_long_prompts.py --requests 64 \
        [--distinct] [--no-tune] [--trim]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.daemon import RECORDED_POLICY, start_daemon
from kvserver.client import KVClient
from kvserver.namespace import NamespaceSpec

MIB = 1 << 20
TOKENS = 1 << 20
SPEC = NamespaceSpec(
    model="bench/rss", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16
)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def malloc_trim(pid: int) -> bool:
    """``malloc_trim(0)`` in process ``pid`` through gdb (False: gdb could not do it)."""
    out = subprocess.run(
        ["gdb", "-p", str(pid), "-batch", "-ex", "call (int) malloc_trim(0)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return out.returncode == 0 and "$1 = " in out.stdout


def run(requests: int, distinct: bool, tune: bool, trim: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        extra = () if tune else ("--no-tune-malloc",)
        d = start_daemon(Path(tmp), "--dram", "64MiB", *RECORDED_POLICY, *extra)
        try:
            pid = d.proc.pid
            out: dict[str, Any] = {"distinct": distinct, "tune_malloc": tune, "rss_mib": {}}
            with KVClient(d.zmq_address, colocated=False, timeout=120) as kv:
                ns_id = kv.register_namespace(SPEC).ns_id
                out["rss_mib"][0] = rss(pid) / MIB
                checkpoint = 1
                for i in range(1, requests + 1):
                    first = i * TOKENS if distinct else 0
                    kv.lookup_tokens(ns_id, range(first, first + TOKENS))
                    if i in (checkpoint, requests):
                        out["rss_mib"][i] = rss(pid) / MIB
                        checkpoint *= 2
            if trim:
                out["trimmed"] = malloc_trim(pid)
                out["rss_mib_after_trim"] = rss(pid) / MIB
            return out
        finally:
            assert d.terminate() == 0, d.log()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--distinct", action="store_true", help="a new prompt every request")
    p.add_argument("--no-tune", action="store_true", help="daemon without --tune-malloc")
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) at the end (gdb)")
    args = p.parse_args()
    print(json.dumps(run(args.requests, args.distinct, not args.no_tune, args.trim)))


if __name__ == "__main__":
    main()
