"""A co-located client stalled past its store lease: the daemon quarantines the expired
reservation's pages (no other key's chunk is made of them before the quarantine ends), and a
client refuses to copy into a grant whose deadline has passed. Loads alike: an expired load
lease's chunks are held from eviction for the quarantine (a stalled reader's late copy reads
their bytes, never another key's), and a client neither starts copying out of a load grant
past its deadline nor returns what it copied when the copy finished past it.

Real daemon processes and co-located clients on this host (shared-memory arena); a stalled
client's late copy is its own ``write`` at its grant's extents, as a copy in progress when it
stalled would be.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvserver.client.calls as client_calls
from kvserver import grants
from kvserver.client import KVClient
from kvserver.errors import LeaseExpired
from kvserver.grants import LoadGrant
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

SPEC = make_spec()  # one 4 KiB page per part
ARENA = 1 << 20


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "1MiB")
    yield d
    d.kill()


@pytest.mark.parametrize("local", [True, False], ids=["local-channel", "zmq"])
def test_a_late_copy_into_an_expired_reservation_never_lands_in_another_keys_chunk(
    daemon: DaemonProc, local: bool
) -> None:
    """Client a's reservation expires while it is stalled mid-copy; client b stores another
    key right after. b's chunk must not be made of a's pages (a still writes into them when it
    wakes up): before the quarantine, b got exactly a's page and was served a's bytes.
    ``zmq``: a reservation made over ZMQ is copied into by a co-located writer too (here a
    client that mapped the arena but sends over ZMQ; in a deployment the scheduler's, whose
    grants its co-located workers copy into), so the daemon cannot tell a remote reservation,
    which only its own write_parts fills, from one written from outside, and quarantines
    both."""
    with KVClient(daemon.zmq_address, local=local) as a, KVClient(daemon.zmq_address) as b:
        ns_id = a.register_namespace(SPEC).ns_id
        b.register_namespace(SPEC)
        (key_a,), (key_b,) = make_keys(1, tag="a"), make_keys(1, tag="b")
        grant = a.prepare_store(ns_id, [key_a], lease_s=0.3)
        assert grant is not None and a.is_colocated and a.is_local is local
        wait_until(lambda: b.stats()["totals"]["expired_leases"] == 1)
        part_b = pattern(key_b, 0, SPEC.part_bytes)
        assert b.store(ns_id, [key_b], [part_b]) == [key_b]
        a.write(grant.locations[0][0], pattern(key_a, 0, SPEC.part_bytes))  # the stalled copy
        assert bytes(b.get(ns_id, [key_b])[0][0]) == part_b, "a's late copy landed in b's chunk"
        stats = b.stats()
        assert stats["quarantined_pages"] == 1 and stats["totals"]["quarantined_chunks"] == 1
        with pytest.raises(LeaseExpired):
            a.complete_store(grant.lease_id)
        assert b.lookup(ns_id, [key_a]).hit_chunks == 0


def test_quarantined_pages_drain_by_time(tmp_path: Path) -> None:
    """A reservation of the whole arena expires: its pages are quarantined for the default
    lease, then free again, and a store of the whole arena succeeds (nothing stays wedged)."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "1MiB", "--default-lease-s", "1")
    try:
        with KVClient(d.zmq_address) as c:
            ns_id = c.register_namespace(SPEC).ns_id
            pages = ARENA // SPEC.part_bytes
            assert c.prepare_store(ns_id, make_keys(pages, tag="a")) is not None
            wait_until(lambda: c.stats()["totals"]["quarantined_chunks"] == pages)
            keys = make_keys(pages, tag="b")
            parts = [pattern(k, 0, SPEC.part_bytes) for k in keys]
            wait_until(lambda: c.stats()["quarantined_pages"] == 0)
            assert c.store(ns_id, keys, parts) == keys
            assert c.stats()["free_pages"] == 0
    finally:
        d.kill()


def test_a_client_that_wakes_up_after_its_grant_expired_writes_nothing(
    daemon: DaemonProc,
) -> None:
    """A co-located store whose grant is past its deadline before the copy starts (a lease
    shorter than the round trip) raises LeaseExpired and leaves every arena byte as it was;
    ``write`` given the grant refuses likewise. Before: the bytes were copied, then
    complete_store said LeaseExpired."""
    with KVClient(daemon.zmq_address) as c:
        ns_id = c.register_namespace(SPEC).ns_id
        whole = ((0, ARENA),)
        before = c.read(whole)
        key = make_keys(1, tag="late")[0]
        with pytest.raises(LeaseExpired):
            c.store(ns_id, [key], [pattern(key, 0, SPEC.part_bytes)], lease_s=1e-6)
        assert c.read(whole) == before, "the expired grant's pages were written"
        grant = c.prepare_store(ns_id, make_keys(1, tag="late2"), lease_s=1e-6)
        assert grant is not None
        with pytest.raises(LeaseExpired):
            c.write(grant.locations[0][0], pattern(key, 0, SPEC.part_bytes), grant=grant)
        assert c.read(whole) == before


def test_a_late_copy_out_of_an_expired_load_never_reads_another_keys_bytes(
    tmp_path: Path,
) -> None:
    """Client a's load lease expires while it is stalled before its copy out; client b then
    stores as many chunks as the arena has pages. a's chunk is held (not evictable) for the
    quarantine, so b's store does not fit and a's late copy reads a's bytes. Was: b's store
    evicted a's chunk and recycled its page, and a's late copy read b's bytes."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "1MiB", "--policy", "lru")
    try:
        with KVClient(d.zmq_address) as a, KVClient(d.zmq_address) as b:
            ns_id = a.register_namespace(SPEC).ns_id
            b.register_namespace(SPEC)
            (key_a,) = make_keys(1, tag="a")
            part_a = pattern(key_a, 0, SPEC.part_bytes)
            assert a.store(ns_id, [key_a], [part_a]) == [key_a]
            grant = a.prepare_load(ns_id, [key_a], lease_s=0.3)
            assert a.is_colocated and a.is_local
            wait_until(lambda: b.stats()["totals"]["expired_leases"] == 1)
            pages = ARENA // SPEC.part_bytes
            keys = make_keys(pages, tag="b")
            parts = [pattern(k, 0, SPEC.part_bytes) for k in keys]
            assert b.store(ns_id, keys, parts) == [], "an expired load's chunk was evicted"
            assert a.read(grant.locations[0][0]) == part_a  # the stalled copy, late
            with pytest.raises(LeaseExpired):
                a.read(grant.locations[0][0], grant=grant)
            stats = b.stats()
            assert stats["quarantined_load_pages"] == 1
            assert stats["totals"]["quarantined_load_chunks"] == 1
            assert b.lookup(ns_id, [key_a]).hit_chunks == 1  # still served meanwhile
            assert b.store(ns_id, keys[1:], parts[1:]) == keys[1:]  # the other pages
            with pytest.raises(LeaseExpired):
                a.complete_load(grant.lease_id)
    finally:
        d.kill()


#: the default lease of the daemon the client-load tests use: what a load's grant gets
SHORT_LEASE_S = 0.5


@pytest.fixture
def short_lease_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(
        tmp_path, "--page-size", "4KiB", "--dram", "1MiB", "--default-lease-s", str(SHORT_LEASE_S)
    )
    yield d
    d.kill()


def test_a_client_load_does_not_start_copying_out_of_an_expired_grant(
    short_lease_daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A co-located client stalls between receiving its load grant and copying (injected:
    right after the grant is decoded, until its deadline has passed): the load raises
    LeaseExpired without copying a byte, and ``read`` given the grant likewise. Before: it
    copied, then complete_load said LeaseExpired."""
    copies: list[object] = []
    real_copy = client_calls.readinto_part
    # the grant is decoded by one of two functions: packed (a daemon announcing
    # "packed_load_grant", as this one does) or the map form; stall both
    real_grants = {
        name: getattr(grants, name)
        for name in ("load_grant_from_wire", "packed_load_grant_from_wire")
    }

    def counted(*args: Any) -> None:
        copies.append(args)
        real_copy(*args)

    def stalled(name: str) -> Any:
        def stalled_grant(*args: Any) -> LoadGrant:
            grant: LoadGrant = real_grants[name](*args)
            wait_until(lambda: time.monotonic() > grant.deadline)
            return grant

        return stalled_grant

    with KVClient(short_lease_daemon.zmq_address) as c:
        ns_id = c.register_namespace(SPEC).ns_id
        (key,) = make_keys(1, tag="load-late")
        assert c.store(ns_id, [key], [pattern(key, 0, SPEC.part_bytes)]) == [key]
        monkeypatch.setattr(client_calls, "readinto_part", counted)
        for name in real_grants:
            monkeypatch.setattr(grants, name, stalled(name))
        with pytest.raises(LeaseExpired):  # the client's, or complete_load's after it
            c.load(ns_id, [key])
        assert copies == [], "copied out of an expired grant"
        grant = c.prepare_load(ns_id, [key])
        with pytest.raises(LeaseExpired, match="nothing copied"):
            c.read(grant.locations[0][0], grant=grant)


def test_a_client_load_whose_copy_finishes_after_its_deadline_returns_nothing(
    short_lease_daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A co-located load stalls in its copy out (injected) until past the grant's deadline:
    it raises LeaseExpired instead of returning the bytes (the daemon may have reused the
    pages after the quarantine), whatever complete_load answers."""
    real = client_calls.readinto_part

    def stalled(*args: Any) -> None:
        until = time.monotonic() + SHORT_LEASE_S  # past the deadline: its send + the lease
        wait_until(lambda: time.monotonic() > until)
        real(*args)

    with KVClient(short_lease_daemon.zmq_address) as c:
        ns_id = c.register_namespace(SPEC).ns_id
        (key,) = make_keys(1, tag="load-slow")
        assert c.store(ns_id, [key], [pattern(key, 0, SPEC.part_bytes)]) == [key]
        monkeypatch.setattr(client_calls, "readinto_part", stalled)
        with pytest.raises(LeaseExpired):
            c.load(ns_id, [key])
        monkeypatch.setattr(client_calls, "readinto_part", real)
        assert bytes(c.load(ns_id, [key])[0][0]) == pattern(key, 0, SPEC.part_bytes)
