"""The local channel wakes no daemon thread but the loop's: each request is read, carried out
and answered on the event loop thread, without a hop to another thread (counted from the
daemon's per-thread context switches in /proc; the same count over ZMQ sees the hop through
the daemon's ZMQ I/O thread, so the measure can tell)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_keys
from tests.support.daemon import DaemonProc, start_daemon

SPEC = NamespaceSpec(model="test/local-wakeups", dtype="float16", num_layers=1, num_kv_heads=1,
                     head_dim=8, block_size=4)  # fmt: skip
PAIRS = 400  # prepare_store + complete_store: 800 requests

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("wakeups"), "--page-size", "4KiB", "--dram", "16MiB")
    yield d
    assert d.terminate() == 0, d.log()


def switches(pid: int) -> dict[str, int]:
    """Context switches (voluntary + involuntary) of each thread of ``pid``, by "tid name"."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text().splitlines()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        n = sum(int(line.split()[1]) for line in status if "ctxt_switches:" in line)
        out[f"{task.name} {name}"] = n
    return out


def woken_per_thread(daemon: DaemonProc, local: bool) -> tuple[dict[str, int], int]:
    """Switches of each daemon thread while one client sends PAIRS store pairs, and how many
    requests that was."""
    with KVClient(daemon.zmq_address, local=local) as kv:
        ns = kv.register_namespace(SPEC).ns_id
        assert kv.is_local is local
        keys = make_keys(PAIRS, tag=f"wakeups-{local}")
        pid = daemon.proc.pid
        before = switches(pid)
        for key in keys:
            grant = kv.prepare_store(ns, [key])
            assert grant is not None and grant.keys == [key]
            assert kv.complete_store(grant.lease_id) == [key]
        after = switches(pid)
    return {t: after[t] - before.get(t, 0) for t in after}, 2 * PAIRS


def test_local_channel_requests_wake_only_the_loop_thread(daemon: DaemonProc) -> None:
    delta, requests = woken_per_thread(daemon, local=True)
    main = f"{daemon.proc.pid} "
    loop = sum(n for t, n in delta.items() if t.startswith(main))
    others = {t: n for t, n in delta.items() if not t.startswith(main) and n}
    # the loop thread sleeps between requests (at most one wake-up each, fewer when requests
    # queue up); every other thread wakes only on its own timers, not once per request
    assert loop > 0
    assert sum(others.values()) < requests // 4, others


def test_the_count_sees_the_hop_through_zmq(daemon: DaemonProc) -> None:
    """The control: over ZMQ every request and reply passes the daemon's ZMQ I/O thread."""
    delta, requests = woken_per_thread(daemon, local=False)
    io = sum(n for t, n in delta.items() if t.split(" ", 1)[1].startswith("ZMQbg/IO"))
    assert io >= requests, delta


def test_switch_count_reads_this_process() -> None:
    counts = switches(os.getpid())
    assert any(t.startswith(f"{os.getpid()} ") for t in counts)
    assert all(n >= 0 for n in counts.values())
