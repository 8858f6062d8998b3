"""Scheduler step time with 256 running requests: KV connector on vs off.

Each configuration is one :class:`scheduler.scheduler.Scheduler` with 256 requests in steady
decode (512-token prompts sharing a 256-token system prefix, so the prefix cache is in play),
answered by an in-process synthetic worker (not timed): ``benchmarks/scheduler_workload.py``.
Timed: ``schedule()`` — the figure — and, for information, a whole step's scheduler work
``schedule()`` + ``update_from_output()`` + the connector's ``take_events()``, which the step
loop of ``scheduler/process.py`` calls after every step (so does vLLM's
``update_from_output``); both as wall time and as the measuring thread's CPU time
(``time.thread_time``).

Configurations:
- ``off``: no connector (the reference);
- ``memory``: the in-memory connector of scheduler/memory_connector.py — the kvserver connector's
  planning bookkeeping (chunk keys, store cursors, per-step store leases, completion once
  every rank reported, deferred frees) without a network: the cost the connector adds to the
  scheduler's own work;
- ``kvserver``: the real ``KVServerSchedulerConnector`` against a daemon (``--kvserver ADDR``,
  or ``--start-daemon`` to start one on loopback): adds the client's side of its daemon calls
  — one store reservation in each step with stores, planned by ``build_connector_meta`` and
  carrying the store completions ``update_from_output`` held, its reply read once the workers'
  step is over — none of them waited for inside the step unless
  the daemon is slower than the workers' step. As in ``scheduler/process.py``, each step calls
  ``Scheduler.dispatched()`` once the plan is out (between ``schedule()`` and the worker, not
  timed: the scheduler waits for the workers then): the connector sends the step's
  ``prepare_store`` there; its mean time is printed.
  Its row also reports the daemon calls per step (``calls_per_step``, by op) and where the
  chunks it planned to store went over the whole run (``stores``: docs/connector.md, "Store
  accounting"; planned counts each request's chunks, so a shared prefix counts many times).

Configurations are measured round-robin, ``--steps`` steps each per round (a multiple of the
16-step cycle of the workload: every 16 steps each request fills a block), short rounds so that
load changes on a shared machine hit them alike, with the cyclic garbage collector run between
runs rather than inside them; medians over all timed steps. ratio = median(config) /
median(off); target <= 1.2.

CPU placement (``--pin``, the default where the OS allows it and two CPUs are available): this
process runs on one CPU and the daemon it starts on another, as in a deployment, where the
daemon has cores of its own. Unpinned on a 2-CPU machine the daemon's work for each request
competes with the measuring thread: a send wakes the client's and the daemon's threads, which
then preempt the scheduler thread (~0.3 ms of wall time per send), so the kvserver row measures
core sharing more than the connector; ``--no-pin`` shows that.

Instruction counts (``--instructions N``, needs valgrind): a figure that load does not move.
Each of ``off``, ``memory`` and ``kvserver`` runs in a process of its own under
``valgrind --tool=callgrind`` (the daemon outside it), N steady steps after the same warm-up,
counting only inside ``schedule()`` (called through ``eval``) and ``update_from_output()`` +
``take_events()`` (through ``operator.call``): callgrind's ``--toggle-collect`` on CPython's
``builtin_eval`` and ``_operator_call``. ratio = instructions(kvserver) / instructions(off),
for ``schedule()`` and for the whole step (``memory``: the bookkeeping alone). User-space
instructions of the measuring thread only: not the syscalls, not the ZMQ I/O thread, not
cache misses; the wall-time ratio includes those (``--breakdown`` shows the kernel's side).

Kernel accounts (``--breakdown``, Linux; :mod:`benchmarks.thread_probe`): per step, beside the
timings, what the kernel booked for the measuring thread inside ``schedule()`` and the whole
step — time spent preempted on the run queue, involuntary / voluntary context switches, CPU
time in system calls — and the CPU time the process's other threads (the kvserver client's ZMQ
I/O thread) used meanwhile, which with ``--pin`` is taken from the measuring thread's CPU:
what separates the wall time from the instructions. Means per step (the counts are small).

Workers' step time (``--worker-ms MS``, default 0): the in-process synthetic worker answers
at once, so a daemon reply sent when the plan goes out (``dispatched()``) has ~0.5 ms to come
back before ``update_from_output()``; a GPU's forward pass gives it several milliseconds.
``--worker-ms`` sleeps that long after the worker (untimed, every configuration alike), as the
scheduler process waits for its workers. With ``--instructions`` it makes the count repeatable:
without it, whether the reply was received before ``update_from_output()`` depends on when
valgrind (which runs one thread at a time) lets the client's ZMQ I/O thread run, which moves
the reply's reading between ``schedule()`` and the rest of the step (±0.5 % of the count).

Usage: python benchmarks/bench_scheduler.py [--quick] [--json FILE] [--start-daemon] [--no-pin]
                                            [--breakdown] [--worker-ms MS]
       python benchmarks/bench_scheduler.py --instructions 64 [--worker-ms MS] [--json FILE]
With --json, also writes FILE with the .png suffix (a bar chart) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import operator
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks import thread_probe
from benchmarks.report import save_report
from benchmarks.scheduler_workload import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    NUM_REQUESTS,
    Config,
    kvserver_connector,
    make,
)
from benchmarks.thread_probe import ThreadProbe
from scheduler.memory_connector import MemoryConnector

TARGET = 1.2


def pin_cpus() -> tuple[int, int] | None:
    """(CPU of this process, CPU of the daemon): the first two CPUs this process may use;
    None when fewer than two are available or the OS cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


@contextmanager
def daemon(cpu: int | None = None) -> Iterator[str]:
    """A ``kvserver start`` on ephemeral loopback ports (on CPU ``cpu`` only, when given, with
    every thread it starts); yields its ZMQ address."""
    with tempfile.TemporaryDirectory(prefix="bench-sched-") as tmp:
        ready = Path(tmp) / "ready.json"
        args = [
            sys.executable, "-m", "kvserver.cli", "start", "--host", "127.0.0.1",
            "--grpc-port", "0", "--zmq-port", "0", "--pub-port", "-1", "--dram", "1GiB",
            "--policy", "prefix",  # the recorded figures' policy (harness.daemon.RECORDED_POLICY)
            "--ready-file", str(ready), "--log-level", "WARNING",
        ]  # fmt: skip
        pin = None if cpu is None else functools.partial(os.sched_setaffinity, 0, {cpu})
        proc = subprocess.Popen(args, preexec_fn=pin)
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("could not start a kvserver daemon")
                time.sleep(0.05)  # polling for the ready file, bounded by the deadline
            yield f"tcp://127.0.0.1:{json.loads(ready.read_text())['zmq_port']}"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def measure(configs: list[Config], rounds: int, steps: int) -> None:
    """Round-robin, alternating the order; the cyclic GC runs between runs, not inside them
    (as timeit does): the configurations share one heap, and a collection triggered by one
    would walk the other's objects too."""
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for config in order:
            gc.collect()
            gc.disable()
            try:
                config.run(steps)
            finally:
                gc.enable()


def results(configs: list[Config]) -> list[dict[str, Any]]:
    off = configs[0]
    med = statistics.median
    ref, ref_step = med(off.schedule_s), med(off.step_s)
    ref_cpu, ref_step_cpu = med(off.schedule_cpu_s), med(off.step_cpu_s)
    out = []
    for c in configs:
        value, step = med(c.schedule_s), med(c.step_s)
        cpu, step_cpu = med(c.schedule_cpu_s), med(c.step_cpu_s)
        p90 = statistics.quantiles(c.schedule_s, n=10)[-1]
        out.append(
            {
                "name": f"schedule() with {NUM_REQUESTS} running, connector {c.name}",
                "config": c.name,
                "value": value * 1e6,
                "unit": "us",
                "p90_us": p90 * 1e6,
                "reference": ref * 1e6,
                "ratio": value / ref,
                "target": TARGET,
                "step_us": step * 1e6,
                "step_ratio": step / ref_step,
                "cpu_us": cpu * 1e6,
                "cpu_ratio": cpu / ref_cpu,
                "step_cpu_us": step_cpu * 1e6,
                "step_cpu_ratio": step_cpu / ref_step_cpu,
                "dispatch_us": statistics.fmean(c.dispatch_s) * 1e6,
                "samples": len(c.schedule_s),
            }
        )
        if c.sent_by_op is not None:
            out[-1]["calls_per_step"] = {
                op: n / len(c.schedule_s) for op, n in sorted(c.calls.items())
            }
        if c.stores is not None:
            out[-1]["stores"] = c.stores
        if c.probes is not None:
            n = len(c.schedule_s)
            sched, update = (p.per(n) for p in c.probes)
            out[-1]["breakdown"] = {
                "schedule": sched,
                "step": {k: v + update[k] for k, v in sched.items()},
            }
    return out


def store_accounting(conn: Any) -> dict[str, int]:
    """Where the chunks the connector planned went, over the whole run (prefill included),
    once the replies still due are applied: docs/connector.md, "Store accounting"."""
    conn.drain()
    s = conn.stats
    names = ("planned", "shared", "present", "filtered", "unreserved", "granted", "stored")
    return {n: getattr(s, f"{n}_chunks") for n in names}


def count_one(name: str, address: str | None, steps: int, worker_s: float = 0.0) -> None:
    """Run ``steps`` steady steps of one configuration for callgrind (``--instructions``):
    ``schedule()`` through ``eval`` and ``update_from_output()`` + ``take_events()`` through
    ``operator.call``, the two functions callgrind collects inside; ``worker_s``: the
    workers' step, slept between the two (not counted)."""
    conn = kvserver_connector(address) if name == "kvserver" and address else None
    memory = MemoryConnector(BLOCK_SIZE, CHUNK_BLOCKS, log_calls=False)
    config = make(name, memory if name == "memory" else conn, steps + 64)
    s, worker = config.scheduler, config.worker

    def step_end(plan: Any, results: Any) -> None:
        s.update_from_output(plan, results)
        if s.connector is not None:
            s.connector.take_events()  # as the step loop does (scheduler/process.py)

    gc.collect()
    gc.disable()
    for _ in range(steps):
        plan = eval("s.schedule()")  # callgrind's marker: a constant expression
        s.dispatched()  # not counted: the workers' time
        results = [worker.execute(plan)]
        if worker_s:
            time.sleep(worker_s)  # the daemon's reply arrives meanwhile, as on a GPU
        operator.call(step_end, plan, results)
    gc.enable()
    if conn is not None:
        if conn.stats.timeouts:
            raise SystemExit("the daemon timed out during the count: not the steady state")
        conn.close()


def instructions(steps: int, address: str, worker_ms: float = 0.0) -> list[dict[str, Any]]:
    """``--instructions``: each configuration under callgrind; rows as :func:`results`."""
    counts: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sched-cg-") as tmp:
        for name in ("off", "memory", "kvserver"):
            out = Path(tmp) / f"{name}.out"
            cmd = [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                "--toggle-collect=builtin_eval", "--toggle-collect=_operator_call",
                sys.executable, __file__, "--count-one", name, "--kvserver", address,
                "--steps", str(steps), "--worker-ms", str(worker_ms),
            ]  # fmt: skip
            env = {**os.environ, "PYTHONHASHSEED": "0"}
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(f"{name} under callgrind failed:\n{run.stderr[-4000:]}")
            counts[name] = _callgrind_totals(out)
    (ref_s, ref_u), rows = counts["off"], []
    for name, (sched, update) in counts.items():
        rows.append({
            "name": f"instructions per step with {NUM_REQUESTS} running, connector {name}",
            "config": name, "value": sched / steps, "unit": "instructions",
            "ratio": sched / ref_s, "step_value": (sched + update) / steps,
            "step_ratio": (sched + update) / (ref_s + ref_u), "target": TARGET,
            "steps": steps,
        })  # fmt: skip
    return rows


def _callgrind_totals(path: Path) -> tuple[int, int]:
    """Inclusive instructions of builtin_eval (``schedule()``) and _operator_call
    (``update_from_output()``) in a callgrind output file."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    found: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        for fn in ("builtin_eval", "_operator_call"):
            if parts and any(p.endswith(f":{fn}") for p in parts) and fn not in found:
                found[fn] = int(parts[0].replace(",", ""))
    if len(found) != 2:
        raise SystemExit(f"callgrind output without the markers: {path}")
    return found["builtin_eval"], found["_operator_call"]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{NUM_REQUESTS} running requests in decode, block {BLOCK_SIZE}, medians")
    print(f"{'connector':<10} {'schedule() us':>14} {'p90 us':>9} {'ratio':>7} "
          f"{'step us':>9} {'step ratio':>10} {'cpu ratio':>10} {'cpu step r.':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['config']:<10} {r['value']:>14.1f} {r['p90_us']:>9.1f} {r['ratio']:>7.3f} "
            f"{r['step_us']:>9.1f} {r['step_ratio']:>10.3f} {r['cpu_ratio']:>10.3f} "
            f"{r['step_cpu_ratio']:>11.3f}"
        )
    print(f"target: ratio <= {TARGET}")
    for r in rows:
        if r.get("dispatch_us"):
            print(f"dispatched() ({r['config']}, while the workers run, not in the step): "
                  f"{r['dispatch_us']:.1f} us per step (mean)")  # fmt: skip
        if "calls_per_step" in r:
            calls = ", ".join(f"{op} {n:.2f}" for op, n in r["calls_per_step"].items())
            print(f"daemon calls per step ({r['config']}): {calls or 'none'}")
        if "breakdown" in r:
            for region, b in r["breakdown"].items():
                print(f"kernel accounts per step ({r['config']}, {region}): "
                      f"runqueue {b['runqueue_us']:.1f} us, "
                      f"switches {b['invol_switches']:.2f} involuntary / "
                      f"{b['vol_switches']:.2f} voluntary, sys {b['sys_us']:.1f} us, "
                      f"other threads {b['other_threads_us']:.1f} us")  # fmt: skip
        if "stores" in r:
            fates = ", ".join(f"{k} {v}" for k, v in r["stores"].items())
            print(f"store accounting ({r['config']}, whole run, docs/connector.md): {fates}")


def write_chart(rows: list[dict[str, Any]], path: Path, unit: str = "µs") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [r["config"] for r in rows]
    sched = [r["value"] for r in rows]
    step = [r["step_us"] if "step_us" in r else r["step_value"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], sched, width=0.4, label="schedule()")
    ax.bar([x + 0.2 for x in xs], step, width=0.4, label="schedule() + update_from_output()")
    ax.axhline(rows[0]["value"] * TARGET, color="red", linestyle="--", linewidth=1,
               label=f"target: {TARGET}x off")  # fmt: skip
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(f"{r['ratio']:.2f}x", (x - 0.2, r["value"]), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8)  # fmt: skip
    ax.set_xticks(list(xs), [f"connector {n}" for n in names])
    ax.set_ylabel(f"median {unit} per step" if unit == "µs" else f"{unit} per step")
    ax.set_title(f"Scheduler step, {NUM_REQUESTS} running requests")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds of 32 steps")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=48, help="timed steps per round")
    parser.add_argument("--kvserver", metavar="ADDR", help="also measure the real connector")
    parser.add_argument("--start-daemon", action="store_true",
                        help="start a daemon on loopback for the real connector")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON here")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="this process and the daemon on different CPUs (default)")  # fmt: skip
    parser.add_argument("--instructions", type=int, metavar="N",
                        help="count instructions of N steps under callgrind instead")  # fmt: skip
    parser.add_argument("--breakdown", action="store_true",
                        help="also the kernel's accounts per step (thread_probe.py)")  # fmt: skip
    parser.add_argument("--worker-ms", type=float, default=0.0,
                        help="the workers' step time (a sleep, untimed)")  # fmt: skip
    parser.add_argument("--count-one", choices=("off", "memory", "kvserver"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.count_one:
        count_one(args.count_one, args.kvserver, args.steps, args.worker_ms / 1e3)
        return 0
    if args.instructions:
        with daemon() as addr:
            rows = instructions(args.instructions, addr, args.worker_ms)
        for r in rows:
            print(f"{r['config']:<10} schedule() {r['value']:>12,.0f} instr/step  ratio "
                  f"{r['ratio']:.3f}   whole step {r['step_value']:>12,.0f}  ratio "
                  f"{r['step_ratio']:.3f}")  # fmt: skip
        if args.json is not None:
            meta = {"num_requests": NUM_REQUESTS, "steps": args.instructions, "tool": "callgrind",
                    "worker_ms": args.worker_ms}  # fmt: skip
            save_report(args.json, {"meta": meta, "results": rows},
                        lambda png: write_chart(rows, png, "instructions"))  # fmt: skip
        return 0
    rounds, steps = (4, 32) if args.quick else (args.rounds, args.steps)
    max_steps = rounds * steps + 64
    cpus = pin_cpus() if args.pin else None
    if cpus is not None:  # before any thread starts (the client's I/O thread inherits it)
        os.sched_setaffinity(0, {cpus[0]})
    daemon_cpu = None if cpus is None else cpus[1]
    with daemon(daemon_cpu) if args.start_daemon else nullcontext(args.kvserver) as addr:
        configs = [make("off", None, max_steps)]
        configs.append(make("memory", MemoryConnector(BLOCK_SIZE, CHUNK_BLOCKS, log_calls=False),
                            max_steps))  # fmt: skip
        if addr:
            conn = kvserver_connector(addr)
            configs.append(make("kvserver", conn, max_steps, conn.client.sent_by_op))
        for c in configs:
            c.worker_s = args.worker_ms / 1e3
        if args.breakdown:
            if not thread_probe.available():
                raise SystemExit("--breakdown needs Linux's per-thread accounts")
            for c in configs:
                c.probes = (ThreadProbe(), ThreadProbe())
        measure(configs, rounds, steps)
        for c in configs:
            if c.sent_by_op is not None:
                c.stores = store_accounting(c.scheduler.connector)
            close = getattr(c.scheduler.connector, "close", None)
            if callable(close):
                close()
    rows = results(configs)
    print_table(rows)
    if args.json is not None:
        pinned = None if cpus is None else {"bench": cpus[0], "daemon": cpus[1]}
        meta = {"num_requests": NUM_REQUESTS, "block_size": BLOCK_SIZE, "rounds": rounds,
                "steps_per_round": steps, "cpus": os.cpu_count(), "pinned": pinned,
                "worker_ms": args.worker_ms}  # fmt: skip
        save_report(args.json, {"meta": meta, "results": rows}, lambda png: write_chart(rows, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
