"""The asyncio client over the daemon's local channel and pipelined: a real daemon on this host
(the client maps its arena, same path), requests in flight together, replies matched by id."""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver import wire
from kvserver.client import AsyncKVClient, KVClient
from kvserver.errors import LeaseError, Unavailable
from tests.kvserver.builders import make_keys
from tests.kvserver.client.test_client import SPEC, as_bytes, parts
from tests.support.daemon import DaemonProc, start_daemon

#: the asyncio client on ZMQ (remote) and on the daemon's local channel (co-located).
TRANSPORTS = pytest.mark.parametrize("colocated", [False, None], ids=["zmq", "local"])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("aio"), "--page-size", "4KiB", "--dram", "16MiB")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("colocated", "local", "expected"),
    [(None, True, True), (False, True, False), (None, False, False)],
)
async def test_async_client_uses_the_local_channel_when_colocated_and_wanted(
    daemon: DaemonProc, colocated: bool | None, local: bool, expected: bool
) -> None:
    tag = f"aio-which-{colocated}-{local}"
    async with AsyncKVClient(daemon.zmq_address, colocated=colocated, local=local) as kv:
        info = await kv.hello()
        ns = await kv.register_namespace(SPEC)
        assert kv.is_colocated is (colocated is None)
        if colocated is None:
            assert info["arena_path"] == daemon.arena_path  # the same arena, mapped here
        keys, more = make_keys(3, tag=tag), make_keys(2, tag=tag + "-put")
        assert await kv.store(ns.ns_id, keys, parts(keys)) == keys
        assert as_bytes(await kv.load(ns.ns_id, keys)) == parts(keys)
        assert (await kv.put(ns.ns_id, more, parts(more))).stored == more
        assert as_bytes(await kv.get(ns.ns_id, more, ranks=[1])) == [[p[1]] for p in parts(more)]
        assert kv.is_local is expected
        assert kv.sent_by_op[wire.PREPARE_STORE] == (1 if colocated is None else 0)


@pytest.mark.multiprocess
@TRANSPORTS
async def test_async_pipelined_requests_keep_their_order_and_their_replies(
    tmp_path: Path, colocated: bool | None
) -> None:
    """Requests sent while the daemon is stopped are all in flight at once; the daemon applies
    them in the order sent (a lookup after a put sees it) and each reply, collected in reverse
    order, is its own request's."""
    d = start_daemon(tmp_path)
    try:
        async with AsyncKVClient(d.zmq_address, colocated=colocated) as kv:
            ns = await kv.register_namespace(SPEC)
            a, b = make_keys(2, tag="apipe-a"), make_keys(3, tag="apipe-b")
            assert await kv.store(ns.ns_id, a, parts(a)) == a
            assert kv.is_local is (colocated is None)
            d.proc.send_signal(signal.SIGSTOP)  # nothing is answered until SIGCONT
            before_b = await kv.submit_lookup(ns.ns_id, a + b)
            put_b = await kv.submit_put(ns.ns_id, b, parts(b))
            after_b = await kv.submit_lookup(ns.ns_id, a + b)
            grant = await kv.submit_prepare_load(ns.ns_id, a)
            bad = await kv.submit_complete_store(10**9)
            assert kv.outstanding == 5
            d.proc.send_signal(signal.SIGCONT)
            with pytest.raises(LeaseError):
                await bad
            lease = (await grant).lease_id
            assert (await after_b).hit_chunks == 5
            assert (await put_b).stored == b
            assert (await before_b).hit_chunks == 2
            got = await asyncio.gather(*(kv.read_parts(ns.ns_id, lease, a, r) for r in (1, 0)))
            assert [[bytes(v) for v in views] for views in got] == [
                [p[r] for p in parts(a)] for r in (1, 0)
            ]
            await kv.complete_load(lease)
            assert kv.outstanding == 0
    finally:
        d.kill()


@pytest.mark.multiprocess
async def test_async_local_channel_lost_with_requests_outstanding(tmp_path: Path) -> None:
    """Requests written to the local channel of a daemon that then dies fail with Unavailable
    when the channel closes (not after the client's 60 s timeout), all of them."""
    d = start_daemon(tmp_path)
    try:
        async with AsyncKVClient(d.zmq_address, timeout=60.0) as kv:
            ns = await kv.register_namespace(SPEC)
            assert kv.is_local
            d.proc.send_signal(signal.SIGSTOP)  # written, never read
            first = await kv.submit_lookup(ns.ns_id, make_keys(1, tag="alost-1"))
            second = await kv.submit_lookup(ns.ns_id, make_keys(1, tag="alost-2"))
            d.proc.kill()
            await asyncio.to_thread(d.proc.wait, 30)
            for pending in (first, second):
                with pytest.raises(Unavailable, match="local channel"):
                    await pending
            assert not kv.is_local
    finally:
        d.kill()


@pytest.mark.multiprocess
@TRANSPORTS
async def test_a_closed_async_client_refuses_calls_and_opens_no_socket(
    daemon: DaemonProc, colocated: bool | None
) -> None:
    """A call on a closed AsyncKVClient (e.g. a stream call's fallback to ZMQ after close())
    raises Unavailable; it used to open a new DEALER and its monitor, which nothing would
    close (pytest reported them unclosed in a later test)."""
    kv = AsyncKVClient(daemon.zmq_address, colocated=colocated)
    await kv.hello()
    await kv.close()
    with pytest.raises(Unavailable, match="was closed"):
        await kv.lookup(SPEC.ns_id, make_keys(1, tag="closed"))
    assert kv._t._zmq is None and kv._t._local is None


def test_both_clients_have_the_same_operations() -> None:
    """One definition: every public operation of one client is one of the other, with the
    same parameters (the async one's as coroutines)."""

    def public(cls: type) -> dict[str, inspect.Signature]:
        return {
            name: inspect.signature(member)
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name != "close"
        }

    sync, aio = public(KVClient), public(AsyncKVClient)
    assert sync.keys() == aio.keys() and "submit_put" in sync
    for name, sig in sync.items():
        assert list(sig.parameters) == list(aio[name].parameters), name
        if name not in ("write", "read", "readinto"):
            assert inspect.iscoroutinefunction(getattr(AsyncKVClient, name)), name
