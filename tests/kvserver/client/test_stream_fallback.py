"""When the clients send a ``put`` / ``get`` over the daemon's stream port and when over ZMQ
(``kvserver/client/stream_use.py``): the rules of :func:`stream_address`, and a daemon restarted
under a client that was using the stream (real daemons on loopback).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvserver import wire
from kvserver.client import KVClient
from kvserver.client.stream_use import stream_address
from tests.kvserver.builders import make_keys
from tests.kvserver.client.test_client import SPEC, as_bytes, parts
from tests.support.daemon import port_kept, start_daemon

TLS_ONLY = {"peer_stream_port": None, "peer_stream_tls_port": 7002}
HELLO = {"capabilities": [wire.CAP_STREAM_OPS], "peer_stream_port": 7001,
         "peer_stream_tls_port": None}  # fmt: skip


def session(address: str = "tcp://10.0.0.5:5555", **fields: Any) -> Any:
    """What :func:`stream_address` reads of a client's session."""
    server = {**HELLO, **fields.pop("server", {})}
    return SimpleNamespace(**{"arena": None, "curve": None, **fields}, server=server,
                           address=address)  # fmt: skip


@pytest.mark.parametrize(
    ("s", "tls", "expected"),
    [
        pytest.param(session(), False, ("10.0.0.5", 7001), id="plain"),
        pytest.param(session("tcp://[::1]:5555"), False, ("::1", 7001), id="ipv6"),
        pytest.param(session(arena=object()), False, None, id="colocated"),
        pytest.param(session(curve=object()), False, None, id="curve"),
        pytest.param(
            session(curve=object(), server=TLS_ONLY),
            True, ("10.0.0.5", 7002), id="curve-over-tls",
        ),
        pytest.param(session("ipc:///tmp/kv.sock"), False, None, id="ipc"),
        pytest.param(session(server={"capabilities": []}), False, None, id="older-daemon"),
        pytest.param(session(), True, None, id="tls-client-plain-daemon"),
        pytest.param(
            session(server=TLS_ONLY), False,
            None, id="plain-client-tls-daemon",
        ),
    ],
)  # fmt: skip
def test_stream_address_rules(s: Any, tls: bool, expected: tuple[str, int] | None) -> None:
    """Only a remote client without CURVE (unless it dials TLS) over tcp:// to a daemon that
    announces ``stream_ops`` and a port of the client's mode; a TLS client never a plain port."""
    assert stream_address(s, tls=tls) == expected


@pytest.mark.multiprocess
def test_a_daemon_restarted_under_a_stream_client(tmp_path: Path) -> None:
    """The daemon killed and started again on the same ZMQ port (its stream port another):
    the client's next put finds the old link dead and goes over ZMQ (answered by the new
    daemon, the namespace registered again); the call after it opens a link to the new
    stream port at once (a link that had served and was found closed is not a stream
    failure: no RETRY_S of ZMQ)."""
    first = start_daemon(tmp_path / "first", *port_kept(), "--no-auth")
    keys = make_keys(2, tag="restart")
    try:
        with KVClient(first.zmq_address, colocated=False, stream=True, timeout=30) as kv:
            kv.register_namespace(SPEC)
            assert kv.put(SPEC.ns_id, keys[:1], parts(keys[:1])).stored == keys[:1]
            assert kv.sent_by_op[wire.PUT] == 0
            first.kill()
            second = start_daemon(tmp_path / "second", "--zmq-port", str(first.info["zmq_port"]),
                                  "--no-auth")  # fmt: skip
            try:
                assert kv.put(SPEC.ns_id, keys, parts(keys)).stored == keys
                assert kv.sent_by_op[wire.PUT] >= 1  # over ZMQ, to the new daemon
                assert as_bytes(kv.get(SPEC.ns_id, keys)) == parts(keys)
                assert kv.sent_by_op[wire.GET] == 0  # over the new daemon's stream
                assert kv.stats()["peer_stream"]["port"] == second.info["peer_stream_port"]
            finally:
                second.kill()
    finally:
        first.kill()
