"""``KeyPrefix.packed_keys``: the keys of a prefix as one field (Lookup, Pin, Unpin).

Packed and repeated keys give the same answers; malformed packed keys get INVALID_ARGUMENT with
a message that says what is wrong, and the daemon keeps serving; old clients (repeated keys)
keep working; a new client against a daemon that predates the field falls back to repeated keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.errors import InvalidArgument
from kvserver.grpc_client import GrpcClient
from kvserver.grpc_format import SERVICE_NAME
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_grpc_server import InProcessServer


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
        request.keys.packed_keys, request.keys.key_size = b"", 0  # fields it did not know
        return request

    def _lookup(self, request: pb.LookupRequest, context: object) -> pb.LookupResponse:
        self.requests.append(request)
        n = len(request.keys.keys)
        return pb.LookupResponse(namespace_id=request.namespace_id, hit_chunks=n, num_chunks=n)

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
