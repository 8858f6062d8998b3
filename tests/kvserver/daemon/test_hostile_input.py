"""Hostile input the fuzzers of ``test_zmq_fuzz.py`` did not reach, against the real daemon on
both data-plane sockets (the ZMQ ROUTER and the local channel): each gets exactly one clear
error reply, changes nothing, and a well-behaved client is served byte-exact afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver import wire
from kvserver.client import KVClient
from kvserver.errors import KVServerError
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_zmq_fuzz import (
    SPEC,
    Fuzzed,
    assert_round_trip,
    fuzzed_daemon,
    parts,
    req,
)
from tests.support.daemon import start_daemon

pytestmark = pytest.mark.multiprocess

#: a namespace spec's largest integer field (``kvserver.namespace.MAX_FIELD_INT``).
MAX_FIELD_INT = (1 << 32) - 1


@pytest.fixture(scope="module", params=["zmq", "local"])
def fz(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fuzzed]:
    yield from fuzzed_daemon(tmp_path_factory, request.param, "hostile")


def test_namespace_fields_beyond_uint32_are_refused(fz: Fuzzed) -> None:
    """block_size and chunk_blocks of 2^62 (the part size overridden): the namespace was
    registered, then its reply's chunk_tokens (2^124) could not be encoded: no reply at all,
    an ``internal`` traceback in the log, and a namespace gRPC could not list."""
    spec = SPEC.to_dict() | {"part_bytes_override": 4096, "model": "test/huge-fields"}
    for fields, match in (
        ({"block_size": 1 << 62, "chunk_blocks": 1 << 62}, "must be an integer in 1.."),
        ({"num_layers": MAX_FIELD_INT + 1}, "must be an integer in 1.."),
        ({"head_dim": 1 << 63}, "must be an integer in 1.."),
        ({"block_size": MAX_FIELD_INT, "chunk_blocks": MAX_FIELD_INT}, "tokens per chunk"),
    ):
        fz.error([req(wire.REGISTER_NAMESPACE, {"spec": spec | fields})], "invalid_argument", match)
    reply, _ = fz.exchange([req(wire.NAMESPACES, {})])
    assert {s["model"] for s in reply.result["namespaces"]} == {SPEC.model}


def test_token_counts_of_the_largest_chunks_are_answered(fz: Fuzzed) -> None:
    """A namespace of 2^32-1 tokens per chunk: a lookup's hit_tokens for its chunks fits the
    wire's integers (with 2^64-2^33+1 tokens per chunk, two hits were past 2^64: no reply)."""
    spec = SPEC.to_dict() | {"part_bytes_override": 4096, "model": "test/huge-chunks",
                             "tp_world_size": 1, "block_size": MAX_FIELD_INT}  # fmt: skip
    reply, _ = fz.exchange([req(wire.REGISTER_NAMESPACE, {"spec": spec})])
    assert reply.ok and reply.result["chunk_tokens"] == MAX_FIELD_INT
    ns, keys = reply.result["ns_id"], make_keys(2, tag="huge-chunks")
    with KVClient(fz.daemon.zmq_address) as kv:
        assert kv.store(ns, keys, [[bytes(4096)] for _ in keys]) == keys
    reply, _ = fz.exchange([req(wire.LOOKUP, {"ns_id": ns, "keys": keys})])
    assert reply.result["hit_chunks"] == 2 and reply.result["hit_tokens"] == 2 * MAX_FIELD_INT
    assert_round_trip(fz, "huge-fields")


def test_replies_never_carry_a_part_twice(fz: Fuzzed) -> None:
    """A get naming one key 16,384 times and rank 0 16,384 times asked for 2^28 copies of one
    2 KiB part (512 GiB from an 8 MiB arena: the daemon copied until it ran out of memory); a
    read_parts naming a key of its lease twice, likewise; a prepare_load's grant repeated the
    key's extents (65,536 copies of a key of 4,096 ranks: a 2 GB grant). Refused before
    anything is pinned."""
    key = fz.keys[0]
    ns = fz.ns.ns_id
    fz.error(
        [req(wire.GET, {"ns_id": ns, "keys": [key] * (1 << 14), "ranks": [0] * (1 << 14)})],
        "invalid_argument",
        "get: duplicate keys",
    )
    fz.error(
        [req(wire.GET, {"ns_id": ns, "keys": [key], "ranks": [0, 1, 0]})],
        "invalid_argument",
        "get: duplicate ranks",
    )
    fz.error(
        [req(wire.GET, {"ns_id": ns, "keys": [key, fz.keys[1], key]})],
        "invalid_argument",
        "get: duplicate keys",
    )
    reply, frames = fz.exchange([req(wire.GET, {"ns_id": ns, "keys": fz.keys[:2], "ranks": [1]})])
    assert reply.ok and [bytes(f) for f in frames] == [p[1] for p in parts(fz.keys[:2])]

    fz.error(
        [req(wire.PREPARE_LOAD, {"ns_id": ns, "keys": [key, fz.keys[1], key]})],
        "invalid_argument",
        "prepare_load: duplicate keys",
    )
    with KVClient(fz.daemon.zmq_address) as kv:
        grant = kv.prepare_load(ns, fz.keys[:2])
        try:
            args = {"ns_id": ns, "lease_id": grant.lease_id, "keys": [key] * 4096, "rank": 0}
            fz.error(
                [req(wire.READ_PARTS, args)],
                "invalid_argument",
                "read_parts: duplicate keys",
            )
        finally:
            kv.complete_load(grant.lease_id)

        def pinned() -> int:
            return int(kv.stats()["pinned_pages"])

        assert pinned() == 0
    keys = make_keys(2, tag="twice")
    with KVClient(fz.daemon.zmq_address, colocated=False) as kv:
        kv.store(ns, keys, parts(keys))
        assert [[bytes(p) for p in row] for row in kv.get(ns, keys, ranks=[1, 0])] == [
            [p[1], p[0]] for p in parts(keys)
        ]
    assert_round_trip(fz, "twice")


def test_stats_stay_readable_with_many_namespaces(tmp_path: Path) -> None:
    """Past 64 registered namespaces (any client may register them) the stats reply's
    per-namespace map was over the clients' 64-entry map limit: every client's stats failed
    ("discarding unreadable reply", then a timeout), kvserver status with it."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "8MiB", "--no-auth")
    try:
        with KVClient(d.zmq_address, timeout=10) as kv:
            seeds = [f"seed-{i}" for i in range(70)]
            specs = [make_spec(model=SPEC.model, tp_world_size=2, hash_seed=s) for s in seeds]
            ids = {kv.register_namespace(spec).ns_id for spec in specs}
            assert ids <= set(kv.stats()["namespaces"]) and len(kv.namespaces()) == 70
            keys = make_keys(2, tag="many")
            ns = sorted(ids)[0]
            assert kv.store(ns, keys, parts(keys)) == keys
            assert [[bytes(p) for p in row] for row in kv.load(ns, keys)] == parts(keys)
    finally:
        assert d.terminate() == 0, d.log()[-3000:]


@pytest.mark.parametrize("local", [False, True], ids=["zmq", "local"])
def test_a_reply_that_cannot_be_encoded_is_answered_internal(tmp_path: Path, local: bool) -> None:
    """A result msgpack refuses (a daemon bug, injected: ``tests/support/bad_reply.py``) was
    only logged: the caller got no reply and waited for its timeout. Now it is answered with
    an ``internal`` error at once, and the daemon serves that client and others on."""
    arm = tmp_path / "arm"
    d = start_daemon(
        tmp_path,
        *("--page-size", "4KiB", "--dram", "8MiB", "--no-auth"),
        env={"BAD_REPLY_ARM": str(arm)},
        module="tests.support.bad_reply",
    )
    try:
        with KVClient(d.zmq_address, timeout=10, local=local) as kv:
            ns = kv.register_namespace(SPEC).ns_id
            assert "unencodable" not in kv.stats()
            arm.touch()
            with pytest.raises(KVServerError, match="could not be encoded") as caught:
                kv.stats()
            assert caught.value.code == "internal"
            keys = make_keys(2, tag="after-bad-reply")
            assert kv.store(ns, keys, parts(keys)) == keys
            with KVClient(d.zmq_address, timeout=10) as other:
                assert [[bytes(p) for p in row] for row in other.get(ns, keys)] == parts(keys)
        assert "the reply to request" in d.log()
    finally:
        assert d.terminate() == 0, d.log()[-3000:]
