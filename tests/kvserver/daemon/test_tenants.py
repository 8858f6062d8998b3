"""Tenants (docs/security.md, "Tenants"), on a real daemon started with a config file and real
ZMQ, local-channel and gRPC clients: a tenant cannot register, look up, read, write or pin
another tenant's namespace (and changes nothing trying; nor learns that it exists: the answer
is that of an id registered nowhere), sees only its own namespaces in
listings, stats and events; a read-only router token looks up but cannot store; the daemon's
own token still does everything; a malformed ``[[tenants]]`` table stops start-up (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvserver import wire
from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.client import KVClient
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument, KVServerError, PermissionDenied, UnknownNamespace
from kvserver.grants import StoreCompletion
from kvserver.grpc_client import GrpcClient
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_keys, make_spec
from tests.support.daemon import DaemonProc, raw_dealer, start_daemon

pytestmark = pytest.mark.multiprocess

TOKEN_A = "token-of-team-a-0123456789"
TOKEN_B = "token-of-team-b-0123456789"
TOKEN_ROUTER = "token-of-the-router-012345"
TOKEN_C = "token-of-team-c-0123456789"
BEARER_A = f"Bearer {TOKEN_A}"
SPEC_A = make_spec(model="model-a")
SPEC_B = make_spec(model="model-b")
KEYS_A = make_keys(2, tag="tenant-a")
KEYS_B = make_keys(2, tag="tenant-b")
PROMPT = list(range(SPEC_A.block_size * 2))
#: a namespace id registered nowhere
NS_NOWHERE = make_spec(model="model-b", block_size=8).ns_id


def parts(keys: list[bytes], spec: NamespaceSpec) -> list[list[bytes]]:
    return [[bytes([i + 1]) * spec.part_bytes] for i in range(len(keys))]


def write_config(tmp: Path, tenants: str) -> Path:
    path = tmp / "kvserver.toml"
    path.write_text(tenants)
    return path


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


TENANTS = """
[[tenants]]
name = "team-a"
token_file = "{a_file}"
models = ["model-a"]
cache_salts = ["salt-a"]

[[tenants]]
name = "team-b"
token = "{token_b}"
models = ["model-b"]

[[tenants]]
name = "team-c"
token = "{token_c}"
models = ["model-b"]

[[tenants]]
name = "router"
token_file = "{router_file}"
models = ["*"]
read_only = true
"""


@dataclass
class Fleet:
    d: DaemonProc
    ns_a: str
    ns_b: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("tenants")
    config = write_config(
        tmp,
        TENANTS.format(
            a_file=private_file(tmp / "a.token", TOKEN_A + "\n"),
            token_b=TOKEN_B,
            token_c=TOKEN_C,
            router_file=private_file(tmp / "router.token", TOKEN_ROUTER, 0o640),
        ),
    )
    d = start_daemon(tmp, "--config", str(config), "--dram", "16MiB")
    try:
        with KVClient(d.zmq_address, auth_token=TOKEN_A, colocated=False) as a:
            ns_a = a.register_namespace(SPEC_A).ns_id
            assert a.store(ns_a, KEYS_A, parts(KEYS_A, SPEC_A)) == KEYS_A
        with KVClient(d.zmq_address, auth_token=TOKEN_B, colocated=False) as b:
            ns_b = b.register_namespace(SPEC_B).ns_id
            assert b.store(ns_b, KEYS_B, parts(KEYS_B, SPEC_B)) == KEYS_B
        yield Fleet(d, ns_a, ns_b)
    finally:
        assert d.terminate() == 0


def b_unchanged(f: Fleet) -> None:
    """B's namespace still holds its chunks, with their bytes, unpinned (the admin checks)."""
    with KVClient(f.d.zmq_address, colocated=False) as admin:  # the daemon's own token file
        assert admin.lookup(f.ns_b, KEYS_B).hit_chunks == 2
        got = [bytes(v[0]) for v in admin.get(f.ns_b, KEYS_B)]
        assert got == [p[0] for p in parts(KEYS_B, SPEC_B)]
        assert admin.lookup(f.ns_b, make_keys(1, tag="a-in-b")).hit_chunks == 0
        assert admin.unpin(f.ns_b, KEYS_B) == 0  # nobody's pin was taken


def same_answer(op: Callable[[str], object], ns_b: str) -> UnknownNamespace:
    """``op`` on B's namespace fails exactly as on an id registered nowhere (type, message,
    context with the id swapped): the tenant cannot tell whether B's namespace exists."""
    answers = []
    for ns in (ns_b, NS_NOWHERE):
        with pytest.raises(KVServerError) as refused:
            op(ns)
        exc = refused.value
        answers.append((type(exc), exc.code, str(exc).replace(ns, "<ns>")))
    assert answers[0] == answers[1], answers
    assert answers[0][0] is UnknownNamespace, answers
    return exc  # type: ignore[return-value]


@pytest.mark.parametrize("channel", ["zmq", "local"])
def test_a_tenant_cannot_touch_another_tenants_namespace(fleet: Fleet, channel: str) -> None:
    """Team A, over ZMQ and over the local channel: every op on B's namespace is answered as
    for a namespace registered nowhere (unknown_namespace, same message), registering B's
    model and a foreign cache_salt are PermissionDenied, and B's chunks are as they were;
    its own namespace works."""
    local = channel == "local"
    with KVClient(fleet.d.zmq_address, auth_token=TOKEN_A, colocated=local, local=local) as a:
        a.hello()
        a.namespaces()  # the first call after hello connects the local channel
        assert a.is_local is local
        hidden: list[Callable[[str], object]] = [
            lambda ns: a.lookup(ns, KEYS_B),
            lambda ns: a.lookup_tokens(ns, PROMPT),
            lambda ns: a.lookup_tokens(ns, PROMPT, cache_salt="salt-a"),
            lambda ns: a.touch(ns, KEYS_B),
            lambda ns: a.get(ns, KEYS_B),
            lambda ns: a.load(ns, KEYS_B),
            lambda ns: a.prepare_load(ns, KEYS_B),
            lambda ns: a.store(ns, make_keys(1, tag="a-in-b"), parts([b""], SPEC_B)),
            lambda ns: a.put(ns, KEYS_B, parts(KEYS_B, SPEC_B)),
            lambda ns: a.prepare_store(ns, make_keys(1, tag="a-in-b")),
            lambda ns: a.pin(ns, KEYS_B, 60.0),
            lambda ns: a.unpin(ns, KEYS_B),
        ]
        for op in hidden:
            same_answer(op, fleet.ns_b)
        refused: list[Callable[[], object]] = [
            lambda: a.register_namespace(make_spec(model="model-b", block_size=32)),
            # its own namespace with a cache_salt it was not given
            lambda: a.lookup_tokens(fleet.ns_a, PROMPT, cache_salt="salt-b"),
            lambda: a.lookup_tokens(fleet.ns_a, PROMPT),
        ]
        for i, op in enumerate(refused):
            with pytest.raises(PermissionDenied):
                op()
                pytest.fail(f"refused[{i}] was allowed")
        # its own namespace: everything works
        assert a.lookup(fleet.ns_a, KEYS_A).hit_chunks == 2
        assert a.lookup_tokens(fleet.ns_a, PROMPT, cache_salt="salt-a").hit_chunks == 0
        assert a.pin(fleet.ns_a, KEYS_A, 60.0) == 2
        assert a.unpin(fleet.ns_a, KEYS_A) == 2
        assert [bytes(p[0]) for p in a.get(fleet.ns_a, KEYS_A)] == [
            p[0] for p in parts(KEYS_A, SPEC_A)
        ]
        assert [s.ns_id for s in a.namespaces()] == [fleet.ns_a]
        assert set(a.stats()["namespaces"]) == {fleet.ns_a}
    b_unchanged(fleet)


def test_a_tenant_cannot_use_another_tenants_leases(fleet: Fleet) -> None:
    """Lease ids are small integers: A naming B's store or load lease is refused, and B's
    lease still completes."""
    new = make_keys(1, tag="b-lease")
    with (
        KVClient(fleet.d.zmq_address, auth_token=TOKEN_B, colocated=False) as b,
        KVClient(fleet.d.zmq_address, auth_token=TOKEN_A, colocated=False) as a,
    ):
        grant = b.prepare_store(fleet.ns_b, new)
        assert grant is not None
        with pytest.raises(PermissionDenied):
            a.write_parts(grant.lease_id, new, 0, [bytes(SPEC_B.part_bytes)])
        with pytest.raises(PermissionDenied):
            a.complete_store(grant.lease_id)
        # nor carried by A's own reservation: refused in its own result, A's grant stands
        mine = make_keys(1, tag="a-carry")
        res = a.prepare_store_completing(fleet.ns_a, mine, [StoreCompletion(grant.lease_id)])
        assert isinstance(res.completed[0], PermissionDenied)
        assert res.grant is not None and res.grant.keys == mine
        a.complete_store(res.grant.lease_id, success=False)
        assert b.write_parts(grant.lease_id, new, 0, [bytes(SPEC_B.part_bytes)]) == new
        load = b.prepare_load(fleet.ns_b, KEYS_B)
        with pytest.raises(UnknownNamespace):  # B's namespace: as if not registered
            a.read_parts(fleet.ns_b, load.lease_id, KEYS_B, 0)
        with pytest.raises(PermissionDenied):
            a.read_parts(fleet.ns_a, load.lease_id, KEYS_B, 0)
        with pytest.raises(PermissionDenied):
            a.complete_load(load.lease_id)
        b.complete_load(load.lease_id)
        assert a.release() == 0  # A's release names A's clients only
        assert b.lookup(fleet.ns_b, new).hit_chunks == 1


def test_a_tenant_sharing_a_model_cannot_use_another_tenants_leases(fleet: Fleet) -> None:
    """C may use model-b too, and the router reads every model: the lease ids of B's store
    and load (small integers) were theirs to complete, abort, write into and read through
    (C aborted B's store, the router ended B's load). A lease is its owner tenant's: refused
    for the others (the namespace checks alone let them through), and B's leases complete."""
    new = make_keys(1, tag="b-shared-lease")
    part = bytes([9]) * SPEC_B.part_bytes
    with (
        KVClient(fleet.d.zmq_address, auth_token=TOKEN_B, colocated=False) as b,
        KVClient(fleet.d.zmq_address, auth_token=TOKEN_C, colocated=False) as c,
        KVClient(fleet.d.zmq_address, auth_token=TOKEN_ROUTER, colocated=False) as r,
    ):
        grant = b.prepare_store(fleet.ns_b, new)
        assert grant is not None
        for attempt in (
            lambda: c.write_parts(grant.lease_id, new, 0, [bytes(SPEC_B.part_bytes)]),
            lambda: c.complete_store(grant.lease_id, success=False),
            lambda: c.complete_store(grant.lease_id),
        ):
            with pytest.raises(PermissionDenied, match="may not use this lease"):
                attempt()
        res = c.prepare_store_completing(
            fleet.ns_b, make_keys(1, tag="c-carry"), [StoreCompletion(grant.lease_id, False)]
        )
        assert isinstance(res.completed[0], PermissionDenied)
        assert res.grant is not None
        c.complete_store(res.grant.lease_id, success=False)
        assert b.write_parts(grant.lease_id, new, 0, [part]) == new
        load = b.prepare_load(fleet.ns_b, new)
        for attempt in (
            lambda: r.read_parts(fleet.ns_b, load.lease_id, new, 0),
            lambda: r.complete_load(load.lease_id),
            lambda: c.complete_load(load.lease_id),
        ):
            with pytest.raises(PermissionDenied, match="may not use this lease"):
                attempt()
        assert [bytes(v) for v in b.read_parts(fleet.ns_b, load.lease_id, new, 0)] == [part]
        b.complete_load(load.lease_id)
        assert c.release() == 0 and r.release() == 0
        with KVClient(fleet.d.zmq_address, colocated=False) as admin:  # the daemon's token
            grant = admin.prepare_store(fleet.ns_b, make_keys(1, tag="admin-lease"))
            assert grant is not None
            with pytest.raises(PermissionDenied, match="may not use this lease"):
                c.complete_store(grant.lease_id, success=False)
            admin.complete_store(grant.lease_id, success=False)


def test_grpc_enforces_the_same_rules(fleet: Fleet) -> None:
    """Team A over gRPC: B's namespace answers Lookup, Pin and Unpin as an id registered
    nowhere (NOT_FOUND, same details and trailers); PERMISSION_DENIED for registering B's
    model and for a foreign cache_salt; ListNamespaces and Stats show A's namespace only."""
    with GrpcClient(fleet.d.grpc_address, auth_token=TOKEN_A) as g:
        hidden: list[Callable[[str], object]] = [
            lambda ns: g.lookup_keys(ns, KEYS_B),
            lambda ns: g.lookup_tokens(ns, PROMPT, cache_salt="salt-a"),
            lambda ns: g.lookup_tokens(ns, PROMPT, cache_salt="salt-b"),
            lambda ns: g.pin(ns, ttl_s=60.0, keys=KEYS_B),
            lambda ns: g.unpin(ns, keys=KEYS_B),
        ]
        for hide in hidden:
            same_answer(hide, fleet.ns_b)
        refused: list[Callable[[], object]] = [
            lambda: g.register_namespace(make_spec(model="model-b", block_size=64)),
            lambda: g.lookup_tokens(fleet.ns_a, PROMPT, cache_salt="salt-b"),
            lambda: g.pin(fleet.ns_a, ttl_s=60.0, token_ids=PROMPT),
        ]
        for op in refused:
            with pytest.raises(PermissionDenied):
                op()
        assert g.lookup_keys(fleet.ns_a, KEYS_A).hit_chunks == 2
        assert g.pin(fleet.ns_a, ttl_s=60.0, token_ids=PROMPT, cache_salt="salt-a")
        assert [n.namespace_id for n in g.list_namespaces()] == [fleet.ns_a]
        assert [n.namespace_id for n in g.stats().namespaces] == [fleet.ns_a]
    with grpc.insecure_channel(fleet.d.grpc_address) as channel:
        call = channel.unary_unary("/kvserver.v1.KVServer/Lookup")
        req = pb.LookupRequest(namespace_id=fleet.ns_b, keys=pb.KeyPrefix(keys=KEYS_B))
        answers = []
        for ns in (fleet.ns_b, NS_NOWHERE):
            req = pb.LookupRequest(namespace_id=ns, keys=pb.KeyPrefix(keys=KEYS_B))
            with pytest.raises(grpc.RpcError) as hidden_ns:
                call(req.SerializeToString(), timeout=10, metadata=(("authorization", BEARER_A),))
            err = hidden_ns.value
            answers.append((err.code(), err.details().replace(ns, "<ns>"), err.trailing_metadata()))
        assert answers[0] == answers[1]
        assert answers[0][0] == grpc.StatusCode.NOT_FOUND
    b_unchanged(fleet)


def test_watch_events_carry_only_the_tenants_namespaces(fleet: Fleet) -> None:
    """A's WatchEvents stream skips B's store and delivers A's; the admin's sees both."""
    new_a, new_b = make_keys(1, tag="event-a"), make_keys(1, tag="event-b")
    with (
        GrpcClient(fleet.d.grpc_address, auth_token=TOKEN_A) as ga,
        GrpcClient(fleet.d.grpc_address) as admin,
    ):
        a_events, all_events = ga.watch_events(timeout=30), admin.watch_events(timeout=30)
        try:
            assert a_events.next_seq and all_events.next_seq  # both streams are subscribed
            with KVClient(fleet.d.zmq_address, auth_token=TOKEN_B, colocated=False) as b:
                assert b.store(fleet.ns_b, new_b, parts(new_b, SPEC_B)) == new_b
            with KVClient(fleet.d.zmq_address, auth_token=TOKEN_A, colocated=False) as a:
                assert a.store(fleet.ns_a, new_a, parts(new_a, SPEC_A)) == new_a
            first = next(a_events)
            assert (first.ns_id, first.keys) == (fleet.ns_a, tuple(new_a))  # type: ignore[union-attr]
            seen = [next(all_events), next(all_events)]
            assert [e.ns_id for e in seen] == [fleet.ns_b, fleet.ns_a]
        finally:
            a_events.close()
            all_events.close()


def test_zmq_replay_is_for_the_admin_only(fleet: Fleet) -> None:
    """The KV-event replay carries every namespace's events: a tenant's connection is
    refused (permission_denied), the admin's is served."""
    for token, ok in ((TOKEN_A, False), (fleet.d.token, True)):
        sock = raw_dealer(fleet.d.zmq_address, token)  # a tenant's token passes the handshake
        try:
            sock.send_multipart([wire.encode_request(1, wire.HELLO, {}, auth=token)])
            assert sock.poll(10_000) and wire.decode_reply(sock.recv_multipart()[0]).ok
            sock.send_multipart([b"", wire.seq_bytes(1)])
            assert sock.poll(10_000)
            reply = sock.recv_multipart()
            if ok:
                assert reply[0] == b"" and len(reply) == 3
            else:
                error = wire.decode_reply(reply[0]).error
                assert error is not None and error.code == "permission_denied"
        finally:
            sock.close()


def test_a_read_only_router_looks_up_but_cannot_write(fleet: Fleet) -> None:
    """The router token (models "*", read_only) sees and looks up every namespace but may
    not register, store or pin, over ZMQ and gRPC."""
    with KVClient(fleet.d.zmq_address, auth_token=TOKEN_ROUTER, colocated=False) as r:
        assert r.lookup(fleet.ns_a, KEYS_A).hit_chunks == 2
        assert r.lookup(fleet.ns_b, KEYS_B).hit_chunks == 2
        assert {s.ns_id for s in r.namespaces()} == {fleet.ns_a, fleet.ns_b}
        for op in (
            lambda: r.register_namespace(make_spec(model="model-r")),
            lambda: r.store(fleet.ns_a, make_keys(1, tag="r"), parts([b""], SPEC_A)),
            lambda: r.prepare_store(fleet.ns_b, make_keys(1, tag="r")),
            lambda: r.pin(fleet.ns_a, KEYS_A, 60.0),
        ):
            with pytest.raises(PermissionDenied):
                op()
        assert r.lookup(fleet.ns_a, make_keys(1, tag="r")).hit_chunks == 0
    with GrpcClient(fleet.d.grpc_address, auth_token=TOKEN_ROUTER) as g:
        assert g.lookup_keys(fleet.ns_b, KEYS_B).hit_chunks == 2
        with pytest.raises(PermissionDenied):
            g.pin(fleet.ns_b, ttl_s=60.0, keys=KEYS_B)
        with pytest.raises(PermissionDenied):
            g.register_namespace(make_spec(model="model-r"))


def test_the_daemons_own_token_still_does_everything(fleet: Fleet) -> None:
    """The admin (the token file the daemon wrote) lists, reads and pins both tenants'
    namespaces and registers any model."""
    with KVClient(fleet.d.zmq_address, colocated=False) as admin:
        assert {fleet.ns_a, fleet.ns_b} <= {s.ns_id for s in admin.namespaces()}
        assert {fleet.ns_a, fleet.ns_b} <= set(admin.stats()["namespaces"])
        assert admin.pin(fleet.ns_a, KEYS_A, 60.0) == 2
        assert admin.unpin(fleet.ns_a, KEYS_A) == 2
        assert admin.lookup(fleet.ns_b, KEYS_B).hit_chunks == 2
        admin.register_namespace(make_spec(model="model-admin"))
    with GrpcClient(fleet.d.grpc_address) as g:
        assert {fleet.ns_a, fleet.ns_b} <= {n.namespace_id for n in g.list_namespaces()}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('name = "x"\ntoken = "0123456789abcdefgh"\n', "models must list"),
        ('name = "x"\nmodels = ["m"]\n', "exactly one of token_file or token"),
        (
            'name = "x"\ntoken = "0123456789abcdefgh"\nmodels = ["m"]\nwrite = 1\n',
            "unknown fields write",
        ),
        ('name = "x"\ntoken_file = "{loose}"\nmodels = ["m"]\n', "accessible to other users"),
        ('name = "x"\ntoken_file = "{missing}"\nmodels = ["m"]\n', "cannot read token file"),
        ('name = "x"\ntoken = "short"\nmodels = ["m"]\n', "at least 16 characters"),
    ],
)
def test_a_malformed_tenants_section_stops_start_up(
    tmp_path: Path, table: str, message: str
) -> None:
    """Start-up fails with exit 2 and a message naming the tenant and the fault."""
    loose = private_file(tmp_path / "loose.token", TOKEN_A, 0o644)
    text = "[[tenants]]\n" + table.format(loose=loose, missing=tmp_path / "nope.token")
    config = write_config(tmp_path, text)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserver.cli",
            "start",
            "--config",
            str(config),
            "--grpc-port",
            "0",
            "--zmq-port",
            "0",
            "--pub-port",
            "-1",
            "--metrics-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "tenant" in proc.stderr


def test_tenants_come_from_the_config_file_only_and_need_auth(tmp_path: Path) -> None:
    """KVSERVER_TENANTS (a string) is refused, as are tenants with no_auth or a tenant whose
    token is the admin's: each a clear InvalidArgument before anything starts."""
    config = write_config(
        tmp_path, f'[[tenants]]\nname = "x"\ntoken = "{TOKEN_A}"\nmodels = ["m"]\n'
    )
    loaded = DaemonConfig.load(config_file=str(config), env={})
    assert [(t.name, t.models, t.read_only) for t in loaded.tenants] == [("x", ("m",), False)]
    assert TOKEN_A not in repr(loaded)
    with pytest.raises(InvalidArgument, match="config file"):
        DaemonConfig.load(env={"KVSERVER_TENANTS": "x"})
    with pytest.raises(InvalidArgument, match="no_auth"):
        DaemonConfig.load(config_file=str(config), env={}, overrides={"no_auth": True})
    with pytest.raises(InvalidArgument, match="admin"):
        DaemonConfig.load(config_file=str(config), env={}, overrides={"auth_token": TOKEN_A})
