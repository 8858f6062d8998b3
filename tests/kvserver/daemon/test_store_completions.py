"""``prepare_store`` carrying completions (capability ``store_completions``, docs/wire.md §2),
against the real daemon process: the completions are applied first, each as its own
``complete_store``, then the reservation; old-style clients keep working; a client falls back
to separate ``complete_store`` calls when the daemon does not announce the capability."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvserver import wire
from kvserver.client import AsyncKVClient, KVClient
from kvserver.client.calls import Answer, Call, Proc
from kvserver.errors import LeaseError, LeaseExpired, UnknownNamespace
from kvserver.grants import StoreCompletion, StoreGrant
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/completions", tp_world_size=2)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("completions")
    d = start_daemon(tmp, "--page-size", "4KiB", "--dram", "32MiB")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture
def kv(daemon: DaemonProc) -> Iterator[KVClient]:
    with KVClient(daemon.zmq_address, colocated=True) as client:
        client.register_namespace(SPEC)
        yield client


def write_all(kv: KVClient, grant: StoreGrant, spec: NamespaceSpec = SPEC) -> None:
    for key, extents in zip(grant.keys, grant.locations, strict=True):
        for rank, ext in enumerate(extents):
            kv.write(ext, pattern(key, rank, spec.part_bytes))


def reserve(kv: KVClient, keys: list[bytes], lease_s: float = 30) -> StoreGrant:
    grant = kv.prepare_store(SPEC.ns_id, keys, lease_s=lease_s)
    assert grant is not None and grant.keys == keys
    return grant


def test_hello_announces_the_capability(kv: KVClient) -> None:
    assert wire.CAP_STORE_COMPLETIONS in kv.hello()["capabilities"]


def test_completions_carried_by_a_prepare_make_chunks_ready(kv: KVClient) -> None:
    first, rolled, part, nxt = (make_keys(3, tag=t) for t in ("c-first", "c-rb", "c-part", "c-nx"))
    g1, g2, g3 = reserve(kv, first), reserve(kv, rolled), reserve(kv, part)
    write_all(kv, g1)
    write_all(kv, g3)
    before = kv.sent_by_op.copy()
    res = kv.prepare_store_completing(
        SPEC.ns_id,
        nxt,
        [
            StoreCompletion(g1.lease_id),
            StoreCompletion(g2.lease_id, success=False),
            StoreCompletion(g3.lease_id, keys=part[:2]),
        ],
        lease_s=30,
    )
    sent = kv.sent_by_op - before
    assert sent == {wire.PREPARE_STORE: 1}  # one message
    assert res.completed == [first, [], part[:2]]
    assert res.grant is not None and res.grant.keys == nxt
    assert res.grant.lease_id not in {g1.lease_id, g2.lease_id, g3.lease_id}
    assert all(len(extents) == SPEC.tp_world_size for extents in res.grant.locations)
    assert kv.lookup(SPEC.ns_id, first).hit_chunks == 3
    assert kv.lookup(SPEC.ns_id, rolled).hit_chunks == 0  # rolled back
    assert kv.lookup(SPEC.ns_id, part).hit_chunks == 2
    assert kv.lookup(SPEC.ns_id, nxt).hit_chunks == 0  # reserved, not written
    # the rolled-back chunks can be reserved again; the new grant completes as any other
    write_all(kv, res.grant)
    assert kv.complete_store(res.grant.lease_id) == nxt
    assert kv.complete_store(g3.lease_id) == part[2:]
    again = kv.prepare_store(SPEC.ns_id, rolled, lease_s=30)
    assert again is not None and again.keys == rolled
    kv.complete_store(again.lease_id, success=False)


def test_a_failed_completion_fails_neither_the_reservation_nor_the_others(
    kv: KVClient,
) -> None:
    ok, short, nxt = make_keys(2, tag="f-ok"), make_keys(2, tag="f-exp"), make_keys(2, tag="f-nx")
    expiring = reserve(kv, short, lease_s=0.05)
    wait_until(lambda: kv.stats()["reserved_pages"] == 0)  # the daemon reclaimed it
    done = reserve(kv, ok)
    write_all(kv, done)
    res = kv.prepare_store_completing(
        SPEC.ns_id,
        nxt,
        [
            StoreCompletion(expiring.lease_id),
            StoreCompletion(wire.MAX_INT),  # never granted
            StoreCompletion(done.lease_id),
            StoreCompletion(done.lease_id),  # completed just before
        ],
    )
    expired, unknown, ready, twice = res.completed
    assert isinstance(expired, LeaseExpired)
    assert isinstance(unknown, LeaseError) and "unknown lease" in str(unknown)
    assert ready == ok
    assert isinstance(twice, LeaseError)
    assert res.grant is not None and res.grant.keys == nxt
    assert kv.lookup(SPEC.ns_id, ok).hit_chunks == 2
    kv.complete_store(res.grant.lease_id, success=False)


def test_completions_are_reported_when_the_cache_is_full(kv: KVClient) -> None:
    keys = make_keys(2, tag="full")
    g = reserve(kv, keys)
    write_all(kv, g)
    huge = make_keys(20_000, tag="full-huge")  # far more than 32 MiB of DRAM
    res = kv.prepare_store_completing(SPEC.ns_id, huge, [StoreCompletion(g.lease_id)])
    assert res.grant is None
    assert res.completed == [keys]
    assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 2


def test_an_unknown_namespace_applies_no_completion(kv: KVClient) -> None:
    keys = make_keys(2, tag="ns")
    g = reserve(kv, keys)
    write_all(kv, g)
    args = {"ns_id": "no-such-ns", "keys": [], "completions": [[g.lease_id, True, None, None]]}
    with pytest.raises(UnknownNamespace):
        kv._drive(raw_call(wire.PREPARE_STORE, args))
    assert kv.lookup(SPEC.ns_id, keys).hit_chunks == 0
    assert kv.complete_store(g.lease_id) == keys


def raw_call(op: str, args: dict[str, Any]) -> Proc[Answer]:
    """One request exactly as given (no session renewal, no retry)."""
    return (yield Call(op, args))


def test_old_style_requests_get_old_style_replies(kv: KVClient) -> None:
    keys = make_keys(2, tag="old")
    answer = kv._drive(raw_call(wire.PREPARE_STORE, {"ns_id": SPEC.ns_id, "keys": keys}))
    assert set(answer.result) == {"grant"}
    grant = reserve(kv, make_keys(2, tag="old2"))
    write_all(kv, grant)
    assert kv.complete_store(grant.lease_id) == grant.keys
    kv.release()


def test_falls_back_to_complete_store_without_the_capability(kv: KVClient) -> None:
    """A daemon that does not announce the capability (an older one would refuse the unknown
    argument): the server info is cut to what such a daemon says."""
    kv.hello()
    kv._s.server = {k: v for k, v in kv._s.server.items() if k != "capabilities"}
    a, b, nxt = make_keys(2, tag="fb-a"), make_keys(2, tag="fb-b"), make_keys(2, tag="fb-n")
    ga, gb = reserve(kv, a), reserve(kv, b)
    write_all(kv, ga)
    before = kv.sent_by_op.copy()
    pending = kv.submit_prepare_store_completing(
        SPEC.ns_id, nxt, [StoreCompletion(ga.lease_id), StoreCompletion(gb.lease_id + 10**9)]
    )
    res = pending.result()
    assert kv.sent_by_op - before == {wire.COMPLETE_STORE: 2, wire.PREPARE_STORE: 1}
    assert res.completed[0] == a and isinstance(res.completed[1], LeaseError)
    assert res.grant is not None and res.grant.keys == nxt
    assert kv.lookup(SPEC.ns_id, a).hit_chunks == 2
    kv.release()


@pytest.mark.parametrize("local", [False, True])
def test_the_async_client_carries_completions_too(daemon: DaemonProc, local: bool) -> None:
    """Both drivers get the op through ``ops``: the asyncio client, over ZMQ and over the
    local channel, blocking and submitted."""

    async def main() -> None:
        async with AsyncKVClient(daemon.zmq_address, colocated=True, local=local) as akv:
            await akv.register_namespace(SPEC)
            keys, nxt = make_keys(2, tag=f"aio-{local}"), make_keys(2, tag=f"aio-n-{local}")
            grant = await akv.prepare_store(SPEC.ns_id, keys)
            assert grant is not None
            for key, extents in zip(grant.keys, grant.locations, strict=True):
                for rank, ext in enumerate(extents):
                    akv.write(ext, pattern(key, rank, SPEC.part_bytes))
            task = await akv.submit_prepare_store_completing(
                SPEC.ns_id, nxt, [StoreCompletion(grant.lease_id)]
            )
            res = await task
            assert res.completed == [keys] and res.grant is not None and res.grant.keys == nxt
            again = await akv.prepare_store_completing(
                SPEC.ns_id, [], [StoreCompletion(res.grant.lease_id, success=False)]
            )
            assert again.completed == [[]] and again.grant is not None
            assert (await akv.lookup(SPEC.ns_id, keys + nxt)).hit_chunks == 2

    asyncio.run(main())
