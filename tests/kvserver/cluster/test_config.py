"""Cluster URLs and settings: every form parses, every bad one is a clear InvalidArgument."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.cluster.config import (
    ClusterConfig,
    advertised_beyond_reach,
    client_errors,
    connect,
    parse_url,
    parse_weights,
)
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument
from tests.support.redis import require_client


@pytest.mark.parametrize(
    ("url", "nodes", "cluster", "tls", "db"),
    [
        ("redis://10.0.0.1:6380/2", (("10.0.0.1", 6380),), False, False, 2),
        ("redis://r", (("r", 6379),), False, False, 0),
        ("rediss://u:p@r:6390/0?ssl_ca_certs=/ca.pem", (("r", 6390),), False, True, 0),
        ("redis+cluster://a:1,b:2,c:3", (("a", 1), ("b", 2), ("c", 3)), True, False, 0),
        ("rediss+cluster://a:1", (("a", 1),), True, True, 0),
        ("valkey://10.0.0.1:6380/2", (("10.0.0.1", 6380),), False, False, 2),
        ("valkeys://u:p@r:6390/0?ssl_ca_certs=/ca.pem", (("r", 6390),), False, True, 0),
        ("valkey+cluster://a:1,b:2", (("a", 1), ("b", 2)), True, False, 0),
        ("valkeys+cluster://a:1", (("a", 1),), True, True, 0),
    ],
)
def test_every_url_form_parses(
    url: str, nodes: tuple[tuple[str, int], ...], cluster: bool, tls: bool, db: int
) -> None:
    t = parse_url(url)
    assert (t.nodes, t.cluster, t.tls, t.db) == (nodes, cluster, tls, db)
    assert t.client == ("valkey" if url.startswith("valkey") else "redis")
    assert "p@" not in t.describe()
    assert t.describe().partition("://")[0] == url.partition("://")[0]


@pytest.mark.parametrize(
    ("url", "module", "cls"),
    [
        ("redis://r:1/0", "redis", "Redis"),
        ("redis+cluster://a:1,b:2", "redis", "RedisCluster"),
        ("valkey://r:1/0", "valkey", "Valkey"),
        ("valkeys+cluster://a:1", "valkey", "ValkeyCluster"),
    ],
)
async def test_the_scheme_picks_the_client_library(url: str, module: str, cls: str) -> None:
    """redis* → redis-py, valkey* → valkey (clients connect lazily: no server needed)."""
    require_client(module)
    client = connect(ClusterConfig(url))
    try:
        assert type(client).__module__.partition(".")[0] == module
        assert type(client).__name__ == cls
        assert client_errors(client)[0].__module__ == f"{module}.exceptions"
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "http://r:1",
        "redis://a:1,b:2",
        "redis://r:notaport",
        "redis://r:1/x",
        "redis+cluster://a:1/3",
        "redis://r:1?ssl_ca_certs=x",
        "rediss://r:1?bogus=1",
        "redis://:0",
        "valkey://a:1,b:2",
        "valkey://r:1?ssl_ca_certs=x",
        "valkeyss://r:1",
        "valkey+clusters://r:1",
    ],
)
def test_bad_urls_are_refused_naming_the_forms(url: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_url(url)


def test_credentials_are_read_and_hidden() -> None:
    t = parse_url("rediss://me:s%40cret@r:1")
    assert (t.username, t.password) == ("me", "s@cret")
    assert "cret" not in repr(t)


def test_weights_parse_with_defaults_and_refuse_unknown_tiers() -> None:
    assert parse_weights("ssd=0.25") == {"dram": 1.0, "ssd": 0.25}
    for bad in ("gpu=1", "dram", "dram=x", "dram=-1"):
        with pytest.raises(InvalidArgument):
            parse_weights(bad)


def test_heartbeat_must_be_below_the_ttl() -> None:
    assert ClusterConfig("redis://r", ttl_s=9).heartbeat_interval_s == 3
    with pytest.raises(InvalidArgument):
        ClusterConfig("redis://r", ttl_s=1, heartbeat_s=2)


def test_daemon_config_carries_the_cluster_settings() -> None:
    cfg = DaemonConfig.load(
        env={"KVSERVER_CLUSTER": "redis://r:1/0", "KVSERVER_CLUSTER_TTL_S": "4"},
        overrides={"advertise_addr": "10.1.2.3", "host_id": "node-7"},
    )
    cc = cfg.cluster_config()
    assert cc is not None and cc.ttl_s == 4.0 and cc.target().nodes == (("r", 1),)
    assert cfg.advertised_host == "10.1.2.3"
    assert DaemonConfig().cluster_config() is None
    wildcard = DaemonConfig(host="0.0.0.0", insecure_remote=True)
    assert wildcard.advertised_host not in ("0.0.0.0", "")
    with pytest.raises(InvalidArgument):
        DaemonConfig(cluster="mysql://x")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--cluster", "mysql://db:3306"], "redis://HOST:PORT/DB"),
        (["--cluster", "redis://r:1", "--host-id", "a b"], "host id"),
        (["--cluster", "redis://r:1", "--cluster-tier-weights", "gpu=1"], "unknown tier"),
    ],
)
def test_kvserver_start_refuses_bad_cluster_settings_before_starting(
    flags: list[str], words: str
) -> None:
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "start", "--grpc-port", "0", "--zmq-port", "0",
         "--pub-port", "-1", "--metrics-port", "-1", *flags],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr  # a usage error, nothing started
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("ssl_ca_certs={missing}", "ssl_ca_certs"),
        ("ssl_ca_certs={not_pem}", "ssl_ca_certs"),
        ("ssl_ca_certs={ca}&ssl_certfile={missing}", "ssl_certfile"),
        ("ssl_keyfile={ca}", "ssl_keyfile"),
        ("ssl_ca_certs={ca}&ssl_cert_reqs=always", "ssl_cert_reqs"),
    ],
)
def test_tls_files_and_options_are_checked_when_the_daemon_is_configured(
    tmp_path: Path, query: str, named: str
) -> None:
    """A CA file missing or not PEM, a client certificate missing, a bad ``ssl_cert_reqs``:
    refused by ``kvserver start``'s configuration, naming the parameter. Before, the daemon
    started and stayed ``unavailable`` for ever, a missing CA reported as "Error 2
    connecting to HOST:PORT. No such file or directory." (which file, it did not say)."""
    pytest.importorskip("cryptography")
    from kvserver.crypto import make_tls_cert

    ca, _ = make_tls_cert(str(tmp_path / "tls"), "redis", ["127.0.0.1"])
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    missing = tmp_path / "missing.pem"
    url = "rediss://127.0.0.1:6380/0?" + query.format(ca=ca, not_pem=not_pem, missing=missing)
    with pytest.raises(InvalidArgument, match=named):
        DaemonConfig(cluster=url)
    assert ClusterConfig(f"rediss://127.0.0.1:6380/0?ssl_ca_certs={ca}").target().tls


def test_a_loopback_address_advertised_to_a_fleet_beyond_loopback_is_named() -> None:
    """``--host 127.0.0.1`` (the default) and no ``--advertise-addr`` in a fleet whose Redis
    is on another host: peers elsewhere would reach their own loopback; the daemon says so
    at start (``process.py`` logs it). A fleet on one host (Redis on loopback) or an
    address peers reach says nothing."""
    remote = parse_url("redis://10.0.0.5:6379/0")
    said = advertised_beyond_reach("127.0.0.1", remote)
    assert "127.0.0.1" in said and "10.0.0.5" in said and "--advertise-addr" in said
    assert advertised_beyond_reach("localhost", parse_url("redis+cluster://127.0.0.1:1,r:2"))
    assert advertised_beyond_reach("127.0.0.1", parse_url("redis://127.0.0.1:6379/0")) == ""
    assert advertised_beyond_reach("10.0.0.7", remote) == ""
    assert advertised_beyond_reach("node-7.example", remote) == ""
