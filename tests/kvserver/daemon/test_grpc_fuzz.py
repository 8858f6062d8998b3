"""Fuzzing every KVServer RPC: wrong / missing fields, unknown namespaces, wrong key lengths,
huge inputs and undecodable bytes get INVALID_ARGUMENT (NOT_FOUND for an unknown namespace,
OUT_OF_RANGE for an impossible WatchEvents resume, RESOURCE_EXHAUSTED for a namespace that can
never fit or a message over the transport limit) — never INTERNAL — and after each one a
well-behaved client still gets the right answer from the same server.

Requests go through a raw channel with identity serializers, so the bytes on the wire are
exactly what the test built (a serialized message, or garbage).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.grpc_client import GrpcClient
from kvserver.grpc_format import MAX_MESSAGE_BYTES
from kvserver.namespace import DTYPE_SIZES, HASH_ALGOS
from kvserver.token_file import TokenFile
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_grpc_server import InProcessServer
from tests.support.daemon import DaemonProc, start_daemon

SERVICE = "/kvserver.v1.KVServer/"
UNARY = ("Lookup", "Stats", "ListNamespaces", "RegisterNamespace", "Pin", "Unpin")
C = grpc.StatusCode
OK = C.OK
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Target:
    """One server, a raw channel for hostile bytes and a well-behaved typed client."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        token = TokenFile(address).token()  # a real daemon's default token ("" in-process)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.client = GrpcClient(address, timeout=20)
        self.ns = self.client.register_namespace(make_spec(model="fuzz/a")).namespace_id
        self.ns16 = self.client.register_namespace(
            make_spec(model="fuzz/b", hash_algo="xxhash_cbor")
        ).namespace_id
        self.keys = make_keys(6)
        self._methods: dict[str, Any] = {}

    def unary(self, method: str, body: bytes) -> grpc.StatusCode:
        """Status of a unary call whose request body is ``body``."""
        call = self._methods.get(method)
        if call is None:
            call = self._methods[method] = self.channel.unary_unary(SERVICE + method)
        try:
            call(body, timeout=20, metadata=self.metadata)
        except grpc.RpcError as exc:
            details = exc.details() or ""
            assert len(details) <= 1100, "status details must stay bounded"
            return exc.code()
        return OK

    def watch(self, body: bytes) -> grpc.StatusCode:
        """Status of WatchEvents: OK if the stream was established (then cancelled)."""
        call = self.channel.unary_stream(SERVICE + "WatchEvents")(
            body, timeout=20, metadata=self.metadata
        )
        call.initial_metadata()  # headers of an accepted stream, or the end of a refused one
        if dict(call.initial_metadata()).get("kvserver-log-id"):
            call.cancel()
            return OK
        return call.code()

    def check_healthy(self) -> None:
        """The well-behaved client still gets exact answers."""
        reply = self.client.lookup_keys(self.ns, self.keys)
        assert (reply.hit_chunks, reply.num_chunks) == (3, 6)
        assert self.client.health() == "SERVING"

    def close(self) -> None:
        self.client.close()
        self.channel.close()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    server = InProcessServer(tmp_path_factory.mktemp("grpc-fuzz"))
    t = Target(server.address)
    server.store(t.ns, t.keys[:3])
    yield t
    t.close()
    server.close()


# ----------------------------------------------------------------------------- strategies

texts = st.text(max_size=80)
ns_ids = st.one_of(st.just(""), texts, st.just("0123456789abcdef"))
keys = st.lists(st.binary(max_size=40), max_size=40)
token_prefixes = st.builds(
    lambda ids, packed, salt, lora: pb.TokenPrefix(
        token_ids=ids,
        packed_token_ids=packed,
        cache_salt=salt,
        lora=None if lora is None else pb.LoraAdapter(**lora),
    ),
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
    st.just(b"") | st.binary(max_size=1300),
    texts,
    st.none() | st.fixed_dictionaries({"name": texts, "path": texts}),
)
packed_keys = st.builds(
    lambda k, data, size: pb.KeyPrefix(keys=k, packed_keys=data, key_size=size),
    st.lists(st.binary(max_size=40), max_size=2),
    st.binary(max_size=200) | st.integers(0, 6).map(lambda n: b"\x00" * 32 * n),
    st.sampled_from([0, 1, 16, 32, 33, 2**32 - 1]),
)
prefixes = st.one_of(
    st.none(),
    keys.map(lambda k: ("keys", pb.KeyPrefix(keys=k))),
    packed_keys.map(lambda k: ("keys", k)),
    token_prefixes.map(lambda t: ("tokens", t)),
)
ttls = st.floats(allow_nan=True, allow_infinity=True) | st.floats(0.001, 100)


def with_prefix(msg: Any, prefix: tuple[str, Any] | None) -> bytes:
    if prefix is not None:
        getattr(msg, prefix[0]).CopyFrom(prefix[1])
    data: bytes = msg.SerializeToString()
    return data


def prefix_valid(prefix: tuple[str, Any], size: int) -> bool:
    """Whether the daemon must accept ``prefix`` for a namespace of ``size``-byte keys."""
    which, msg = prefix
    if which == "tokens":
        packed = msg.packed_token_ids
        return not packed or (not msg.token_ids and len(packed) % 4 == 0)
    return keys_valid(msg, size)


def keys_valid(prefix: pb.KeyPrefix, size: int) -> bool:
    """Whether the daemon must accept the keys of ``prefix`` (``size``-byte keys)."""
    if prefix.packed_keys or prefix.key_size:
        return not prefix.keys and prefix.key_size == size and len(prefix.packed_keys) % size == 0
    return all(len(k) == size for k in prefix.keys)


@st.composite
def namespace_ids(draw: st.DrawFn, target: Target) -> str:
    return draw(st.one_of(ns_ids, st.sampled_from([target.ns, target.ns16])))


# ----------------------------------------------------------------------------- fuzz


@FUZZ
@given(data=st.data(), prefix=prefixes)
def test_fuzz_lookup(target: Target, data: st.DataObject, prefix: Any) -> None:
    ns_id = data.draw(namespace_ids(target))
    status = target.unary("Lookup", with_prefix(pb.LookupRequest(namespace_id=ns_id), prefix))
    known = {target.ns: 32, target.ns16: 16}
    if not ns_id or len(ns_id) > 64:
        expected = C.INVALID_ARGUMENT
    elif ns_id not in known:
        expected = C.NOT_FOUND
    elif prefix is None or not prefix_valid(prefix, known[ns_id]):
        expected = C.INVALID_ARGUMENT
    else:
        expected = OK
    assert status == expected
    target.check_healthy()


@FUZZ
@given(data=st.data(), prefix=prefixes, ttl=ttls, method=st.sampled_from(["Pin", "Unpin"]))
def test_fuzz_pin_unpin(
    target: Target, data: st.DataObject, prefix: Any, ttl: float, method: str
) -> None:
    ns_id = data.draw(namespace_ids(target))
    if method == "Pin":
        body = with_prefix(pb.PinRequest(namespace_id=ns_id, ttl_s=ttl), prefix)
    else:
        body = with_prefix(pb.UnpinRequest(namespace_id=ns_id), prefix)
    assert target.unary(method, body) in (OK, C.INVALID_ARGUMENT, C.NOT_FOUND)
    target.check_healthy()


specs = st.fixed_dictionaries(
    {
        "model": texts,
        "dtype": st.sampled_from(sorted(DTYPE_SIZES)) | texts,
        "num_layers": st.integers(0, 2**32 - 1) | st.integers(0, 8),
        "num_kv_heads": st.integers(0, 2**32 - 1) | st.integers(0, 8),
        "head_dim": st.integers(0, 2**32 - 1) | st.integers(0, 128),
        "block_size": st.integers(0, 2**32 - 1) | st.integers(0, 32),
        "label": texts,
    },
    optional={
        "chunk_blocks": st.integers(0, 2**32 - 1),
        "hash_algo": st.sampled_from(HASH_ALGOS) | texts,
        "hash_seed": st.text(max_size=600),
        "tp_world_size": st.integers(0, 2**32 - 1) | st.integers(0, 8),
        "kv_factor": st.integers(0, 3),
        "part_bytes_override": st.integers(0, 2**64 - 1),
    },
)


@FUZZ
@given(spec=st.none() | specs)
def test_fuzz_register_namespace(target: Target, spec: dict[str, Any] | None) -> None:
    req = pb.RegisterNamespaceRequest()
    if spec is not None:
        req.spec.CopyFrom(pb.NamespaceSpec(**spec))
    status = target.unary("RegisterNamespace", req.SerializeToString())
    assert status in (OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED)
    if spec is None:
        assert status == C.INVALID_ARGUMENT
    target.check_healthy()


@FUZZ
@given(model=texts, from_seq=st.integers(0, 2**64 - 1), log_id=texts)
def test_fuzz_list_stats_watch(target: Target, model: str, from_seq: int, log_id: str) -> None:
    list_req = pb.ListNamespacesRequest(model=model).SerializeToString()
    assert target.unary("ListNamespaces", list_req) == OK
    assert target.unary("Stats", b"") == OK
    status = target.watch(
        pb.WatchEventsRequest(from_seq=from_seq, log_id=log_id).SerializeToString()
    )
    assert status in (OK, C.OUT_OF_RANGE)
    target.check_healthy()


@FUZZ
@given(method=st.sampled_from([*UNARY, "WatchEvents"]), body=st.binary(max_size=300))
def test_fuzz_garbage_bodies(target: Target, method: str, body: bytes) -> None:
    """Random bytes as the request body: undecodable → INVALID_ARGUMENT; bytes that happen to
    decode are an ordinary (probably invalid) request."""
    status = target.watch(body) if method == "WatchEvents" else target.unary(method, body)
    assert status in (OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.OUT_OF_RANGE, C.RESOURCE_EXHAUSTED)
    target.check_healthy()


UNDECODABLE = [
    b"\xff\xff\xff\xff",  # field number 0 / bad tag
    b"\x0a\x05ab",  # truncated length-delimited field
    b"\x0a\x02\xff\xfe",  # namespace_id that is not UTF-8
    b"\x08" + b"\xff" * 11,  # over-long varint
]


@pytest.mark.parametrize("method", [*UNARY, "WatchEvents"])
def test_undecodable_bodies_are_invalid_argument(target: Target, method: str) -> None:
    for body in UNDECODABLE:
        if method in ("Stats", "WatchEvents") and body == b"\x0a\x02\xff\xfe":
            continue  # field 1 is not a string there: kept as an unknown field, still valid
        status = target.watch(body) if method == "WatchEvents" else target.unary(method, body)
        assert status == C.INVALID_ARGUMENT, (method, body)
    target.check_healthy()


def test_huge_inputs(target: Target) -> None:
    too_many_keys = pb.LookupRequest(
        namespace_id=target.ns, keys=pb.KeyPrefix(keys=make_keys(65_537))
    )
    assert target.unary("Lookup", too_many_keys.SerializeToString()) == C.INVALID_ARGUMENT
    too_many_tokens = pb.PinRequest(
        namespace_id=target.ns, ttl_s=1, tokens=pb.TokenPrefix(token_ids=[7] * ((1 << 21) + 1))
    )
    assert target.unary("Pin", too_many_tokens.SerializeToString()) == C.INVALID_ARGUMENT
    huge_key = pb.LookupRequest(namespace_id=target.ns, keys=pb.KeyPrefix(keys=[b"k" * (1 << 20)]))
    assert target.unary("Lookup", huge_key.SerializeToString()) == C.INVALID_ARGUMENT
    huge_ns = pb.LookupRequest(namespace_id="n" * (1 << 20), keys=pb.KeyPrefix())
    assert target.unary("Lookup", huge_ns.SerializeToString()) == C.INVALID_ARGUMENT
    over_limit = bytes(MAX_MESSAGE_BYTES + 1)
    assert target.unary("Lookup", over_limit) == C.RESOURCE_EXHAUSTED  # transport limit
    target.check_healthy()


@pytest.mark.multiprocess
def test_real_daemon_survives_garbage(tmp_path: Path) -> None:
    proc: DaemonProc = start_daemon(tmp_path, "--dram", "2MiB")
    try:
        t = Target(proc.grpc_address)
        try:
            for method in UNARY:
                for body in UNDECODABLE[:2]:
                    assert t.unary(method, body) == C.INVALID_ARGUMENT
            assert t.watch(UNDECODABLE[0]) == C.INVALID_ARGUMENT
            assert t.unary("Lookup", bytes(MAX_MESSAGE_BYTES + 1)) == C.RESOURCE_EXHAUSTED
            reply = t.client.lookup_keys(t.ns, t.keys)
            assert (reply.hit_chunks, reply.num_chunks) == (0, 6)
            assert t.client.health() == "SERVING"
        finally:
            t.close()
        assert proc.terminate() == 0
        assert "Traceback" not in proc.log()
    finally:
        proc.kill()
