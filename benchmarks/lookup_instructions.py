"""Instructions per gRPC call (Health, Lookup by 1 and by 2,048 keys, by a new 32k-token prompt
and by the same one again: its hashes from the daemon's segment cache), and per data-plane
lookup of 1 key (``KVClient``, co-located: the local channel), counted by
callgrind in the daemon and in the client: a measure of the Lookup path that the
load of a shared machine does not move (docs/benchmarks.md, Lookup).

Usage (PYTHONPATH selects the tree measured, daemon and client; to measure an older tree, copy
this file into its benchmarks/ first)::

    PYTHONPATH=TREE python -m benchmarks.lookup_instructions [--calls 100] [--out DIR]

Runs in its own processes: this one starts the client under ``valgrind --tool=callgrind`` (itself
again, with ``--client``); the client starts ``kvserver start`` under callgrind too, stores the
prompt, warms every call up, then makes ``--calls`` calls of each kind and dumps both processes'
counters after each kind (``callgrind_control --dump``). Prints one line per kind and process:
instructions per call, and the excess over Health's. Needs valgrind; takes ~1-2 minutes.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.daemon_lookup import LOOKUP_TOKENS
from benchmarks.harness.callgrind import daemon_ready, dump_name, per_call, run_measured

KINDS = (
    "health", "lookup 1 key", "lookup 2,048 keys", "lookup a new 32k-token prompt",
    "data-plane lookup 1 key", "lookup the same 32k-token prompt",
)  # fmt: skip
#: calls of the token kind per --calls (each is ~100x a Health call under callgrind)
TOKEN_SHARE = 0.3
START_TIMEOUT_S = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="calls of each kind (default 100)")
    parser.add_argument("--out", type=Path, help="callgrind files here (default: a temp dir)")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from kvserver.grpc_engine import use_polling_engine

    use_polling_engine()  # as kvserver bench's client (GRPC_EXPERIMENTS= keeps the defaults)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    out = args.out or Path(tempfile.mkdtemp(prefix="kvserver-callgrind-"))
    if args.client:
        _client(args.calls, out)
        return
    run_measured(out, "client", "benchmarks.lookup_instructions", [
        "--client",
        "--calls", str(args.calls), "--out", str(out),
    ])  # fmt: skip
    print(f"tree: {os.environ.get('PYTHONPATH', '(installed)')}; callgrind files in {out}")
    for who in ("daemon", "client"):
        counts = per_call(out, f"{who}.*.*", KINDS)
        health = counts["health"]
        for kind in KINDS:
            ir = counts[kind]
            print(f"{who:6s} {kind:33s} {ir / 1e6:7.3f} M instructions/call "
                  f"({(ir - health) / 1e6:+.3f} M over Health)")  # fmt: skip


def _client(calls: int, out: Path) -> None:
    """The measured client (runs under callgrind): start the daemon, store, call, dump."""
    from benchmarks.bench_daemon import _spec
    from kvserver.client import KVClient
    from kvserver.grpc_client import GrpcClient
    from kvserver.hashing import BlockHasher

    work = Path(tempfile.mkdtemp(prefix="kvserver-callgrind-daemon-"))
    ready = work / "ready.json"
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/daemon.%p",
        sys.executable, "-m", "kvserver.cli", "start", "--host", "127.0.0.1",
        "--grpc-port", "0", "--zmq-port", "0", "--pub-port", "0", "--dram", "256MiB",
        "--policy", "prefix",  # the recorded figures' policy (harness.daemon.RECORDED_POLICY)
        "--ready-file", str(ready), "--log-level", "WARNING",
    ]  # fmt: skip
    daemon = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def dump(kind: str) -> None:
        for pid in (daemon.pid, os.getpid()):
            subprocess.run(["callgrind_control", "--dump", kind, str(pid)], check=True,
                           capture_output=True)  # fmt: skip

    try:
        info = daemon_ready(daemon, ready, START_TIMEOUT_S)
        spec = _spec(1024, "lookup")
        rng = random.Random(1)
        tokens = [rng.randrange(128_256) for _ in range(LOOKUP_TOKENS)]
        hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
        keys = [bytes(k) for k in hasher.chunk_keys(hasher.hash_blocks(tokens), spec.chunk_blocks)]
        kv = KVClient(f"tcp://127.0.0.1:{info['zmq_port']}", timeout=120)
        ns_id = kv.register_namespace(spec).ns_id
        grant = kv.prepare_store(ns_id, keys)
        if grant is None:
            raise SystemExit("cannot store the prompt")
        kv.complete_store(grant.lease_id)
        with kv, GrpcClient(f"127.0.0.1:{info['grpc_port']}", timeout=120) as grpc:
            firsts = itertools.count(1)
            fresh = list(tokens)

            def new_prompt() -> Any:
                fresh[0] = next(firsts) % 128_256  # as daemon_lookup: no copy of the ids
                return grpc.lookup_tokens(ns_id, fresh)

            cases: dict[str, tuple[Callable[[], Any], int]] = {
                KINDS[0]: (grpc.health, calls),
                KINDS[1]: (lambda: grpc.lookup_keys(ns_id, keys[:1]), calls),
                KINDS[2]: (lambda: grpc.lookup_keys(ns_id, keys), calls),
                KINDS[3]: (new_prompt, max(1, round(calls * TOKEN_SHARE))),
                KINDS[4]: (lambda: kv.lookup(ns_id, keys[:1]), calls),
                KINDS[5]: (lambda: grpc.lookup_tokens(ns_id, tokens), calls),
            }
            for call, _ in cases.values():
                for _ in range(10):
                    call()
            for index, (call, n) in enumerate(cases.values()):
                call()  # outside the window: the same prompt's segments are back in the cache
                dump("warm-up")  # after the new prompts evicted them
                for _ in range(n):
                    call()
                dump(dump_name(index, n))
    finally:
        daemon.terminate()
        daemon.wait(START_TIMEOUT_S)


if __name__ == "__main__":
    main()
