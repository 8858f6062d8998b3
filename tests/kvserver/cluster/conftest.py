from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis import RedisServer, require_redis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    yield server
    server.stop()
