"""``prepare_store`` with ``packed`` (capability ``packed_store_grant``, docs/wire.md §2)
against the real daemon process: the grant comes without the keys echoed and with its extents
in one blob, reads back as the unpacked grant would, old-style requests keep their old-style
replies, and a client falls back to the unpacked form when the daemon does not announce the
capability."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvserver import grants, wire
from kvserver.client import KVClient
from kvserver.client.calls import Answer, Call, Proc
from kvserver.errors import InvalidArgument
from kvserver.grants import StoreCompletion, StoreGrant
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/packed", tp_world_size=2)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("packed")
    d = start_daemon(tmp, "--page-size", "4KiB", "--dram", "32MiB")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture
def kv(daemon: DaemonProc) -> Iterator[KVClient]:
    with KVClient(daemon.zmq_address, colocated=True) as client:
        client.register_namespace(SPEC)
        yield client
        client.release()


def raw_call(op: str, args: dict[str, Any]) -> Proc[Answer]:
    """One request exactly as given (no session renewal, no retry)."""
    return (yield Call(op, args))


def write_all(kv: KVClient, grant: StoreGrant) -> None:
    for key, extents in zip(grant.keys, grant.locations, strict=True):
        for rank, ext in enumerate(extents):
            kv.write(ext, pattern(key, rank, SPEC.part_bytes))


def test_hello_announces_the_capability(kv: KVClient) -> None:
    assert wire.CAP_PACKED_STORE_GRANT in kv.hello()["capabilities"]


def test_a_packed_grant_names_each_requested_key_by_its_place(kv: KVClient) -> None:
    old, new = make_keys(2, tag="p-old"), make_keys(3, tag="p-new")
    done = kv.prepare_store(SPEC.ns_id, old, lease_s=30)
    assert done is not None
    write_all(kv, done)
    kv.complete_store(done.lease_id)
    keys = [new[0], old[0], new[1], new[0], old[1], new[2]]  # present and repeated keys
    args = {"ns_id": SPEC.ns_id, "keys": keys, "lease_s": 30.0, "packed": True}
    answer = kv._drive(raw_call(wire.PREPARE_STORE, args))
    wired = answer.result["grant"]
    assert "keys" not in wired and "locations" not in wired
    assert wired["status"] == bytes([0, 1, 0, 3, 1, 0]) and wired["parts"] == 2
    grant = grants.packed_store_grant_from_wire(wired, keys, SPEC.ns_id, now=0.0)
    assert grant.keys == new and grant.present == old and grant.filtered == []
    assert all(len(loc) == SPEC.tp_world_size for loc in grant.locations)
    write_all(kv, grant)  # the extents are where the daemon reads the parts back from
    assert kv.complete_store(grant.lease_id) == new
    for rank in range(SPEC.tp_world_size):
        got = kv.get(SPEC.ns_id, new, ranks=[rank])
        assert [bytes(p[0]) for p in got] == [pattern(k, rank, SPEC.part_bytes) for k in new]


def test_the_client_asks_for_the_packed_form_and_reads_it(
    kv: KVClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the plain reservation and the one carrying completions: the unpacked decoder is
    made to fail, so a grant read proves the packed form came back."""

    def unpacked(*_: Any, **__: Any) -> StoreGrant:
        raise AssertionError("the unpacked form came back")

    monkeypatch.setattr(grants, "store_grant_from_wire", unpacked)
    first, nxt = make_keys(3, tag="c-first"), make_keys(2, tag="c-next")
    grant = kv.prepare_store(SPEC.ns_id, first + first[:1], lease_s=30)
    assert grant is not None and grant.keys == first
    write_all(kv, grant)
    res = kv.submit_prepare_store_completing(
        SPEC.ns_id, nxt, [StoreCompletion(grant.lease_id)], lease_s=30
    ).result()
    assert res.completed == [first]
    assert res.grant is not None and res.grant.keys == nxt and res.grant.present == []
    again = kv.prepare_store(SPEC.ns_id, first, lease_s=30)
    assert again is not None and again.lease_id == 0 and again.present == first
    kv.complete_store(res.grant.lease_id, success=False)


def test_old_style_requests_get_old_style_grants(kv: KVClient) -> None:
    keys = make_keys(2, tag="o-old")
    answer = kv._drive(raw_call(wire.PREPARE_STORE, {"ns_id": SPEC.ns_id, "keys": keys}))
    wired = answer.result["grant"]
    assert wired["keys"] == keys and len(wired["locations"]) == 2 and "status" not in wired
    args = {"ns_id": SPEC.ns_id, "keys": make_keys(1, tag="o-f"), "packed": False}
    assert "keys" in kv._drive(raw_call(wire.PREPARE_STORE, args)).result["grant"]


def test_falls_back_to_the_unpacked_form_without_the_capability(
    kv: KVClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that does not announce the capability (an older one would refuse the unknown
    argument): the server info is cut to what such a daemon says, and the packed decoder is
    made to fail, so a grant read proves the request went without ``packed``."""

    def packed(*_: Any, **__: Any) -> StoreGrant:
        raise AssertionError("the packed form came back")

    kv.hello()
    caps = [c for c in kv._s.server["capabilities"] if c != wire.CAP_PACKED_STORE_GRANT]
    kv._s.server = {**kv._s.server, "capabilities": caps}
    monkeypatch.setattr(grants, "packed_store_grant_from_wire", packed)
    keys, nxt = make_keys(2, tag="f-a"), make_keys(2, tag="f-n")
    grant = kv.prepare_store(SPEC.ns_id, keys, lease_s=30)
    assert grant is not None and grant.keys == keys
    write_all(kv, grant)
    res = kv.prepare_store_completing(SPEC.ns_id, nxt, [StoreCompletion(grant.lease_id)])
    assert res.completed == [keys] and res.grant is not None and res.grant.keys == nxt


def test_a_malformed_packed_grant_in_a_reply_is_invalid_argument(kv: KVClient) -> None:
    """The client's read of a reply that claims to be a packed grant but is cut short: the
    daemon's real reply, its extents truncated on the way in."""
    kv.hello()
    keys = make_keys(2, tag="m")
    proc = kv._s.prepare_store(SPEC.ns_id, keys, 30.0)
    call = next(proc)
    assert call.args["packed"] is True
    answer = kv._drive(raw_call(call.op, call.args))
    wired = dict(answer.result["grant"])
    lease_id = wired["lease_id"]
    wired["extents"] = wired["extents"][:-8]
    with pytest.raises(InvalidArgument, match="malformed packed grant"):
        proc.send(Answer({"grant": wired}, [], answer.sid))
    kv.complete_store(lease_id, success=False)


# ----------------------------------------------------------------------------- packed load grant


def stored(kv: KVClient, tag: str) -> list[bytes]:
    keys = make_keys(3, tag=tag)
    grant = kv.prepare_store(SPEC.ns_id, keys, lease_s=30)
    assert grant is not None and grant.keys == keys
    write_all(kv, grant)
    assert kv.complete_store(grant.lease_id) == keys
    return keys


def test_hello_announces_the_packed_load_grant(kv: KVClient) -> None:
    assert wire.CAP_PACKED_LOAD_GRANT in kv.hello()["capabilities"]


def test_a_packed_load_grant_reads_back_as_the_unpacked_one(kv: KVClient) -> None:
    """The client asks for the packed form; an old-style request for the same keys gets the
    keys echoed and the same extents; both pin until completed."""
    keys = stored(kv, "l-packed")
    packed = kv.prepare_load(SPEC.ns_id, keys, lease_s=30)
    old = kv._drive(raw_call(wire.PREPARE_LOAD, {"ns_id": SPEC.ns_id, "keys": keys}))
    assert old.result["grant"]["keys"] == keys
    plain = grants.load_grant_from_wire(old.result["grant"], packed.deadline, old.sid)
    assert packed.keys == keys and packed.locations == plain.locations
    assert packed.granted_by == old.sid and len(packed.locations[0]) == SPEC.tp_world_size
    for k, extents in zip(keys, packed.locations, strict=True):
        for rank, ext in enumerate(extents):
            assert kv.read(ext, grant=packed) == pattern(k, rank, SPEC.part_bytes)
    kv.complete_load(packed.lease_id)
    kv.complete_load(plain.lease_id)
    raw = kv._drive(
        raw_call(wire.PREPARE_LOAD, {"ns_id": SPEC.ns_id, "keys": keys, "packed": True})
    )
    assert "keys" not in raw.result["grant"] and isinstance(raw.result["grant"]["extents"], bytes)
    kv.complete_load(raw.result["grant"]["lease_id"])


def test_a_load_falls_back_to_the_unpacked_form_without_the_capability(
    kv: KVClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that does not announce ``packed_load_grant`` (an older one would refuse the
    argument): the request goes without ``packed`` (the packed decoder would fail)."""

    def packed(*_: Any, **__: Any) -> Any:
        raise AssertionError("the packed form came back")

    keys = stored(kv, "l-old")
    kv.hello()
    caps = [c for c in kv._s.server["capabilities"] if c != wire.CAP_PACKED_LOAD_GRANT]
    kv._s.server = {**kv._s.server, "capabilities": caps}
    monkeypatch.setattr(grants, "packed_load_grant_from_wire", packed)
    grant = kv.prepare_load(SPEC.ns_id, keys, lease_s=30)
    assert grant.keys == keys and len(grant.locations) == len(keys)
    kv.complete_load(grant.lease_id)
