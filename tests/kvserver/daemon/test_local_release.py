"""A co-located client's local-channel connection closes: its leases are released at once only
when its process is gone, never under a live client that may still copy into their pages.

Real daemon processes and clients on this host; the daemon is SIGSTOPped so that a call times
out for real (the client then closes its links, as it does on every timeout).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.errors import Unavailable
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

SPEC = make_spec()
#: what the daemon logs when a local connection closes with leases outstanding
RELEASED, KEPT = "its connection closed", "its process is alive"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "1MiB")
    yield d
    d.kill()


def test_a_live_client_whose_call_timed_out_keeps_its_reservation(daemon: DaemonProc) -> None:
    """A co-located client reserves a chunk; one of its calls times out (the daemon stalls),
    so it closes its local channel. Its reservation must stay its own: were it released, the
    next store would get its pages, and the client's copy (its grant is all it knows) would
    overwrite that READY chunk, served as the other key's bytes."""
    with KVClient(daemon.zmq_address) as a, KVClient(daemon.zmq_address, colocated=False) as b:
        ns_id = a.register_namespace(SPEC).ns_id
        b.register_namespace(SPEC)
        (key_a,), (key_b,) = make_keys(1, tag="a"), make_keys(1, tag="b")
        grant = a.prepare_store(ns_id, [key_a])
        assert grant is not None and a.is_local
        a.timeout = 0.5
        os.kill(daemon.info["pid"], signal.SIGSTOP)
        try:
            with pytest.raises(Unavailable):
                a.lookup(ns_id, [key_a])
        finally:
            os.kill(daemon.info["pid"], signal.SIGCONT)
        wait_until(lambda: RELEASED in daemon.log() or KEPT in daemon.log())
        a.timeout = b.timeout = 10.0
        part_b = pattern(key_b, 0, SPEC.part_bytes)
        stored = b.prepare_store(ns_id, [key_b])
        assert stored is not None
        assert b.write_parts(stored.lease_id, [key_b], 0, [part_b]) == [key_b]
        part_a = pattern(key_a, 0, SPEC.part_bytes)
        a.write(grant.locations[0][0], part_a)  # what its grant lets it do
        assert bytes(b.get(ns_id, [key_b])[0][0]) == part_b, "another client's copy landed in it"
        assert a.complete_store(grant.lease_id) == [key_a]
        assert bytes(b.get(ns_id, [key_a])[0][0]) == part_a


async def test_the_exit_watch_tells_an_exited_process_from_a_live_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ExitWatch over real child processes: one killed after its connection closed counts as
    gone (the release happens when it exits, within the grace), one that lives on past the
    grace as alive; an unknown process (no pidfd) as alive."""
    import asyncio
    import subprocess
    import sys

    from kvserver.daemon import local_exits

    monkeypatch.setattr(local_exits, "EXIT_GRACE_S", 1.0)
    watch = local_exits.ExitWatch()
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(2)]  # fmt: skip
    try:
        outcomes: dict[str, asyncio.Future[str]] = {}
        loop = asyncio.get_running_loop()
        for name, child in zip(("killed", "living"), children, strict=True):
            fut = outcomes[name] = loop.create_future()
            watch.closed(
                os.pidfd_open(child.pid),
                lambda fut=fut: fut.set_result("gone"),
                lambda fut=fut: fut.set_result("alive"),
            )
        assert watch.num_watched == 2
        children[0].kill()
        assert await asyncio.wait_for(outcomes["killed"], 10) == "gone"
        assert await asyncio.wait_for(outcomes["living"], 10) == "alive"
        assert watch.num_watched == 0
        unknown: list[str] = []
        watch.closed(None, lambda: unknown.append("gone"), lambda: unknown.append("alive"))
        assert unknown == ["alive"]
    finally:
        for child in children:
            child.kill()
            child.wait()
