"""A daemon on IPv6 (``--host ::1``) writes its addresses with the host in brackets
(``tcp://[::1]:P``, ``[::1]:G``) into its fleet record and its start-up line; records that
version-1 daemons wrote without brackets (``tcp://::1:P``) are still read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.client.common import data_address
from kvserver.cluster import schema
from kvserver.cluster.schema import HostInfo
from kvserver.daemon.peers.stream import split_address
from kvserver.grpc_client import GrpcClient
from kvserver.netaddr import host_port
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
