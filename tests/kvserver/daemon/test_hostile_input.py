"""Hostile input the fuzzers of ``test_zmq_fuzz.py`` did not reach, against the real daemon on
both data-plane sockets (the ZMQ ROUTER and the local channel): each gets exactly one clear
error reply, changes nothing, and a well-behaved client is served byte-exact afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvserver import wire
from tests.kvserver.daemon.test_zmq_fuzz import LIMIT, SPEC, Fuzzed, assert_round_trip, req
from tests.support.daemon import start_daemon

pytestmark = pytest.mark.multiprocess

#: a namespace spec's largest integer field (``kvserver.namespace.MAX_FIELD_INT``).
MAX_FIELD_INT = (1 << 32) - 1


@pytest.fixture(scope="module", params=["zmq", "local"])
def fz(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fuzzed]:
    d = start_daemon(
        tmp_path_factory.mktemp("hostile"),
        "--page-size",
        "4KiB",
        "--dram",
        "8MiB",
        "--no-auth",
        env={"KVSERVER_MAX_MESSAGE_BYTES": str(LIMIT)},
    )
    fuzzed = Fuzzed(d, transport=request.param)
    yield fuzzed
    fuzzed.close()
    assert d.proc.poll() is None, "the daemon died"
    assert d.terminate() == 0, d.log()[-3000:]


def test_namespace_fields_beyond_uint32_are_refused(fz: Fuzzed) -> None:
    """block_size and chunk_blocks of 2^62 (the part size overridden): the namespace was
    registered, then its reply's chunk_tokens (2^124) could not be encoded: no reply at all,
    an ``internal`` traceback in the log, and a namespace gRPC could not list."""
    spec = SPEC.to_dict() | {"part_bytes_override": 4096, "model": "test/huge-fields"}
    for fields in (
        {"block_size": 1 << 62, "chunk_blocks": 1 << 62},
        {"num_layers": MAX_FIELD_INT + 1},
        {"head_dim": 1 << 63},
    ):
        fz.error(
            [req(wire.REGISTER_NAMESPACE, {"spec": spec | fields})],
            "invalid_argument",
            f"must be an integer in 1..{MAX_FIELD_INT}",
        )
    reply, _ = fz.exchange([req(wire.NAMESPACES, {})])
    assert {s["model"] for s in reply.result["namespaces"]} == {SPEC.model}
    largest = spec | {"block_size": MAX_FIELD_INT, "chunk_blocks": MAX_FIELD_INT}
    reply, _ = fz.exchange([req(wire.REGISTER_NAMESPACE, {"spec": largest})])
    assert reply.ok and reply.result["chunk_tokens"] == MAX_FIELD_INT * MAX_FIELD_INT
    assert_round_trip(fz, "huge-fields")
