"""A daemon on IPv6 (``--host ::1``) writes its addresses with the host in brackets
(``tcp://[::1]:P``, ``[::1]:G``) into its fleet record and its start-up line; records that
version-1 daemons wrote without brackets (``tcp://::1:P``) are still read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver import wire
from kvserver.client import KVClient
from kvserver.client.common import data_address
from kvserver.cluster import schema
from kvserver.cluster.schema import HostInfo
from kvserver.daemon.peers.stream import split_address
from kvserver.grpc_client import GrpcClient
from kvserver.netaddr import host_port, is_ipv6_endpoint
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import start_daemon, wait_until
from tests.support.ipv6 import needs_ipv6
from tests.support.redis import RedisServer


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("::1", 9470, "[::1]:9470"),
        ("fe80::1%eth0", 5, "[fe80::1%eth0]:5"),
        ("[::1]", 5, "[::1]:5"),  # an --advertise-addr given in brackets stays as it is
        ("127.0.0.1", 9471, "127.0.0.1:9471"),
        ("kv-host.example", 1, "kv-host.example:1"),
    ],
)
def test_host_port_brackets_ipv6_hosts_only(host: str, port: int, expected: str) -> None:
    assert host_port(host, port) == expected


def test_a_record_a_version_1_daemon_wrote_without_brackets_is_still_read() -> None:
    """Scenario: a fleet mid-upgrade: an older daemon on ::1 wrote ``tcp://::1:P``."""
    old = HostInfo("old", "i1", "tcp://::1:9471", "::1:9470", stream_address="tcp://::1:9474")
    record = HostInfo.decode(old.encode())
    assert (record.data_address, record.grpc_address) == ("tcp://::1:9471", "::1:9470")
    assert split_address(record.stream_address) == ("::1", 9474)
    assert data_address(record.data_address) == "tcp://::1:9471"


@needs_ipv6
@pytest.mark.multiprocess
def test_a_daemon_on_ipv6_loopback_writes_bracketed_addresses(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Scenario: ``kvserver start --host ::1 --cluster URL``; its record named
    ``tcp://::1:P`` (before session 14), which reads as a host ``::1:P`` without a port."""
    d = start_daemon(
        tmp_path, "--host", "::1", "--dram", "4MiB", "--page-size", "4KiB", "--no-auth",
        "--cluster", redis_server.url, "--host-id", "v6",
    )  # fmt: skip
    try:
        raw = wait_until(lambda: redis_server.cli("GET", schema.host_key("v6")), timeout=60.0)
        record = HostInfo.decode(raw)
        zmq, grpc, stream = (d.info[k] for k in ("zmq_port", "grpc_port", "peer_stream_port"))
        assert record.data_address == f"tcp://[::1]:{zmq}"
        assert record.grpc_address == f"[::1]:{grpc}"
        assert record.stream_address == f"tcp://[::1]:{stream}"
        assert data_address(record.data_address) == record.data_address
        assert split_address(record.stream_address) == ("::1", stream)
        with GrpcClient(record.grpc_address) as client:  # the record's address reaches it
            cluster = client.stats().cluster
            assert cluster is not None and cluster["host_id"] == "v6"
        assert f"gRPC [::1]:{grpc}, ZMQ data tcp://[::1]:{zmq}, events tcp://[::1]:" in d.log()
    finally:
        d.kill()


@pytest.mark.parametrize(
    ("address", "ipv6"),
    [
        ("tcp://[::1]:5", True),
        ("tcp://::1:5", True),  # as version-1 daemons wrote it
        ("tcp://[fe80::1%eth0]:5", True),
        ("tcp://127.0.0.1:5", False),
        ("tcp://kv-host.example:5", False),
        ("ipc:///tmp/kv.sock", False),
    ],
)
def test_is_ipv6_endpoint(address: str, ipv6: bool) -> None:
    assert is_ipv6_endpoint(address) is ipv6


@needs_ipv6
@pytest.mark.multiprocess
@pytest.mark.parametrize("stream", [False, True], ids=["zmq", "stream"])
@pytest.mark.parametrize("form", ["tcp://[::1]:{}", "tcp://::1:{}"], ids=["brackets", "bare"])
def test_a_remote_client_reaches_a_daemon_on_ipv6_loopback(
    tmp_path: Path, stream: bool, form: str
) -> None:
    """Scenario: ``kvserver start --host ::1``; a remote ``KVClient`` given the address its
    fleet record names (or a version-1 record's bare form) puts and gets, over ZMQ or the
    stream port. Before session 14 the client's DEALER never set ``ZMQ_IPV6``: 'no reply from
    tcp://[::1]:P within 10s'."""
    d = start_daemon(
        tmp_path, "--host", "::1", "--dram", "4MiB", "--page-size", "4KiB", "--no-auth",
    )  # fmt: skip
    try:
        address = form.format(d.info["zmq_port"])
        keys = make_keys(3, tag="v6")
        payload = [pattern(key, 0, 4096) for key in keys]
        with KVClient(address, colocated=False, timeout=30.0, stream=stream) as kv:
            ns_id = kv.register_namespace(make_spec()).ns_id
            assert kv.put(ns_id, keys, payload).stored == keys
            assert [bytes(parts[0]) for parts in kv.get(ns_id, keys)] == payload
            over_zmq = kv.sent_by_op[wire.PUT] + kv.sent_by_op[wire.GET]
        assert over_zmq == (0 if stream else 2)  # the stream was taken where asked for
    finally:
        d.kill()
