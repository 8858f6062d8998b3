"""``kvserver scheduler`` under gRPC core's polling engine vs its default EventEngine.

Starts the scheduler (one synthetic worker) once per engine and round, alternating the order,
and times from this process (polling engine in both, as ``kvserver bench``'s clients) a
one-token ``Generate`` of 8 prompt tokens and a unary ``EngineStats``: p50 / p99 latency, and
the wake-ups of the scheduler process's threads per call (voluntary context switches summed
over ``/proc/PID/task/*/status``; involuntary ones beside them). The engine is chosen with
``GRPC_EXPERIMENTS`` in the scheduler's environment (kvserver/grpc_engine.py): the polling
engine's value, or the empty string (gRPC's defaults).

Usage: python benchmarks/scheduler_engine.py [--calls 300] [--rounds 4]
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from kvserver.grpc_engine import ENV, POLLING_EXPERIMENTS, use_polling_engine

use_polling_engine()  # this client's side: the same in both configurations

from benchmarks.harness.procs import EngineClient, start_scheduler  # noqa: E402

PROMPT = list(range(1, 9))


def switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of ``pid`` so far."""
    vol = invol = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return vol, invol


def measure(engine: str, calls: int, tmp: Path) -> dict[str, tuple[float, float, float, float]]:
    """Per call kind: (p50 ms, p99 ms, wake-ups per call, preemptions per call)."""
    env = {**os.environ, ENV: POLLING_EXPERIMENTS if engine == "polling" else ""}
    proc = start_scheduler(tmp, "--synthetic-workers", "1", env=env)
    try:
        out = {}
        with EngineClient(proc.info["grpc_port"]) as client:
            kinds: dict[str, Callable[[], object]] = {
                "generate": lambda: client.generate(PROMPT, 1),
                "stats": client.stats,
            }
            for _ in range(30):  # warm-up: channels, the first steps
                for call in kinds.values():
                    call()
            for kind, call in kinds.items():
                took = []
                vol0, invol0 = switches(proc.proc.pid)
                for _ in range(calls):
                    start = time.perf_counter()
                    call()
                    took.append(time.perf_counter() - start)
                vol1, invol1 = switches(proc.proc.pid)
                p99 = statistics.quantiles(took, n=100)[98]
                out[kind] = (statistics.median(took) * 1e3, p99 * 1e3,
                             (vol1 - vol0) / calls, (invol1 - invol0) / calls)  # fmt: skip
        return out
    finally:
        proc.proc.terminate()
        proc.proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-sched-engine-") as tmp:
        for rnd in range(args.rounds):
            for engine in ("polling", "default")[:: 1 if rnd % 2 == 0 else -1]:
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                for kind, (p50, p99, vol, invol) in measure(engine, args.calls, Path(tmp)).items():
                    print(f"round {rnd} {engine:8s} {kind:8s} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms"
                          f"  wake-ups/call {vol:5.1f}  preempted/call {invol:4.2f}  load {load}",
                          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
