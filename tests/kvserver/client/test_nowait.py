"""Completions sent without waiting (``KVClient.complete_store_nowait`` /
``complete_load_nowait``) against a real daemon, co-located and remote: the next call sees
their effect, and a failed one is never lost (a later call, ``flush`` or ``close`` raises it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvserver.client import AsyncKVClient, KVClient
from kvserver.errors import InvalidArgument, LeaseError
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until

SPEC = make_spec(model="test/nowait")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("nowait"), "--page-size", "4KiB", "--dram", "16MiB")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.mark.multiprocess
@pytest.mark.parametrize("colocated", [True, False])
def test_a_store_and_load_completed_without_waiting(daemon: DaemonProc, colocated: bool) -> None:
    """prepare_store → writes → complete_store_nowait → prepare_load sees the keys ready and
    reads what was written; complete_load_nowait's pins are gone once flushed."""
    keys = make_keys(3, tag=f"nowait{colocated}")
    data = [pattern(k, 0, SPEC.part_bytes) for k in keys]
    with KVClient(daemon.zmq_address, colocated=colocated) as kv:
        ns_id = kv.register_namespace(SPEC).ns_id
        if colocated:
            store = kv.prepare_store(ns_id, keys)
            assert store is not None
            for extents, part in zip(store.locations, data, strict=True):
                kv.write(extents[0], part)
            kv.complete_store_nowait(store.lease_id)
            load = kv.prepare_load(ns_id, keys)
            assert [kv.read(extents[0]) for extents in load.locations] == data
            kv.complete_load_nowait(load.lease_id)
        else:  # remote: the parts go as frames, the completions as above
            store = kv.prepare_store(ns_id, keys)
            assert store is not None
            kv.write_parts(store.lease_id, keys, 0, data, complete=False)
            kv.complete_store_nowait(store.lease_id)
            load = kv.prepare_load(ns_id, keys)
            assert [bytes(p) for p in kv.read_parts(ns_id, load.lease_id, keys, 0)] == data
            kv.complete_load_nowait(load.lease_id)
        kv.flush()
        # a remote read's reply went out under a send pin, released once ZMQ has let its
        # frames go (kvserver/daemon/zmq_send.py): maybe after the completions' replies
        wait_until(lambda: kv.stats()["pinned_pages"] == 0)
        assert kv.sent_by_op["complete_store"] == 1


@pytest.mark.multiprocess
def test_a_failed_completion_is_raised_by_a_later_call_once(daemon: DaemonProc) -> None:
    with KVClient(daemon.zmq_address) as kv:
        kv.hello()
        kv.complete_load_nowait(10**9)  # no such lease
        with pytest.raises(LeaseError):
            kv.stats()  # its reply may not be in yet: then this call reads it ...
            kv.stats()  # ... and this one raises it, before it is sent
        sent = kv.sent_by_op["stats"]
        assert kv.stats()["pinned_pages"] == 0  # raised once, then gone
        assert kv.sent_by_op["stats"] == sent + 1


@pytest.mark.multiprocess
def test_flush_collects_every_completion_and_raises_the_first_error(daemon: DaemonProc) -> None:
    keys = make_keys(1, tag="flush")
    with KVClient(daemon.zmq_address) as kv:
        ns_id = kv.register_namespace(SPEC).ns_id
        store = kv.prepare_store(ns_id, keys)
        assert store is not None
        kv.write(store.locations[0][0], pattern(keys[0], 0, SPEC.part_bytes))
        kv.complete_store_nowait(10**9)  # fails
        kv.complete_store_nowait(store.lease_id)  # still applied and collected
        with pytest.raises(LeaseError):
            kv.flush()
        kv.flush()  # nothing left
        assert kv.lookup(ns_id, keys).hit_chunks == 1


@pytest.mark.multiprocess
def test_close_raises_a_failed_completion_unless_an_error_is_leaving(
    daemon: DaemonProc, caplog: pytest.LogCaptureFixture
) -> None:
    kv = KVClient(daemon.zmq_address)
    kv.hello()
    kv.complete_load_nowait(10**9)
    with pytest.raises(LeaseError):
        kv.close()
    assert kv._t.is_local is False and kv._s.arena is None  # closed all the same

    caplog.set_level(logging.WARNING, logger="kvserver.client.sync")
    # not replaced by the completion's LeaseError:
    with pytest.raises(InvalidArgument, match="the caller's"), KVClient(daemon.zmq_address) as kv:
        kv.hello()
        kv.complete_load_nowait(10**9)
        raise InvalidArgument("the caller's own error")
    assert "a completion sent without waiting failed" in caplog.text


@pytest.mark.multiprocess
async def test_the_async_client_completes_without_waiting_too(daemon: DaemonProc) -> None:
    keys = make_keys(2, tag="nowait-aio")
    data = [pattern(k, 0, SPEC.part_bytes) for k in keys]
    async with AsyncKVClient(daemon.zmq_address) as kv:
        ns_id = (await kv.register_namespace(SPEC)).ns_id
        store = await kv.prepare_store(ns_id, keys)
        assert store is not None
        for extents, part in zip(store.locations, data, strict=True):
            kv.write(extents[0], part)
        await kv.complete_store_nowait(store.lease_id)
        load = await kv.prepare_load(ns_id, keys)
        assert [kv.read(extents[0]) for extents in load.locations] == data
        await kv.complete_load_nowait(load.lease_id)
        await kv.complete_load_nowait(10**9)  # fails
        with pytest.raises(LeaseError):
            await kv.flush()
        assert (await kv.stats())["pinned_pages"] == 0
        await kv.complete_load_nowait(10**9)
        with pytest.raises(LeaseError):
            await kv.stats()  # its reply may not be in yet: then this call reads it ...
            await kv.stats()  # ... and this one raises it, before it is sent
