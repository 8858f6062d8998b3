"""The Redis reference of ``kvserver bench`` (benchmarks/daemon_redis.py).

The end-to-end test needs ``redis-server`` and the ``redis`` package (the ``bench`` extra) and is
skipped without them; the arithmetic around it is covered by test_daemon_report.py, and the skip
path by :func:`test_unavailable_names_the_missing_binary` and test_bench.py. Nothing is timed.
"""

from __future__ import annotations

import importlib
import signal
from pathlib import Path

import pytest

from benchmarks.daemon_redis import MAXMEMORY_HEADROOM, MODES, RedisRef, redis_unavailable

WHY_NOT = redis_unavailable()


def test_unavailable_names_the_missing_binary(tmp_path: Path) -> None:
    why = redis_unavailable(str(tmp_path / "redis-server"))
    assert why is not None and str(tmp_path / "redis-server") in why and "apt-get" in why


def test_unavailable_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_redis(name: str, package: str | None = None) -> object:
        if name == "redis":
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_redis)
    why = redis_unavailable("sh")  # any binary on PATH: only the package is missing
    assert why is not None and "kvserver[bench]" in why


@pytest.mark.multiprocess
@pytest.mark.skipif(WHY_NOT is not None, reason=f"Redis reference unavailable: {WHY_NOT}")
def test_rounds_round_trip_the_parts_and_close_stops_the_server(tmp_path: Path) -> None:
    """A server with persistence off and room for two batches; a round stores and returns the
    same bytes and leaves nothing behind; close() stops the process."""
    parts = [memoryview(bytes([i]) * 4096) for i in range(5)]
    ref = RedisRef(tmp_path, max_batch_bytes=5 * 4096)
    proc = None
    try:
        ref.start()
        proc = ref._proc
        assert proc is not None and proc.poll() is None
        client = ref._client
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == 2 * 5 * 4096 + (
            MAXMEMORY_HEADROOM
        )
        assert ref.server_version and "parser" in ref.client
        for mode in MODES:
            seconds, values = ref.store_load(parts, mode)
            assert seconds > 0
            assert values == [bytes(part) for part in parts]
            assert client.dbsize() == 0  # the round's keys were deleted
        with pytest.raises(ValueError, match="per-command"):
            ref.store_load(parts, "mset")
    finally:
        ref.close()
    assert proc is not None and proc.returncode in (0, -signal.SIGTERM)
    assert ref._proc is None and ref._client is None
    ref.close()  # idempotent
