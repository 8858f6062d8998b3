"""Where a thread's wall time goes besides its own instructions, from the kernel's accounts.

Linux only (``/proc/self/task/<tid>/schedstat`` and ``getrusage(RUSAGE_THREAD)``); every
figure is the kernel's own bookkeeping, so load on the machine does not bias it the way it
biases a timer. Used by ``bench_scheduler.py --breakdown``. Per timed region of the measuring
thread (call :meth:`ThreadProbe.start` right before the region's clocks, :meth:`stop` right
after them; the probe's own reads stay outside the region):

- ``runqueue_us``: time the thread was runnable but another task had its CPU (preempted);
- ``invol_switches`` / ``vol_switches``: involuntary (preempted) and voluntary (it blocked)
  context switches;
- ``sys_us``: its CPU time in the kernel (system calls), a part of its ``time.thread_time``;
- ``other_threads_us``: CPU time the process's other threads (ZMQ's I/O thread, ...) used
  meanwhile, on whichever CPU: with the process pinned to one CPU, time taken from the
  measured thread's CPU.
"""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass, field

FIELDS = ("runqueue_us", "invol_switches", "vol_switches", "sys_us", "other_threads_us")


def available() -> bool:
    """True where the kernel keeps the per-thread accounts this probe reads."""
    tid = threading.get_native_id()
    return hasattr(resource, "RUSAGE_THREAD") and os.path.exists(f"/proc/self/task/{tid}/schedstat")


@dataclass
class ThreadProbe:
    """Sums, over the regions measured, of the kernel's accounts for the calling thread."""

    tid: int = field(default_factory=threading.get_native_id)
    regions: int = 0
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0.0))
    _start: tuple[int, float, int, int, int] = (0, 0.0, 0, 0, 0)

    def _read(self) -> tuple[int, float, int, int, int]:
        with open(f"/proc/self/task/{self.tid}/schedstat") as f:
            wait_ns = int(f.read().split()[1])
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        other = 0
        for task in os.listdir("/proc/self/task"):
            if int(task) != self.tid:
                try:
                    with open(f"/proc/self/task/{task}/schedstat") as f:
                        other += int(f.read().split()[0])
                except OSError:  # the thread ended meanwhile
                    pass
        return wait_ns, ru.ru_stime, ru.ru_nivcsw, ru.ru_nvcsw, other

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> None:
        w1, s1, i1, v1, o1 = self._read()
        w0, s0, i0, v0, o0 = self._start
        t = self.totals
        t["runqueue_us"] += (w1 - w0) / 1e3
        t["sys_us"] += (s1 - s0) * 1e6
        t["invol_switches"] += i1 - i0
        t["vol_switches"] += v1 - v0
        t["other_threads_us"] += (o1 - o0) / 1e3
        self.regions += 1

    def per(self, steps: int) -> dict[str, float]:
        """The totals per step (``steps``: how many steps the regions covered)."""
        return {k: v / max(steps, 1) for k, v in self.totals.items()}
