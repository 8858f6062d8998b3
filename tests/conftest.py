"""Suite-wide set-up: the ``kvserver.commands`` entry points (tests/support/entry_points.py),
and the real redis-server fixtures (tests/support/redis.py) of the fleet tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.entry_points import declare_commands
from tests.support.redis import RedisServer, require_redis

declare_commands()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (skips, saying why, when it is not installed)."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server shared by the tests of one module."""
    require_redis()
    server = RedisServer.start(Path(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()
