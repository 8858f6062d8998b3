"""What makes the slow calls of ``kvserver bench``'s gRPC Lookup rows (issue 15 item 3).

Runs the benchmark's own Lookup phases (``daemon_lookup.bench_lookup``; with ``--full`` the
whole ``kvserver bench`` run, data paths first, as ``bench_daemon`` does) against a daemon of
its own, and records beside every timed call what happened meanwhile, from signals the load
on the machine does not bias:

- the cycle collector, in the bench client and in the daemon (``gc.callbacks``: when each
  pass ran, its generation, how long);
- the daemon's event loop: a probe task that wakes every 1 ms and records each wake-up late
  by more than ``STALL_S`` (the loop ran something else that long); with ``--loop-debug``
  also uvloop's own "Executing <callback> took" reports (debug mode, slow callbacks > 0.5 ms)
  naming what ran;
- the daemon's handler: when each gRPC method began and ended, and its thread CPU;
- the kernel's run-queue delay (``/proc/PID/task/*/schedstat``) of every thread of the client
  and of the daemon over each call: time a thread was runnable while another task had its CPU;
  and their wake-ups (voluntary context switches, ``/proc/PID/task/*/status``).

Then prints, for each phase, how many of the calls at or above the phase's p99 overlapped each
kind of event, against the same share over all calls, and the slowest calls themselves::

    PYTHONPATH=TREE python -m benchmarks.lookup_tail [--full] [--lookup-iters 2000]

The daemon gets the probes through a ``sitecustomize`` written into a temporary directory put
first on its ``PYTHONPATH`` (``KVSERVER_TAIL_PROBE`` names the file it writes at exit). The
figures it prints are for attribution only: the probes add work to every call.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

#: a probe wake-up later than this (beyond its 1 ms sleep) is a loop stall
STALL_S = 0.0015
PROBE_ENV = "KVSERVER_TAIL_PROBE"
DEBUG_ENV = "KVSERVER_TAIL_PROBE_DEBUG"
PHASES = ("by keys", "tokens, same prompt", "tokens, new prompt", "Health")

Record = dict[str, list[Any]]


def _gc_recorder(out: list[Any]) -> Callable[[str, dict[str, int]], None]:
    start = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            start[0] = now
        else:
            out.append([start[0], now, info["generation"], info["collected"]])

    return callback


# ----------------------------------------------------------------------------- daemon side


def install_daemon_probe() -> None:
    """In the daemon (its ``sitecustomize``): GC, loop-stall and handler records, written as
    JSON to ``$KVSERVER_TAIL_PROBE`` at exit. No-op without that variable."""
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    rec: Record = {"gc": [], "stalls": [], "handlers": [], "slow": [], "pid": [os.getpid()]}
    gc.callbacks.append(_gc_recorder(rec["gc"]))
    atexit.register(lambda: Path(path).write_text(json.dumps(rec)))
    import uvloop

    run = uvloop.run

    def probed_run(main: Coroutine[Any, Any, Any], **kw: Any) -> Any:
        _patch_handlers(rec)
        return run(_with_lag_probe(main, rec), **kw)

    uvloop.run = probed_run


def _patch_handlers(rec: Record) -> None:
    from kvserver.daemon.grpc_server import GrpcFrontend

    unary = GrpcFrontend._unary

    def timed_unary(self: GrpcFrontend, request_type: Any, method: Any) -> Any:
        handler = unary(self, request_type, method)
        inner = handler.unary_unary
        name = getattr(method, "__name__", "?")

        async def handle(raw: bytes, context: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return await inner(raw, context)
            finally:
                rec["handlers"].append([name, t0, time.perf_counter(), time.thread_time() - c0])

        return handler._replace(unary_unary=handle)

    GrpcFrontend._unary = timed_unary  # type: ignore[method-assign]


async def _with_lag_probe(main: Coroutine[Any, Any, Any], rec: Record) -> Any:
    import asyncio
    import logging

    loop = asyncio.get_running_loop()
    if os.environ.get(DEBUG_ENV):
        loop.set_debug(True)
        loop.slow_callback_duration = 0.0005

        class _Slow(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                rec["slow"].append([time.perf_counter(), record.getMessage()[:300]])

        logging.getLogger("asyncio").addHandler(_Slow(logging.WARNING))

    fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def waited_s() -> float:
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9

    async def lag() -> None:
        while True:
            w0 = waited_s()
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            t1 = time.perf_counter()
            if t1 - t0 > 0.001 + STALL_S:  # [start, end, of which the loop waited for a CPU]
                rec["stalls"].append([t0, t1, waited_s() - w0])

    probe = asyncio.create_task(lag())
    try:
        return await main
    finally:
        probe.cancel()


# ----------------------------------------------------------------------------- client side


def _sched(pid: int) -> tuple[float, int]:
    """Sums over the threads of ``pid`` of the kernel's run-queue delay (ms; schedstat field
    2) and of their wake-ups: voluntary context switches (``status``), each a wait that a
    wake-up ended. Preemptions, which the load decides, are not counted (schedstat's field 3,
    every switch onto a CPU, counted them too: 13-19 per call at load 3-5 where a thread
    waited 7-11 times)."""
    delay = woken = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                fields = f.read().split()
            with open(f"{base}/{tid}/status") as f:
                status = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        delay += int(fields[1])
        at = status.find("\nvoluntary_ctxt_switches:")
        woken += int(status[at:].split(maxsplit=2)[1]) if at >= 0 else 0
    return delay / 1e6, woken


class _Clock:
    """Stands in for ``time`` in ``daemon_lookup``: every even ``perf_counter()`` call is a
    timed call's start, every odd one its end; records both with the run-queue delays of the
    client's and the daemon's threads read outside the window."""

    def __init__(self, daemon_pid: Callable[[], int | None]) -> None:
        self.calls: list[list[float]] = []
        self._daemon_pid = daemon_pid
        self._open: list[float] = []

    def _sched(self) -> list[float]:
        pid = self._daemon_pid()
        return [*_sched(os.getpid()), *(_sched(pid) if pid else (0.0, 0))]

    def perf_counter(self) -> float:
        """[start, end, client run-queue ms, client switches, daemon ms, daemon switches]"""
        if not self._open:
            before = self._sched()
            now = time.perf_counter()
            self._open = [now, *before]
            return now
        now = time.perf_counter()
        after = self._sched()
        start, *before = self._open
        self.calls.append([start, now, *(a - b for a, b in zip(after, before, strict=True))])
        self._open = []
        return now


def _overlap(s: float, e: float, events: list[list[Any]]) -> float:
    """Seconds of [s, e] covered by the events' [start, end] windows."""
    return sum(max(0.0, min(e, float(ev[1])) - max(s, float(ev[0]))) for ev in events)


def analyse(calls: list[list[float]], sizes: list[int], client_gc: list[Any], d: Record) -> None:
    """Print, per phase, what the calls at or above p99 overlapped, against all calls."""
    handlers = sorted(d["handlers"], key=lambda h: h[1])
    # stalls the loop spent running (not waiting for a CPU): what ran on it, not the load
    busy = [st for st in d["stalls"] if (st[1] - st[0]) - st[2] > 0.001 + STALL_S]
    starts = [h[1] for h in handlers]
    import bisect

    pos = 0
    for phase, n in zip(PHASES, sizes, strict=True):
        rows: list[dict[str, Any]] = []
        for s, e, run_me, sw_me, run_d, sw_d in calls[pos : pos + n]:
            i = bisect.bisect_left(starts, s)
            h = handlers[i] if i < len(handlers) and handlers[i][1] <= e else None
            slow = [m for t, m in d["slow"] if s <= t <= e]
            rows.append({
                "ms": (e - s) * 1e3,
                "client_gc": [g[2] for g in client_gc if g[1] > s and g[0] < e],
                "client_gc_ms": _overlap(s, e, client_gc) * 1e3,
                "daemon_gc": [g[2] for g in d["gc"] if g[1] > s and g[0] < e],
                "stall_ms": _overlap(s, e, d["stalls"]) * 1e3,
                "busy_stall_ms": _overlap(s, e, busy) * 1e3,
                "handler_ms": (h[2] - h[1]) * 1e3 if h else None,
                "handler_cpu_ms": h[3] * 1e3 if h else None,
                "runq_client_ms": run_me,
                "runq_daemon_ms": run_d,
                "switches": (sw_me, sw_d),
                "slow": slow,
            })  # fmt: skip
        pos += n
        times = sorted(r["ms"] for r in rows)
        p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        tail = [r for r in rows if r["ms"] >= p99]
        print(f"\n== {phase}: {n} calls, p50 {statistics.median(times):.3f} ms, "
              f"p99 {p99:.3f} ms; {len(tail)} calls >= p99")  # fmt: skip
        checks: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
            ("client GC pass inside", lambda r: bool(r["client_gc"])),
            ("daemon GC pass inside", lambda r: bool(r["daemon_gc"])),
            ("daemon loop stall inside", lambda r: r["stall_ms"] > 0),
            ("daemon loop busy (not waiting for a CPU)", lambda r: r["busy_stall_ms"] > 0),
            ("client threads waited for a CPU > 0.2 ms", lambda r: r["runq_client_ms"] > 0.2),
            ("daemon threads waited for a CPU > 0.2 ms", lambda r: r["runq_daemon_ms"] > 0.2),
            (
                "client + daemon waited for a CPU > half the call",
                lambda r: r["runq_client_ms"] + r["runq_daemon_ms"] > r["ms"] / 2,
            ),
            ("uvloop slow callback inside", lambda r: bool(r["slow"])),
        ]
        for label, test in checks:
            print(f"  {label:45s} tail {sum(map(test, tail)):4d}/{len(tail):<4d} "
                  f"all {sum(map(test, rows)):5d}/{len(rows)}")  # fmt: skip
        for who, i in (("client", 0), ("daemon", 1)):
            per = [r["switches"][i] for r in rows]
            print(f"  {who} thread wake-ups per call: median "
                  f"{statistics.median(per):g}, in the tail calls "
                  f"{statistics.median(r['switches'][i] for r in tail):g}")  # fmt: skip
        hs = [r["handler_ms"] for r in rows if r["handler_ms"] is not None]
        if hs:
            ht = [r["handler_ms"] for r in tail if r["handler_ms"] is not None]
            print(
                f"  daemon handler wall p50 {statistics.median(hs):.3f} ms; "
                f"in the tail calls median {statistics.median(ht) if ht else 0:.3f} ms"
            )
        for r in sorted(tail, key=lambda r: -r["ms"])[:8]:
            print(f"   {r['ms']:7.3f} ms  client gc {r['client_gc']} ({r['client_gc_ms']:.2f}"
                  f" ms)  daemon gc {r['daemon_gc']}  stall {r['stall_ms']:.2f}  handler "
                  f"{r['handler_ms'] or 0:.3f} (cpu {r['handler_cpu_ms'] or 0:.3f})  loop busy "
                  f"{r['busy_stall_ms']:.2f}  run-queue"
                  f" client {r['runq_client_ms']:.2f} daemon {r['runq_daemon_ms']:.2f}"
                  + (f"  slow: {r['slow'][0][:120]}" if r["slow"] else ""))  # fmt: skip
    d_gc = d["gc"]
    if calls:
        timed = [g for g in d_gc if calls[0][0] <= g[0] <= calls[-1][1]]
        freed = sum(g[3] for g in timed)
        print(f"daemon cycle collector during the timed calls: {len(timed)} passes "
              f"({', '.join(f'{(g[1] - g[0]) * 1e3:.2f}' for g in timed)} ms), "
              f"{freed} objects freed ({freed / len(calls):.1f} per call)")  # fmt: skip
    print(
        f"\nclient GC passes during the timed calls: "
        f"{sum(1 for g in client_gc if calls and calls[0][0] <= g[0] <= calls[-1][1])}; "
        f"daemon GC passes (whole run): {len(d_gc)}, loop stalls: {len(d['stalls'])}, "
        f"of which busy: {len(busy)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--lookup-iters", type=int, default=2000)
    p.add_argument("--full", action="store_true", help="the data-path rows first, as bench")
    p.add_argument("--repeats", type=int, default=4, help="data-path rounds with --full")
    p.add_argument("--loop-debug", action="store_true", help="uvloop debug: slow callbacks")
    p.add_argument("--json", type=Path, help="write the raw records here")
    args = p.parse_args(argv)
    from kvserver.grpc_engine import use_polling_engine

    use_polling_engine()  # as kvserver bench's client (GRPC_EXPERIMENTS= keeps the defaults)
    work = Path(tempfile.mkdtemp(prefix="kvtail-"))
    try:
        return _run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    """The run of :func:`main`, its probe files (the daemon's ``sitecustomize``) in ``work``."""
    import benchmarks.bench_daemon as bd
    import benchmarks.daemon_lookup as dl
    from benchmarks import daemon_refs

    (work / "sitecustomize.py").write_text(
        "import benchmarks.lookup_tail as t\nt.install_daemon_probe()\n"
    )
    out = work / "daemon.json"
    tree = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(work), tree, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ[PROBE_ENV] = str(out)
    if args.loop_debug:
        os.environ[DEBUG_ENV] = "1"

    daemon_pid: list[int] = []

    def find_pid() -> int | None:
        if not daemon_pid:
            for ready in Path(tempfile.gettempdir()).glob("kvbench-*/ready.json"):
                pid = int(json.loads(ready.read_text())["pid"])
                if os.path.exists(f"/proc/{pid}/environ"):
                    try:
                        if str(out).encode() in Path(f"/proc/{pid}/environ").read_bytes():
                            daemon_pid.append(pid)
                    except PermissionError:
                        continue
        return daemon_pid[0] if daemon_pid else None

    clock = _Clock(find_pid)
    shim = type("T", (), {"perf_counter": staticmethod(clock.perf_counter)})
    setattr(dl, "time", shim)  # noqa: B010 (the module's own name for the clock)
    client_gc: list[Any] = []
    gc.callbacks.append(_gc_recorder(client_gc))
    iters = args.lookup_iters
    token_iters = max(1, iters // 10)
    cfg = bd.BenchConfig(
        sizes=(256 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024) if args.full else (1 << 20,),
        repeats=args.repeats, batch_bytes=64 << 20, lookup_iters=iters,
        token_iters=token_iters, dram=bd.DEFAULT_DRAM, progress=False, redis_server=None,
    )  # fmt: skip
    if args.full:
        results, _ = bd.run(cfg, None)
    else:
        env = daemon_refs.MALLOC_ENV if daemon_refs.tune_malloc() else {}
        with (
            tempfile.TemporaryDirectory(prefix="kvbench-") as wd,
            daemon_refs.own_daemon(
                cfg.dram, Path(wd), env or {"KVSERVER_TUNE_MALLOC": "0"}
            ) as target,
        ):
            results = dl.bench_lookup(
                target, bd._spec(1024, "lookup"), iters, token_iters, bd._Progress(0, False),
                bd.CLIENT_TIMEOUT_S,
            )  # fmt: skip
    for r in results:
        if "Lookup" in r.name or "Health" in r.name:
            print(f"{r.name}: {r.value:.3f} {r.unit}")
    daemon: Record = json.loads(out.read_text())
    print(f"load average {os.getloadavg()}")
    analyse(clock.calls, [iters, token_iters, token_iters, iters], client_gc, daemon)
    if args.json:
        args.json.write_text(json.dumps({"calls": clock.calls, "client_gc": client_gc,
                                         "daemon": daemon}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
