"""The worker connector when its co-located daemon is SIGKILLed and restarted on the same port.

Every lease in the connector metadata names the daemon incarnation that granted it
(``granted_by``, the daemon's session id); a worker copies only for leases of the incarnation
whose arena it has mapped. Real daemon processes, the real scheduler-side connector, the
metadata through its wire format (tests/worker/builders.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvserver.client import KVClient  # noqa: E402
from step_protocol import ConnectorMetadata  # noqa: E402
from tests.support.daemon import DaemonProc, port_kept, start_daemon  # noqa: E402
from tests.worker.builders import Cluster, FakeRequest, make_spec, tokens  # noqa: E402
from tests.worker.test_kv_connector import ready_chunks  # noqa: E402

pytestmark = pytest.mark.multiprocess

ARGS = ("--page-size", "4KiB", "--dram", "8MiB")


class Daemons:
    """The daemon listening now, and how to kill it and start the next on its port."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started = [start_daemon(tmp_path / "d0", *ARGS, *port_kept())]

    @property
    def now(self) -> DaemonProc:
        return self.started[-1]

    def kill_and_restart(self) -> DaemonProc:
        """SIGKILL (the next daemon reaps its arena file), then a new one on the same port."""
        old = self.now
        old.kill()
        port = str(old.info["zmq_port"])
        name = f"d{len(self.started)}"
        self.started.append(start_daemon(self.tmp_path / name, *ARGS, "--zmq-port", port))
        return self.now


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    d = Daemons(tmp_path)
    yield d
    for proc in d.started:
        proc.kill()


@pytest.fixture
def cluster(daemons: Daemons, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(daemons.now.zmq_address, make_spec(f"test/{request.node.name}"))
    yield c
    c.close()


def sid(daemon: DaemonProc) -> str:
    """The daemon's incarnation: the session id its replies carry."""
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        return str(kv.hello()["sid"])


def test_a_load_pinned_by_the_killed_daemon_fails_and_the_new_arena_serves_at_once(
    daemons: Daemons, cluster: Cluster
) -> None:
    """A hit pinned by a daemon that is then SIGKILLed and restarted: its load fails (its
    extents are offsets in the dead arena) and is recomputed; the same step maps the new
    arena, and the next request is stored and loaded through it without a step lost."""
    c, w = cluster, cluster.workers[0]
    c.prefill(FakeRequest("a", tokens(33), c.spec))
    b = FakeRequest("b", tokens(33), c.spec)
    assert c.admit(b) == (32, True)  # pinned by the first daemon
    first = sid(daemons.now)
    restarted = daemons.kill_and_restart()
    meta, report = c.step(sync=True)
    assert [t.granted_by for t in meta.loads] == [first]
    assert report.finished_recving == {"b"} and report.load_errors == {"b": 0}
    assert report.invalid_block_ids == set(c.blocks["b"][:8])
    assert w.conn.arena is not None and w.conn.arena.path == restarted.arena_path
    x = FakeRequest("x", tokens(33, base=500), c.spec)
    c.prefill(x)  # stored through the new arena
    assert ready_chunks(restarted, x) == 4
    y = FakeRequest("y", tokens(33, base=500), c.spec)
    assert c.admit(y) == (32, True)
    meta, report = c.step(sync=True)
    assert [t.granted_by for t in meta.loads] == [sid(restarted)]
    assert report.finished_recving == {"y"} and not report.load_errors
    c.assert_same_kv(y, range(8))


def test_a_lease_of_another_incarnation_fails_even_with_the_new_arena_mapped(
    daemons: Daemons, cluster: Cluster
) -> None:
    """The worker has mapped the restarted daemon's arena when a lease of the killed one
    reaches it (however late the scheduler ships it): it fails and nothing is read; its
    extents would be valid offsets in the new arena, holding another chunk's bytes."""
    c, w = cluster, cluster.workers[0]
    first = sid(daemons.now)
    restarted = daemons.kill_and_restart()
    x = FakeRequest("x", tokens(33, base=900), c.spec)
    c.prefill(x)  # the worker found the old arena gone and mapped the new one
    assert w.conn.arena is not None and w.conn.arena.path == restarted.arena_path
    assert ready_chunks(restarted, x) == 4
    y = FakeRequest("y", tokens(33, base=900), c.spec)
    assert c.admit(y) == (32, True)

    def granted_by_the_killed_daemon(rank: int, meta: ConnectorMetadata) -> None:
        for t in meta.loads:
            t.granted_by = first

    _, report = c.step(tamper=granted_by_the_killed_daemon, sync=True)
    assert report.finished_recving == {"y"} and report.load_errors == {"y": 0}
    assert report.invalid_block_ids == set(c.blocks["y"][:8])
    assert all(w.block(b) == bytes(len(w.block(b))) for b in c.blocks["y"][:8])  # untouched
