"""Suite-wide set-up: the ``kvserver.commands`` entry points (tests/support/entry_points.py),
the session's own shared-memory directory for arenas and token files (tests/support/shm.py),
the real redis-server fixtures (tests/support/redis.py) of the fleet tests, the check that
no test module leaves a process running (tests/support/leaks.py), and the watchdog behind each
test's bound (tests/support/timeouts.py; the bound itself is pytest-timeout's, pyproject.toml)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from benchmarks.harness.proc import STARTED
from tests.support.entry_points import declare_commands
from tests.support.leaks import stop_leftovers
from tests.support.redis import (
    FLEET_CLIENTS,
    FLEET_SERVERS,
    RedisServer,
    client_url,
    require_client,
    require_redis,
    server_binary,
)
from tests.support.shm import SessionDir

declare_commands()

_session_dir: SessionDir | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _session_dir
    _session_dir = SessionDir()
    config.pluginmanager.import_plugin("tests.support.timeouts")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _session_dir
    if _session_dir is not None:
        _session_dir.close()
        _session_dir = None


_LOG_TAIL_LINES = 40
_FIRST_STARTED = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_FIRST_STARTED] = len(STARTED)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the last lines of every daemon, scheduler or worker log
    it started (benchmarks/harness/proc.py): a process that died or stalled says why there,
    which the client's error alone cannot (a CI failure is often read from its output only)."""
    report = yield
    if report.failed:
        for name, pid, log_path in STARTED[item.stash.get(_FIRST_STARTED, len(STARTED)) :]:
            try:
                lines = log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
            except OSError as exc:
                lines = [f"(log unreadable: {exc})"]
            report.sections.append((f"log of {name} (pid {pid}), last lines", "\n".join(lines)))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last teardown: its processes still running are stopped, and that
    test errors naming them (a daemon left running slows or disturbs every later test)."""
    result = yield
    module = getattr(item, "module", None)
    if nextitem is not None and getattr(nextitem, "module", None) is module:
        return result
    left = stop_leftovers()
    if left:
        named = "; ".join(f"pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        where = getattr(module, "__name__", item.nodeid)
        raise AssertionError(f"{where} left processes running: {named}")
    return result


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (skips, saying why, when it is not installed)."""
    require_redis()
    server = RedisServer.start(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(params=FLEET_SERVERS)
def fleet_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    """The fleet state's server, once per kind: Redis, then Valkey (the same protocol; each
    skips, saying why, where it is not installed). For the fleet tests that must hold on both:
    membership and index (tests/kvserver/cluster/test_node.py) and daemons fetching from each
    other (tests/kvserver/daemon/peers/test_fleet.py, tests/test_e2e_peers.py)."""
    server = RedisServer.start(tmp_path / request.param, binary=server_binary(request.param))
    assert (request.param == "valkey") == ("valkey_version" in server.cli("INFO", "server"))
    yield server
    server.stop()


@pytest.fixture(params=FLEET_CLIENTS, ids=[f"{c}-py" for c in FLEET_CLIENTS])
def fleet_client(request: pytest.FixtureRequest) -> str:
    """The client library the fleet state is reached through, once per kind: ``redis``
    (redis-py, ``redis://``) then ``valkey`` (``valkey://``); each skips where not installed."""
    client: str = request.param
    require_client(client)
    return client


@pytest.fixture
def fleet_url(fleet_server: RedisServer, fleet_client: str) -> str:
    """``fleet_server``'s URL through ``fleet_client``: every pairing of server and client."""
    return client_url(fleet_server.url, fleet_client)


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server shared by the tests of one module."""
    require_redis()
    server = RedisServer.start(Path(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()
