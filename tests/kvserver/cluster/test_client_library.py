"""docs/cluster.md, "The client library": the URL scheme picks the library, only that one is
imported, a missing one stops ``kvserver start`` naming its extra, and there is no fall-back
to the other, so a host with only ``valkey`` (no ``redis`` package at all) runs a fleet member.

A library is made missing for a real ``kvserver start`` by a stand-in package of its name,
first on ``PYTHONPATH``, whose import fails (as a host without it fails to import it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.cluster import schema
from tests.kvserver.cluster.test_fleet_daemons import cluster_stats
from tests.support.daemon import start_daemon, wait_until
from tests.support.ports import free_port
from tests.support.redis import RedisServer, client_url, require_client

pytestmark = pytest.mark.multiprocess


def without(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment in which ``import package`` fails."""
    stand_in = tmp_path / "without" / package
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(f"raise ImportError('{package}: not installed here')\n")
    path = [str(stand_in.parent), os.getcwd(), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


@pytest.mark.parametrize(("client", "extra"), [("redis", "cluster"), ("valkey", "valkey")])
def test_a_missing_client_library_stops_kvserver_start_naming_its_extra(
    tmp_path: Path, client: str, extra: str
) -> None:
    """No fall-back to the other library (both are installed here): the start stops at once,
    before the arena is made (``preflight``: exit 1, could not start), naming the package and
    the extra to install."""
    url = f"{client}://127.0.0.1:{free_port()}/0"
    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "start", "--grpc-port", "0", "--zmq-port", "0",
         "--pub-port", "-1", "--metrics-port", "-1", "--dram", "4MiB", "--cluster", url],
        capture_output=True, text=True, timeout=60, env=without(tmp_path, client),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    said = f"needs the {client} package: pip install 'kvserver[{extra}]'"
    assert said in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "pre-faulting the DRAM arena" not in result.stderr, result.stderr  # nothing made


def test_a_member_on_the_valkey_client_needs_no_redis_package(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A daemon whose ``import redis`` fails joins the fleet through ``valkey://``: registered,
    its record in Redis, its stores indexed."""
    require_client("valkey")
    d = start_daemon(
        tmp_path / "d",
        "--dram", "4MiB", "--page-size", "4KiB", "--host-id", "v",
        "--cluster", client_url(redis_server.url, "valkey"), "--cluster-ttl-s", "2",
        env=without(tmp_path, "redis"),
    )  # fmt: skip
    try:
        wait_until(lambda: cluster_stats(d)["condition"] == "ok", timeout=60.0)
        assert redis_server.cli("EXISTS", schema.host_key("v")) == "1"
        assert cluster_stats(d)["url"].startswith("valkey://")
        assert "redis: not installed here" not in d.log()
    finally:
        d.kill()
