"""The tests' import point for ``benchmarks.harness.redis`` (real redis-server processes and
a Redis Cluster on loopback), plus :func:`require_redis`."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.harness.redis import RedisCluster as RedisCluster
from benchmarks.harness.redis import RedisServer as RedisServer


def require_redis() -> None:
    """Skip (saying why) where redis-server / redis-cli are missing; CI installs them."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (apt-get install redis-server)")
