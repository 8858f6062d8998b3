"""benchmarks/harness/placement.py: the CPUs each placement gives each side, the choices
``--placement`` runs and in which order, the kernel's CPU lists read back; a real process
started inside ``spawning_on`` has every thread (one it starts later too) on those CPUs, and
``check`` names a process with a thread elsewhere. ``bench_peers.measure`` under a controlled
placement: every thread of this process, of the fetching daemons and of the sending side
checked where the placement put it (a real fleet on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.placement import (
    check,
    parse_cpu_list,
    pin_threads,
    placement,
    placements,
    rotated,
    spawning_on,
    thread_masks,
)


def test_each_placement_gives_each_side_its_cpus() -> None:
    assert placement("free", [3, 1, 2]).receiving == placement("free", [3, 1, 2]).sending == (
        1, 2, 3)  # fmt: skip
    same = placement("same", {5, 4})
    assert same.receiving == same.sending == (4,)
    split = placement("split", [7, 2, 9])
    assert (split.receiving, split.sending) == ((2,), (7,))
    assert split.describe() == {"name": "split", "receiving_cpus": [2], "sending_cpus": [7]}
    with pytest.raises(ValueError, match="two CPUs"):
        placement("split", [0])
    with pytest.raises(ValueError, match="one of"):
        placement("apart", [0, 1])


def test_all_runs_every_placement_each_first_in_turn() -> None:
    assert placements("all") == ["free", "same", "split"]
    assert placements("same") == ["same"]
    with pytest.raises(ValueError, match="or all"):
        placements("both")
    orders = [rotated(["free", "same", "split"], i) for i in range(3)]
    assert [o[0] for o in orders] == ["free", "same", "split"]
    assert all(sorted(o) == ["free", "same", "split"] for o in orders)


def test_cpu_lists_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0") == (0,)
    assert parse_cpu_list("0-1\n") == (0, 1)
    assert parse_cpu_list("0,2-4,7") == (0, 2, 3, 4, 7)


THREADED = (
    "import threading, sys; threading.Thread(target=sys.stdin.read).start(); sys.stdin.read()"
)


def test_a_process_started_on_cpus_keeps_every_thread_there() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    want = cpus[-1:]
    before = os.sched_getaffinity(0)
    with spawning_on(want):
        proc = subprocess.Popen([sys.executable, "-c", THREADED], stdin=subprocess.PIPE)
    try:
        assert os.sched_getaffinity(0) == before  # the caller's own mask is back
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 2:  # its second thread
            assert proc.poll() is None
        masks = thread_masks(proc.pid)
        assert sum(masks.values()) >= 2
        check({"child": masks}, {"child": tuple(want)})
        if len(cpus) > 1:  # a process elsewhere is named
            with pytest.raises(AssertionError, match="child"):
                check({"child": masks}, {"child": tuple(cpus[:1])})
            pin_threads(proc.pid, cpus[:1])  # moved, every thread
            check({"child": thread_masks(proc.pid)}, {"child": tuple(cpus[:1])})
    finally:
        proc.communicate(b"")


def test_bench_peers_runs_fetches_and_reference_where_the_placement_says(tmp_path: Path) -> None:
    from benchmarks.bench_peers import SENDING, measure
    from kvserver.daemon.malloc import MALLOC_ENV

    cpus = os.sched_getaffinity(0)
    place = placement("split" if len(cpus) > 1 else "same", cpus)
    env = dict(os.environ, **MALLOC_ENV)
    try:
        result = measure(tmp_path, 4 << 20, 1, env, 32 << 20, place)
    finally:
        pin_threads(os.getpid(), cpus)  # every thread of this process back where it was
    assert result["placement"]["name"] == place.name
    masks = result["thread_masks"]
    assert {"bench", "a", "a_sec", "stream", "zmq", "tls", "curve"} <= set(masks)
    for name, counts in masks.items():
        side = place.sending if name in SENDING else place.receiving
        assert {parse_cpu_list(m) for m in counts} == {side}, (name, counts)
    assert masks["bench"][",".join(map(str, place.receiving))] >= 2  # ZMQ's I/O threads too
    assert result["fetch_ms_median"] > 0 and result["reference_ms_median"] > 0
