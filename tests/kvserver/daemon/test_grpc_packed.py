"""``KeyPrefix.packed_keys`` and ``TokenPrefix.packed_token_ids``: a prefix as one field.

Packed and repeated fields give the same answers; malformed packed fields get INVALID_ARGUMENT
with a message that says what is wrong, and the daemon keeps serving; old clients (repeated
fields) keep working; a new client against a daemon that predates the fields falls back to the
repeated ones.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy
import pytest

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.errors import InvalidArgument
from kvserver.grpc_client import GrpcClient
from kvserver.grpc_format import SERVICE_NAME, keys_from_proto
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_grpc_server import InProcessServer, chunk_keys


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    srv = InProcessServer(tmp_path)
    yield srv
    srv.close()


def raw_lookup(server: InProcessServer, request: pb.LookupRequest) -> pb.LookupResponse:
    """Lookup with ``request`` exactly as built (no client-side packing decisions)."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        reply: pb.LookupResponse = call(request, timeout=10)
        return reply


def packed(ns_id: str, data: bytes, key_size: int, keys: Sequence[bytes] = ()) -> pb.LookupRequest:
    return pb.LookupRequest(
        namespace_id=ns_id,
        keys=pb.KeyPrefix(keys=keys, packed_keys=data, key_size=key_size),
    )


def test_packed_and_repeated_keys_give_the_same_answers(server: InProcessServer) -> None:
    ns_id = server.register(make_spec())
    keys = make_keys(40)
    keys[7] = keys[7][:-1] + b"\x00"  # a key ending in NUL stays whole (not a C string)
    server.store(ns_id, keys[:25])
    with server.client() as new, server.client() as old:
        old.packed_keys = False
        for probe in (keys, keys[:25], keys[3:], [keys[0], keys[30], keys[1]], []):
            a, b = new.lookup_keys(ns_id, probe), old.lookup_keys(ns_id, probe)
            assert (a.hit_chunks, a.num_chunks, a.tiers) == (b.hit_chunks, b.num_chunks, b.tiers)
        assert new.lookup_keys(ns_id, keys).hit_chunks == 25
        assert new.pin(ns_id, keys=keys, ttl_s=60).chunks == 25
        assert new.unpin(ns_id, keys=keys).chunks == 25
        assert new.packed_keys  # the daemon read every packed request
    reply = raw_lookup(server, packed(ns_id, b"".join(keys), 32))
    assert (reply.hit_chunks, reply.num_chunks) == (25, 40)


def test_the_client_packs_only_keys_of_one_length(server: InProcessServer) -> None:
    """Keys of mixed lengths go as repeated keys, so the daemon names the wrong one instead of
    cutting the concatenation at the wrong places."""
    ns_id = server.register(make_spec())
    keys = make_keys(3)
    mixed = [keys[0], keys[1][:31], keys[2] + b"!"]  # 96 bytes: three "32-byte" keys if packed
    with server.client() as client, pytest.raises(InvalidArgument, match="32 bytes"):
        client.lookup_keys(ns_id, mixed)


@pytest.mark.parametrize(
    ("request_of", "message"),
    [
        (lambda ns, k: packed(ns, b"".join(k), 32, k[:1]), "not both"),
        (lambda ns, k: packed(ns, b"".join(k), 0), "32 bytes"),
        (lambda ns, k: packed(ns, b"".join(k)[:48], 16), "32 bytes"),
        (lambda ns, k: packed(ns, b"".join(k)[:-1], 32), "whole number of 32-byte keys"),
        (lambda ns, k: packed(ns, bytes(32 * 65_537), 32), "too many keys"),
    ],
    ids=["both-fields", "no-key-size", "wrong-key-size", "partial-key", "too-many"],
)
def test_malformed_packed_keys_are_invalid_argument(
    server: InProcessServer,
    request_of: Callable[[str, list[bytes]], pb.LookupRequest],
    message: str,
) -> None:
    ns_id = server.register(make_spec())
    keys = make_keys(4)
    server.store(ns_id, keys)
    with pytest.raises(grpc.RpcError) as err:
        raw_lookup(server, request_of(ns_id, keys))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    assert raw_lookup(server, packed(ns_id, b"".join(keys), 32)).hit_chunks == 4  # still serving


def test_too_many_repeated_keys_are_refused_at_their_count() -> None:
    """Lookup, Pin, Unpin and ScoreHosts by ``keys``: 1,000,001 one-byte keys were copied
    into a list of bytes objects (~42 MB here; 5M keys in a 15 MB request, 0.7 s of the
    daemon's loop) before the count was refused; now refused at ``len``, nothing copied."""
    msg = pb.KeyPrefix()
    msg.keys.extend([b"k"] * 1_000_001)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="too many keys"):
            keys_from_proto(msg, 32, 1 << 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert len(keys_from_proto(msg, 32, 1_000_001)) == 1_000_001  # the caller's bound


def test_empty_packed_keys_are_an_empty_prefix(server: InProcessServer) -> None:
    ns_id = server.register(make_spec())
    reply = raw_lookup(server, packed(ns_id, b"", 32))
    assert (reply.hit_chunks, reply.num_chunks) == (0, 0)


class DaemonBeforePackedKeys:
    """A stand-in for a daemon released before ``packed_keys``: its Lookup counts only the
    repeated ``keys`` (protobuf keeps the unknown field aside), as those daemons did. The
    current daemon cannot behave like that, so this is the one part here that is not real."""

    def __init__(self) -> None:
        self.requests: list[pb.LookupRequest] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        handler = grpc.unary_unary_rpc_method_handler(
            self._lookup,
            request_deserializer=self._old_request,
            response_serializer=pb.LookupResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Lookup": handler}),)
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @staticmethod
    def _old_request(data: bytes) -> pb.LookupRequest:
        request: pb.LookupRequest = pb.LookupRequest.FromString(data)
        # drop the fields it did not know (touching the other oneof member would select it)
        if request.WhichOneof("prefix") == "keys":
            request.keys.packed_keys, request.keys.key_size = b"", 0
        elif request.WhichOneof("prefix") == "tokens":
            request.tokens.packed_token_ids = b""
        return request

    def _lookup(self, request: pb.LookupRequest, context: object) -> pb.LookupResponse:
        self.requests.append(request)
        n = len(request.keys.keys) + len(request.tokens.token_ids) // 16
        return pb.LookupResponse(
            namespace_id=request.namespace_id, hit_chunks=n, num_chunks=n, chunk_tokens=16
        )

    def close(self) -> None:
        self._server.stop(None)


def test_a_new_client_falls_back_to_repeated_keys_for_an_older_daemon() -> None:
    old = DaemonBeforePackedKeys()
    try:
        with GrpcClient(f"127.0.0.1:{old.port}", timeout=10) as client:
            keys = make_keys(5)
            assert client.lookup_keys("ns", keys).num_chunks == 5
            assert not client.packed_keys
            assert client.lookup_keys("ns", keys[:3]).num_chunks == 3
        # the first call went packed, was seen as empty and resent; then repeated only
        assert [len(r.keys.keys) for r in old.requests] == [0, 5, 3]
    finally:
        old.close()


def test_a_new_client_sends_token_ids_repeated_to_an_older_daemon() -> None:
    old = DaemonBeforePackedKeys()
    try:
        with GrpcClient(f"127.0.0.1:{old.port}", timeout=10) as client:
            assert client.lookup_tokens("ns", list(range(40))).num_chunks == 2
            assert not client.packed_tokens
            assert client.lookup_tokens("ns", list(range(16))).num_chunks == 1
        assert [len(r.tokens.token_ids) for r in old.requests] == [0, 40, 16]
    finally:
        old.close()


def lookup_tokens_request(ns_id: str, **tokens: Any) -> pb.LookupRequest:
    return pb.LookupRequest(namespace_id=ns_id, tokens=pb.TokenPrefix(**tokens))


def test_packed_and_repeated_token_ids_give_the_same_answers(server: InProcessServer) -> None:
    spec = make_spec()
    ns_id = server.register(spec)
    tokens = [t * 7919 % 128_256 for t in range(200)]
    tokens[20] = 2**32 - 1  # every width, the largest id included
    salted = {"cache_salt": "tenant-a", "lora": ("ad", "/p")}
    server.store(ns_id, chunk_keys(spec, tokens[:160], **salted))
    with server.client() as new, server.client() as old:
        old.packed_tokens = False
        for probe in (tokens, tokens[:100], tokens[:3], [], numpy.array(tokens, numpy.uint32)):
            for kw in ({}, salted):
                a = new.lookup_tokens(ns_id, probe, **kw)  # type: ignore[arg-type]
                b = old.lookup_tokens(ns_id, probe, **kw)  # type: ignore[arg-type]
                assert (a.hit_chunks, a.num_chunks) == (b.hit_chunks, b.num_chunks)
        assert new.lookup_tokens(ns_id, tokens, **salted).hit_chunks == 10  # type: ignore[arg-type]
        assert new.packed_tokens  # a prompt shorter than a chunk did not look like an old daemon
    packed = numpy.array(tokens, "<u4").tobytes()
    reply = raw_lookup(server, lookup_tokens_request(ns_id, packed_token_ids=packed))
    assert reply.num_chunks == 12


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"packed_token_ids": bytes(64), "token_ids": [1]}, "not both"),
        ({"packed_token_ids": bytes(63)}, "whole number of 4-byte ids"),
    ],
    ids=["both-fields", "partial-id"],
)
def test_malformed_packed_token_ids_are_invalid_argument(
    server: InProcessServer, fields: dict[str, object], message: str
) -> None:
    ns_id = server.register(make_spec())
    with pytest.raises(grpc.RpcError) as err:
        raw_lookup(server, lookup_tokens_request(ns_id, **fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    assert raw_lookup(server, lookup_tokens_request(ns_id, token_ids=[1] * 32)).num_chunks == 2


def test_the_client_refuses_token_ids_that_are_not_uint32(server: InProcessServer) -> None:
    ns_id = server.register(make_spec())
    with server.client() as client:
        bad_ids: list[list[Any]] = [[-1], [2**32], ["7"]]
        for bad in bad_ids:
            with pytest.raises(InvalidArgument, match="token ids"):
                client.lookup_tokens(ns_id, bad)
