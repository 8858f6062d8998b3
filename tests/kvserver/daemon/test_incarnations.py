"""A daemon SIGKILLed and restarted on the same port, with clients of the killed one still
holding its leases: the lease ids one incarnation grants are never another's. And a
starting daemon removes the arenas of dead daemons by their lock, not by the pid in the name.

Real daemon processes on loopback; the stale client is a real ``KVClient`` that keeps its
session across the restart (its DEALER reconnects to the new daemon by itself), as the
scheduler's does.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.errors import LeaseError
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, port_kept, start_daemon

pytestmark = pytest.mark.multiprocess

SPEC = make_spec()
ARGS = ("--page-size", "4KiB", "--dram", "1MiB")


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[DaemonProc]]:
    procs: list[DaemonProc] = []
    yield procs
    for proc in procs:
        proc.kill()


def restart(tmp_path: Path, started: list[DaemonProc]) -> DaemonProc:
    """SIGKILL the daemon listening now and start the next one on its ZMQ port."""
    old = started[-1]
    old.kill()
    port = str(old.info["zmq_port"])
    started.append(start_daemon(tmp_path / f"d{len(started)}", *ARGS, "--zmq-port", port))
    return started[-1]


def test_a_stale_store_completion_cannot_complete_the_new_daemons_reservation(
    tmp_path: Path, started: list[DaemonProc]
) -> None:
    """Client A reserved a chunk in the killed daemon; after the restart client B reserves
    another and has not written it yet when A's late complete_store arrives: it must fail,
    not make B's unwritten chunk READY (its pages would be served as B's chunk)."""
    started.append(start_daemon(tmp_path / "d0", *ARGS, *port_kept()))
    with KVClient(started[-1].zmq_address, colocated=False) as a:
        ns_id = a.register_namespace(SPEC).ns_id
        grant_a = a.prepare_store(ns_id, make_keys(1, tag="a"))
        assert grant_a is not None and grant_a.lease_id
        restarted = restart(tmp_path, started)
        with KVClient(restarted.zmq_address, colocated=False) as b:
            assert b.register_namespace(SPEC).ns_id == ns_id
            key_b = make_keys(1, tag="b")
            grant_b = b.prepare_store(ns_id, key_b)
            assert grant_b is not None
            with pytest.raises(LeaseError):
                a.complete_store(grant_a.lease_id)
            assert b.lookup(ns_id, key_b).hit_chunks == 0  # still WRITING: invisible
            part = pattern(key_b[0], 0, SPEC.part_bytes)
            assert b.write_parts(grant_b.lease_id, key_b, 0, [part]) == key_b  # completes
            assert b.get(ns_id, key_b)[0] == [part]


def test_a_stale_load_completion_cannot_unpin_the_new_daemons_load(
    tmp_path: Path, started: list[DaemonProc]
) -> None:
    """Client A pinned a chunk in the killed daemon; after the restart client B pins one for a
    load; A's late complete_load must fail and leave B's pins (else an eviction could reuse
    the pages B is still reading)."""
    started.append(start_daemon(tmp_path / "d0", *ARGS, *port_kept()))
    with KVClient(started[-1].zmq_address, colocated=False) as a:
        ns_id = a.register_namespace(SPEC).ns_id
        key = make_keys(1, tag="k")
        a.put(ns_id, key, [[pattern(key[0], 0, SPEC.part_bytes)]])
        grant_a = a.prepare_load(ns_id, key)
        restarted = restart(tmp_path, started)
        with KVClient(restarted.zmq_address, colocated=False) as b:
            b.register_namespace(SPEC)
            b.put(ns_id, key, [[pattern(key[0], 0, SPEC.part_bytes)]])
            grant_b = b.prepare_load(ns_id, key)
            with pytest.raises(LeaseError):
                a.complete_load(grant_a.lease_id)
            b.complete_load(grant_b.lease_id)  # B's pins were still B's to end


def test_a_starting_daemon_reaps_by_lock_not_by_pid(
    tmp_path: Path, started: list[DaemonProc]
) -> None:
    """In a shared /dev/shm the pid in an arena's name proves nothing: a SIGKILLed daemon's
    arena named with a pid that runs again (pid 1 of a restarted container) is removed by the
    next start, and a live daemon's arena named with a pid not running here (a daemon in
    another pid namespace) is kept. Real daemons; the names are set by renaming the files."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"KVSERVER_SHM_DIR": str(shm)}
    killed = start_daemon(tmp_path / "d0", *ARGS, env=env)
    started.append(killed)
    killed.kill()
    arena = Path(killed.arena_path)
    assert arena.exists()  # left behind
    reused = shm / "kvserver-1-0badf00d"  # pid 1 is always running
    arena.rename(reused)
    live = start_daemon(tmp_path / "d1", *ARGS, env=env)
    started.append(live)
    assert not reused.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    elsewhere = shm / f"kvserver-{int(dead.stdout)}-0c0ffee0"
    Path(live.arena_path).rename(elsewhere)
    started.append(start_daemon(tmp_path / "d2", *ARGS, env=env))
    assert elsewhere.exists()
