"""Idle HTTP/2 connections held open on the daemon's gRPC port: what they cost and what another
client sees.

Starts a real daemon (loopback, its default random token). An attacker process opens
``--connections`` TCP connections to the gRPC port from ``--sources`` other loopback addresses
(127.0.0.2 on, so the daemon tells them from the client), sends each the HTTP/2 client preface,
an empty SETTINGS frame and the ACK of the server's, then nothing, and holds them; it reports
how many the daemon still held after ``--hold-s`` seconds (a connection the daemon closed reads
as its end). Before and while they are held: the daemon's VmRSS and open descriptors, and an
authenticated client's Lookup latency (p50/p99 of ``--calls`` Lookups of an unknown namespace,
each a full RPC, on a channel opened before the attack) and whether a channel opened during the
attack gets an answer.

Usage: python benchmarks/grpc_idle_connections.py [--connections N] [--sources K] [--json FILE]
Imports nothing of the daemon's tree but the benchmark harness, so it can be run with
``PYTHONPATH=OLD`` against an older checkout for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.daemon import DaemonProc, start_daemon

#: the HTTP/2 client connection preface, an empty SETTINGS frame and the ACK of the server's
#: (RFC 9113 §3.4, §6.5): without the ACK gRPC closes the connection after ~60 s by itself
PREFACE = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    + bytes([0, 0, 0, 4, 1, 0, 0, 0, 0])
)
MIB = 1 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def attacker(port: int, sources: int, count: int, hold_s: float) -> None:
    """Open ``count`` idle HTTP/2 connections from 127.0.0.2 and on (``sources`` addresses, in
    turn), print how many are still open after ``hold_s``, then hold them until stdin
    closes."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 256), hard))
    held: list[socket.socket] = []
    refused = 0
    for _ in range(count):
        s = socket.socket()
        try:
            s.bind((f"127.0.0.{2 + len(held) % sources}", 0))
            s.connect(("127.0.0.1", port))
            s.sendall(PREFACE)
            held.append(s)
        except OSError:
            refused += 1
            s.close()
    time.sleep(hold_s)  # the daemon's chance to close what it will not keep
    open_ = 0
    for s in held:
        try:
            s.setblocking(False)
            while True:  # drain what the server sent (its SETTINGS); b"" is its end
                data = s.recv(65536)
                if not data:
                    break
        except BlockingIOError:
            open_ += 1
        except OSError:
            pass
    print(json.dumps({"opened": len(held), "refused_at_connect": refused, "open": open_}),
          flush=True)  # fmt: skip
    sys.stdin.read()


def lookups(channel: grpc.Channel, token: str, calls: int) -> dict[str, Any]:
    lookup = channel.unary_unary("/kvserver.v1.KVServer/Lookup")
    body = bytes([0x0A, 4]) + b"none"  # LookupRequest{namespace_id: "none"}
    metadata = (("authorization", f"Bearer {token}"),)
    times, codes = [], set()
    for _ in range(calls):
        t0 = time.perf_counter()
        try:
            lookup(body, timeout=30, metadata=metadata)
            codes.add("OK")
        except grpc.RpcError as exc:
            codes.add(exc.code().name)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "p50_ms": round(statistics.median(times), 3),
        "p99_ms": round(times[int(len(times) * 0.99) - 1], 3),
        "codes": sorted(codes),
    }


def snapshot(d: DaemonProc, channel: grpc.Channel, calls: int) -> dict[str, Any]:
    return {
        "rss_mib": round(rss(d.proc.pid) / MIB, 1),
        "fds": fds(d.proc.pid),
        **lookups(channel, d.token, calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=4000)
    ap.add_argument("--sources", type=int, default=1, help="attacker addresses (127.0.0.2 on)")
    ap.add_argument("--hold-s", type=float, default=3.0)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--attacker", nargs=3, metavar=("PORT", "SOURCES", "COUNT"),
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args()
    if args.attacker:
        attacker(int(args.attacker[0]), int(args.attacker[1]), int(args.attacker[2]), args.hold_s)
        return
    with tempfile.TemporaryDirectory(prefix="grpc-idle-") as tmp:
        os.environ["KVSERVER_SHM_DIR"] = tmp  # the daemon's token file, read by this process
        d = start_daemon(Path(tmp), "--dram", "64MiB", "--shm-dir", tmp)
        try:
            port = int(d.info["grpc_port"])
            with grpc.insecure_channel(d.grpc_address) as channel:
                lookups(channel, d.token, 50)  # warm
                before = snapshot(d, channel, args.calls)
                attack = subprocess.Popen(
                    [sys.executable, __file__, "--hold-s", str(args.hold_s),
                     "--attacker", str(port), str(args.sources), str(args.connections)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                assert attack.stdout is not None and attack.stdin is not None
                held = json.loads(attack.stdout.readline())
                during = snapshot(d, channel, args.calls)
                t0 = time.perf_counter()
                with grpc.insecure_channel(d.grpc_address) as fresh:
                    first = lookups(fresh, d.token, 1)
                first["ms"] = round((time.perf_counter() - t0) * 1e3, 1)
                attack.stdin.close()
                attack.wait(60)
            alive = d.proc.poll() is None
        finally:
            d.terminate()
    result = {
        "connections": args.connections,
        "sources": args.sources,
        "nofile_soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "held": held,
        "before": before,
        "during": during,
        "new_channel_first_lookup": first,
        "daemon_alive": alive,
        "load_1m": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
