"""Where a loopback benchmark's two sides run: both on one CPU, on two, or where the scheduler
puts them, set identically for a measurement and its reference (``benchmarks/bench_peers.py``).

On a 2-vCPU VM a loopback transfer costs about twice the CPU, and up to twice the wall time,
when its two ends run on two vCPUs rather than one (``docs/benchmarks.md``, "A 1 MiB fetch's
wire"); a fetch and its reference left to the scheduler each draw their own placement. A
:class:`Placement` names the CPUs of the receiving side and of the sending side; a process is
started on its side's CPUs with :func:`spawning_on` (it and every thread it starts inherit
them), a running one (this process, whose ZMQ I/O threads exist already) is moved thread by
thread with :func:`pin_threads`, and :func:`thread_masks` reads back what every thread of a
process really may use, for the report and for :func:`check`. Linux only (``/proc``,
``sched_setaffinity``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

#: free: where the scheduler puts each thread (the CPUs this process was given); same: both
#: sides on one CPU; split: the receiving side on one CPU, the sending side on another.
PLACEMENTS = ("free", "same", "split")


@dataclass(frozen=True)
class Placement:
    """A placement's name and the CPUs of each side (sorted tuples)."""

    name: str
    receiving: tuple[int, ...]
    sending: tuple[int, ...]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "receiving_cpus": list(self.receiving),
                "sending_cpus": list(self.sending)}  # fmt: skip


def placements(choice: str) -> list[str]:
    """The placements a ``--placement`` choice runs: ``all`` is every one of PLACEMENTS."""
    if choice == "all":
        return list(PLACEMENTS)
    if choice not in PLACEMENTS:
        raise ValueError(f"a placement is one of {', '.join(PLACEMENTS)} or all: {choice!r}")
    return [choice]


def rotated(names: list[str], run: int) -> list[str]:
    """``names`` starting at the ``run``-th: each placement as often first as the others."""
    k = run % len(names) if names else 0
    return names[k:] + names[:k]


def placement(name: str, cpus: Iterable[int]) -> Placement:
    """The placement ``name`` over ``cpus`` (the CPUs this process may use): ``same`` uses the
    lowest, ``split`` the lowest two (receiving side first), ``free`` all of them for both.
    ValueError for a name not in PLACEMENTS or ``split`` with fewer than two CPUs."""
    available = tuple(sorted(set(cpus)))
    if not available:
        raise ValueError("no CPU to place on")
    if name == "free":
        return Placement(name, available, available)
    if name == "same":
        return Placement(name, available[:1], available[:1])
    if name == "split":
        if len(available) < 2:
            raise ValueError(f"placement split needs two CPUs, this process has {available}")
        return Placement(name, available[:1], available[1:2])
    raise ValueError(f"a placement is one of {', '.join(PLACEMENTS)}: {name!r}")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A kernel CPU list (``Cpus_allowed_list``: ``"0"``, ``"0-1"``, ``"0,2-3"``), sorted."""
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, sep, hi = part.partition("-")
        out.update(range(int(lo), int(hi if sep else lo) + 1))
    return tuple(sorted(out))


def pin_threads(pid: int, cpus: Iterable[int]) -> None:
    """Every thread the process ``pid`` has now may run on ``cpus`` only (threads it starts
    later inherit their starter's mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), set(cpus))


@contextlib.contextmanager
def spawning_on(cpus: Iterable[int]) -> Iterator[None]:
    """The calling thread runs on ``cpus`` inside the block, so that a process it starts there
    (and every thread of that process) inherits them; its mask is restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def thread_masks(pid: int) -> dict[str, int]:
    """Per ``Cpus_allowed_list`` value, how many threads of the process ``pid`` have it."""
    counts: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        except (OSError, StopIteration):  # a thread that ended meanwhile
            continue
        mask = line.split(":", 1)[1].strip()
        counts[mask] = counts.get(mask, 0) + 1
    return counts


def check(masks: dict[str, dict[str, int]], expected: dict[str, tuple[int, ...]]) -> None:
    """AssertionError naming every process (``masks``: per process, :func:`thread_masks`)
    with a thread on other CPUs than ``expected`` gives it."""
    wrong = {
        name: counts
        for name, counts in masks.items()
        if any(parse_cpu_list(mask) != expected[name] for mask in counts)
    }
    assert not wrong, f"threads not on their placement's CPUs: {wrong}, expected {expected}"
