"""``lookup_tokens`` with packed token ids, and the bound on ids sent as a msgpack list.

A real daemon on loopback. A list of more than ``wire.MAX_ARRAY_LEN`` (65,536) ids is refused
at its array header with an error naming the packed form (before: 1M ints decoded, holding
the daemon's GIL for tens of ms, then hashed); the packed form (capability
``packed_token_ids``, which ``KVClient`` uses when the daemon announces it) gives the keys of
the namespace's algorithm, at any length up to the prompt limit, and the list form still works
up to the bound (older clients). A malformed packed form is a clear error; nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvserver import prompts, wire
from kvserver.client import KVClient
from kvserver.errors import InvalidArgument
from tests.kvserver.builders import make_spec
from tests.kvserver.daemon.test_grpc_server import chunk_keys
from tests.support.daemon import DaemonProc, raw_dealer, start_daemon

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/packed-ids", hash_algo="xxhash_cbor")
LONG = [(i * 7919) % 50_000 for i in range(200_000 + 5)]  # 12,500 chunks and a partial tail


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("packed"), "--dram", "16MiB")
    yield d
    assert d.terminate() == 0, d.log()


def ask(d: DaemonProc, token_ids: object) -> wire.Reply:
    """One ``lookup_tokens`` with ``token_ids`` as given, on a bare DEALER."""
    with KVClient(d.zmq_address, colocated=False) as kv:
        ns_id = kv.register_namespace(SPEC).ns_id
    sock = raw_dealer(d.zmq_address)
    try:
        args = {"ns_id": ns_id, "token_ids": token_ids}
        sock.send(wire.encode_request(7, wire.LOOKUP_TOKENS, args, auth=d.token))
        assert sock.poll(30_000), "no reply"
        return wire.decode_reply(sock.recv())
    finally:
        sock.close(linger=0)


def test_the_daemon_announces_packed_token_ids(daemon: DaemonProc) -> None:
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        kv.stats()  # (a call: the hello has been answered)
        assert wire.CAP_PACKED_TOKEN_IDS in kv.capabilities


def test_a_long_list_of_ids_is_refused_at_its_header_naming_the_packed_form(
    daemon: DaemonProc,
) -> None:
    """1M ids as a list: invalid_argument, the message names the packed form."""
    reply = ask(daemon, list(range(1 << 20)))
    assert not reply.ok  # (id 0: the header was not decoded, as for any unreadable one)
    assert isinstance(reply.error, InvalidArgument)
    assert "packed" in str(reply.error) and "65536" in str(reply.error)


def test_packed_ids_give_the_keys_of_the_namespaces_algorithm(daemon: DaemonProc) -> None:
    """KVClient packs: a 200k-token prompt finds the chunks stored under the keys a vLLM
    replica computes; the list form of a prompt under the bound is answered the same."""
    keys = chunk_keys(SPEC, LONG)
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        ns_id = kv.register_namespace(SPEC).ns_id
        parts = [[bytes(SPEC.part_bytes)] for _ in range(5)]
        assert kv.store(ns_id, keys[:5], parts) == keys[:5]
        got = kv.lookup_tokens(ns_id, LONG)
        assert (got.hit_chunks, got.num_chunks) == (5, 12_500)
    short = LONG[: 1 << 16]
    as_list, packed = ask(daemon, short), ask(daemon, prompts.pack_token_ids(short))
    assert as_list.ok and packed.ok and as_list.result == packed.result
    assert as_list.result["hit_chunks"] == 5


@pytest.mark.parametrize(
    "token_ids, why",
    [
        (b"\x01\x00\x00", "not whole u32 ids"),
        (bytes(4 * ((1 << 21) + 1)), "too many tokens"),
    ],
)
def test_a_malformed_or_oversized_packed_form_is_a_clear_error(
    daemon: DaemonProc, token_ids: bytes, why: str
) -> None:
    reply = ask(daemon, token_ids)
    assert not reply.ok and isinstance(reply.error, InvalidArgument), why
    assert "token_ids" in str(reply.error) or "too many tokens" in str(reply.error)


def test_ids_past_u32_stay_a_list() -> None:
    """What does not fit the packed form is sent as a list; the packed form round-trips."""
    assert prompts.pack_token_ids([1, 1 << 32]) is None
    ids = [0, 7, (1 << 32) - 1]
    assert list(prompts.unpack_token_ids(prompts.pack_token_ids(ids) or b"")) == ids
    assert prompts.pack_token_ids([1, 2]) == b"\x01\x00\x00\x00\x02\x00\x00\x00"  # LE
