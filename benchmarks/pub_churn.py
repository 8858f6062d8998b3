"""What subscribers refused by the KV-event PUB cost the daemon while they reconnect (session 11).

A fresh daemon (32 MiB DRAM, ``pub_max_subscribers`` SUBs connected and holding the limit), then
one churn mode for ``--window`` seconds while an authenticated client times back-to-back
``hello`` round trips (5 ms apart):

- ``none``: no churn (the reference, in the same run);
- ``zmq``: ``--churners`` SUB sockets with ``RECONNECT_IVL`` 1 ms, each refused and reconnecting
  by itself (a SUB's default is 100 ms; anyone who reaches the PUB port may set 1);
- ``raw``: two threads opening and closing TCP connections to the PUB port in a loop.

Prints one JSON line per mode: the daemon's CPU (utime + stime over the window, % of a core),
refusals per second (``stats`` ``pub_subscribers.refused``), the hello p50/p99 and the load.

    PYTHONPATH=$PWD python3 benchmarks/pub_churn.py --modes none zmq raw [--window 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

import zmq

from benchmarks.harness.daemon import start_daemon, wait_until
from kvserver.client import KVClient


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sub(ctx: zmq.Context[Any], address: str, reconnect_ms: int = 100) -> zmq.Socket[Any]:
    s: zmq.Socket[Any] = ctx.socket(zmq.SUB)
    s.linger = 0
    s.setsockopt(zmq.RECONNECT_IVL, reconnect_ms)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(address)
    return s


def run(mode: str, max_subscribers: int, churners: int, window: float) -> dict[str, Any]:
    d = start_daemon(
        Path(tempfile.mkdtemp()),
        "--dram",
        "32MiB",
        env={"KVSERVER_PUB_MAX_SUBSCRIBERS": str(max_subscribers)},
    )
    ctx: zmq.Context[Any] = zmq.Context()
    subs = [sub(ctx, d.pub_address) for _ in range(max_subscribers)]
    port = int(d.pub_address.rsplit(":", 1)[1])
    stop = threading.Event()

    def connect_loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port)).close()

    threads = [threading.Thread(target=connect_loop) for _ in range(2 if mode == "raw" else 0)]
    try:
        with KVClient(d.zmq_address) as kv:
            kv.hello()
            wait_until(lambda: kv.stats()["pub_subscribers"]["connected"] == max_subscribers)
            if mode == "zmq":
                subs += [sub(ctx, d.pub_address, reconnect_ms=1) for _ in range(churners)]
            for t in threads:
                t.start()
            time.sleep(1)
            refused0 = kv.stats()["pub_subscribers"]["refused"]
            cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
            latencies = []
            while time.monotonic() - t0 < window:
                start = time.perf_counter()
                kv.hello()
                latencies.append(time.perf_counter() - start)
                time.sleep(0.005)
            elapsed = time.monotonic() - t0
            cpu = cpu_seconds(d.proc.pid) - cpu0
            refused = kv.stats()["pub_subscribers"]["refused"] - refused0
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in subs:
            s.close(0)
        ctx.term()
        d.terminate()
    latencies.sort()
    return {
        "mode": mode,
        "daemon_cpu_pct": round(100 * cpu / elapsed, 1),
        "refused_per_s": round(refused / elapsed),
        "hello_p50_us": round(latencies[len(latencies) // 2] * 1e6),
        "hello_p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6),
        "hellos": len(latencies),
        "load": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["none", "zmq", "raw"])
    ap.add_argument("--max-subscribers", type=int, default=64)
    ap.add_argument("--churners", type=int, default=8)
    ap.add_argument("--window", type=float, default=6.0)
    args = ap.parse_args()
    for mode in args.modes:
        print(json.dumps(run(mode, args.max_subscribers, args.churners, args.window)), flush=True)


if __name__ == "__main__":
    main()
