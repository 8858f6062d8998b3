"""The network tier's own leases cannot be ended by a client of the fetching daemon.

A fetch over the peer stream reserves DRAM pages and a worker thread receives the peer's
bytes straight into them; the serving side pins the pages it sends. Those leases belong to
the daemon (``kvserver-peer-fetch``, ``kvserver-peer-stream``, ...), not to any client: a
client that ended one (``release`` naming that owner, or ``complete_store`` / ``complete_load``
of its id) would give the pages back while bytes still land in them (or leave them), and the
next store to take those pages would be served with the peer's bytes. Real daemons: A holds
the chunk on SSD behind the read gate of ``test_zmq_promotion`` (so B's fetch is in flight,
its pages reserved, for as long as the test needs), B fetches it over A's stream.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.daemon.owners import FETCH_CLIENT
from kvserver.errors import InvalidArgument, KVServerError, PermissionDenied, UnknownKey
from tests.kvserver.builders import make_keys, pattern
from tests.kvserver.daemon.peers.test_tier import SLOW_SPEC
from tests.kvserver.daemon.test_zmq_promotion import gate_closed, start_gated
from tests.support.daemon import start_daemon, wait_until

pytestmark = pytest.mark.multiprocess


def end_by_release(b_address: str, after: int) -> None:
    """Release every lease of the owner the fetch's reservation has (refused, once fixed)."""
    with (
        KVClient(b_address, colocated=False, client_id=FETCH_CLIENT) as kv,
        contextlib.suppress(KVServerError),
    ):
        kv.release()


def end_by_lease_id(b_address: str, after: int) -> None:
    """Try every lease id granted after ``after`` (a lease the test took just before the
    fetch; ids count up from a random first id), as a client guessing them would: the
    fetch's is refused."""
    refused = 0
    with KVClient(b_address, colocated=False) as kv:
        for lease_id in range(after + 1, after + 64):
            try:
                kv.complete_store(lease_id, success=False)
            except PermissionDenied:
                refused += 1
            except KVServerError:
                pass
    assert refused == 1


@pytest.mark.parametrize("attack", [end_by_release, end_by_lease_id])
def test_a_client_cannot_end_a_fetchs_reservation_while_bytes_land_in_it(
    tmp_path: Path, attack: object
) -> None:
    gate = tmp_path / "gate"
    (tmp_path / "a").mkdir()
    a = start_gated(tmp_path / "a", gate)
    # B's DRAM is one chunk (3 pages): the fetch reserves all of it
    b = start_daemon(tmp_path / "b", "--dram", "12KiB", "--page-size", "4KiB",
                     "--peers", a.zmq_address, "--peer-timeout-s", "30")  # fmt: skip
    try:
        keys = make_keys(60, tag="cold")  # A's DRAM holds 40: the first ones go to SSD only
        data = {k: [pattern(k, 0, SLOW_SPEC.part_bytes)] for k in keys}
        with KVClient(a.zmq_address) as kv:
            kv.register_namespace(SLOW_SPEC)
            wait_until(lambda: kv.stats()["ssd"]["unsaved_namespaces"] == 0)
            for i in range(0, len(keys), 6):
                batch = keys[i : i + 6]
                assert kv.store(SLOW_SPEC.ns_id, batch, [data[k] for k in batch]) == batch
            wait_until(lambda: kv.stats()["ssd"]["writes_in_flight"] == 0)
            cold = [k for k in keys if kv.lookup(SLOW_SPEC.ns_id, [k]).tiers.get("ssd") == 1]
        assert cold
        (mine,) = make_keys(1, tag="mine")
        my_part = pattern(mine, 7, SLOW_SPEC.part_bytes)
        with (
            KVClient(b.zmq_address, colocated=False, timeout=40) as kv,
            ThreadPoolExecutor(1) as pool,
        ):
            kv.register_namespace(SLOW_SPEC)
            probe = kv.prepare_store(SLOW_SPEC.ns_id, make_keys(1, tag="probe"))
            assert probe is not None  # the lease granted just before the fetch's
            kv.complete_store(probe.lease_id, success=False)
            with gate_closed(gate) as wait_for_read:

                def load() -> list[list[bytes]]:
                    with KVClient(b.zmq_address, colocated=False, timeout=40) as other:
                        other.register_namespace(SLOW_SPEC)
                        got = other.load(SLOW_SPEC.ns_id, cold[:1])
                        return [[bytes(p) for p in row] for row in got]

                waiting = pool.submit(load)
                wait_for_read()  # A is reading the chunk; B's pages for it are reserved
                assert kv.stats()["peer"]["fetching_chunks"] == 1
                attack(b.zmq_address, probe.lease_id)  # type: ignore[operator]
                # a store that would take the reserved pages if they had been given back
                stored = kv.store(SLOW_SPEC.ns_id, [mine], [[my_part]])
            # the gate opens: A sends the chunk into whatever B reserved for it (or B had no
            # room for it: a miss is fine, a wrong byte is not)
            with contextlib.suppress(UnknownKey):
                assert waiting.result(timeout=40) == [data[cold[0]]]
            if stored:
                assert [[bytes(p) for p in row] for row in kv.load(SLOW_SPEC.ns_id, [mine])] == [
                    [my_part]
                ]
            held = kv.stats()
            assert held["peer"]["fetching_chunks"] == 0
    finally:
        a.kill()
        b.kill()


def test_a_client_may_not_name_a_lease_owner_of_the_daemon(tmp_path: Path) -> None:
    """Over ZMQ and over the local channel alike, the admin too."""
    b = start_daemon(tmp_path / "b", "--dram", "1MiB")
    try:
        for colocated in (False, True):
            with KVClient(b.zmq_address, colocated=colocated) as kv:
                kv.hello()  # a session (and, colocated, the local channel) as any client's
                assert kv.is_colocated is colocated
                kv._s.client_id = FETCH_CLIENT  # then a request naming the daemon's owner
                with pytest.raises(InvalidArgument, match="reserved for the daemon"):
                    kv.release()
    finally:
        b.kill()
