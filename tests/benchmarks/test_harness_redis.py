"""The Redis harness (benchmarks/harness/redis.py) against a real redis-server: a ``redis-cli``
that fails says so, and an unpause is not lost under a pause of every client."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import redis as harness
from tests.support.ports import free_port
from tests.support.redis import RedisServer, require_redis


def test_a_redis_cli_that_cannot_reach_its_server_raises_saying_why() -> None:
    """Was: "" (redis-cli printed nothing), which a caller parsed as an empty reply (the
    KeyError 'used_memory' of test_redis_memory once)."""
    require_redis()
    with pytest.raises(harness.RedisCliError, match="Connection refused"):
        harness._cli(free_port(), "INFO", "memory")  # nobody listens there


def test_an_unpause_under_a_pause_of_every_client_waits_for_the_pause_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under CLIENT PAUSE ... ALL the server postpones the CLIENT UNPAUSE itself until the
    pause ends (Redis 7.0.15 and Valkey 9.1 alike: 3.0 s after a 3 s pause). The harness's
    unpause got a fixed redis-cli timeout, which a pause longer than it (or a loaded machine)
    outlasted: TimeoutExpired, the unpause lost. Its timeout now adds what is left of the
    pause (here: 3 s of redis-cli timeout under a 6 s pause)."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    try:
        monkeypatch.setattr(harness, "CLI_TIMEOUT_S", 3.0)
        with server.paused(6000, "ALL"):
            pass
        assert server.cli("PING", timeout=30.0) == "PONG"
    finally:
        server.stop()
