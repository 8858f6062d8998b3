"""``max_lease_s`` (``--max-lease-s``, ``KVSERVER_MAX_LEASE_S``, ``max_lease_s`` in the config
file): the longest lease a client may ask of a real daemon, and of the daemon's own pins.

Before, it was the engine's constant 600 s, which no operator could change. A lease longer
than the running daemon's max is refused ``invalid_argument`` naming the max, as one past
600 s always was (``tests/kvserver/test_engine.py`` ``test_bad_lease_durations``, the engine
alone); the stream put's payload bound (half of it) follows it; a bad value, or one the
default lease or the ZMQ send timeout contradicts, is one ``error:`` line and exit status 2
before any start-up work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.client import AsyncKVClient, KVClient
from kvserver.errors import InvalidArgument
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.daemon.stream_conn import RawStream
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

TOKEN = "max-lease-token-0123456789abcdef"
SPEC = make_spec(model="test/max-lease", part_bytes_override=64 << 10)
MAX_LEASE_S = 4.0


def start(tmp_path: Path, source: str) -> DaemonProc:
    """A daemon whose max lease is MAX_LEASE_S, given by ``source`` (flag, env or file)."""
    args = ["--dram", "8MiB", "--auth-token", TOKEN, "--default-lease-s", "1",
            "--shm-dir", str(tmp_path)]  # fmt: skip
    value = f"{MAX_LEASE_S:g}"
    if source == "flag":
        return start_daemon(tmp_path, *args, "--max-lease-s", value)
    if source == "env":
        return start_daemon(tmp_path, *args, env={"KVSERVER_MAX_LEASE_S": value})
    config = tmp_path / "kvserver.toml"
    config.write_text(f"max_lease_s = {value}\n")
    return start_daemon(tmp_path, *args, "--config", str(config))


@pytest.fixture(params=["flag", "env", "file"])
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProc]:
    d = start(tmp_path, request.param)
    try:
        yield d
    finally:
        assert d.terminate() == 0, d.log()


@pytest.mark.parametrize("call", ["prepare_store", "prepare_load"])
def test_a_lease_longer_than_the_daemons_max_is_refused_and_its_max_granted(
    daemon: DaemonProc, call: str
) -> None:
    """The max is granted (the grant expires within it), a little more refused naming the
    daemon's max, nothing reserved or pinned by the refusal."""
    with KVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN) as kv:
        ns = kv.register_namespace(SPEC)
        stored = make_keys(1, tag="ready")
        assert kv.put(ns.ns_id, stored, [[pattern(stored[0], 0, SPEC.part_bytes)]]).stored
        keys = stored if call == "prepare_load" else make_keys(1, tag="new")
        for too_long in (MAX_LEASE_S + 0.5, 600.0):
            with pytest.raises(InvalidArgument, match="lease duration out of range") as refused:
                getattr(kv, call)(ns.ns_id, keys, lease_s=too_long)
            assert f"max_lease_s={MAX_LEASE_S}" in str(refused.value)
        stats = kv.stats()
        assert stats["reserved_pages"] == 0 and stats["num_leases"] == 0
        grant = getattr(kv, call)(ns.ns_id, keys, lease_s=MAX_LEASE_S)
        assert 0 < grant.deadline - time.monotonic() <= MAX_LEASE_S
        assert kv.stats()["num_leases"] == 1


async def test_hello_announces_the_daemons_max_lease_and_the_clients_show_it(
    daemon: DaemonProc,
) -> None:
    """``hello``'s ``max_lease_s`` is the operator's value (flag, env or file), and both
    clients expose it as ``max_lease_s`` once they have said hello (None before: unknown).
    Before, a client learnt it only from a refusal."""
    with KVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN) as kv:
        assert kv.max_lease_s is None
        assert kv.hello()["max_lease_s"] == MAX_LEASE_S
        assert kv.max_lease_s == MAX_LEASE_S
    async with AsyncKVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN) as akv:
        assert akv.max_lease_s is None
        await akv.stats()  # the session's hello comes first
        assert akv.max_lease_s == MAX_LEASE_S


def test_a_stream_put_must_arrive_within_half_the_daemons_max_lease(tmp_path: Path) -> None:
    """A put whose payload arrives steadily but slowly (64 KiB every 0.3 s, 1 MiB in ~5 s;
    with the default 600 s max it is taken: ``test_stream_ops_hostile``
    ``test_a_put_arriving_slowly_but_steadily_is_taken``) is cut once half of a 4 s max has
    passed, its reservation rolled back: the bound is the running daemon's, not 600 s / 2."""
    daemon = start(tmp_path, "flag")
    try:
        with KVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN) as kv:
            ns = kv.register_namespace(SPEC)
        keys = make_keys(16, tag="slow")
        body = b"".join(pattern(k, 0, SPEC.part_bytes) for k in keys)
        started = time.monotonic()
        with RawStream(daemon, TOKEN) as raw:
            raw.op(1, "put", {"ns_id": ns.ns_id, "keys": keys}, b"", announced=len(body))
            try:
                for i in range(0, len(body), 64 << 10):
                    raw.sock.sendall(body[i : i + (64 << 10)])
                    time.sleep(0.3)  # the link's pace, not a synchronisation
            except OSError:  # the daemon cut it mid-payload (reset)
                pass
            assert raw.closed()
        assert time.monotonic() - started >= MAX_LEASE_S / 2
        with KVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN) as kv:
            wait_until(lambda: kv.stats()["reserved_pages"] == 0, timeout=30)
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 0
    finally:
        assert daemon.terminate() == 0, daemon.log()


def start_cmd(shm: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kvserver.cli", "start", "--grpc-port", "0", "--zmq-port", "0",
        "--pub-port", "-1", "--metrics-port", "-1", "--dram", "4MiB", "--shm-dir", str(shm),
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (("--max-lease-s", "0"), {}, "max_lease_s must be positive and at most 86400 (a day)"),
        (("--max-lease-s", "-5"), {}, "max_lease_s must be positive and at most 86400"),
        (("--max-lease-s", "nan"), {}, "config max_lease_s must be a number, got nan"),
        (("--max-lease-s", "inf"), {}, "config max_lease_s must be a number, got inf"),
        (("--max-lease-s", "1e9"), {}, "max_lease_s must be positive and at most 86400"),
        ((), {"KVSERVER_MAX_LEASE_S": "0"}, "max_lease_s must be positive and at most 86400"),
        # the default lease (30 s) longer than the max
        (
            ("--max-lease-s", "20"),
            {},
            "default_lease_s (30 s) is longer than max_lease_s (20 s): lower --default-lease-s "
            "or raise --max-lease-s",
        ),
        # a ZMQ send timeout the send pins' lease would not outlive
        (
            ("--max-lease-s", "100"),
            {"KVSERVER_ZMQ_SEND_TIMEOUT_S": "60"},
            "zmq_send_timeout_s must be in [0, 50], at most half the longest lease (0: the "
            "default, 60 s or that half when less)",
        ),
    ],
)
def test_a_bad_max_lease_is_one_error_line_and_exit_2_before_start_up(
    tmp_path: Path, flags: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    result = subprocess.run(start_cmd(tmp_path, *flags), capture_output=True, text=True,
                            timeout=60, env={**os.environ, **env})  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"kvserver start: error: {message}"), line
    assert list(tmp_path.iterdir()) == []  # no arena was created


def test_a_bad_max_lease_in_the_config_file_is_refused_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "kvserver.toml"
    config.write_text("max_lease_s = 0.0\n")
    result = subprocess.run(start_cmd(tmp_path / "shm", "--config", str(config)),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("kvserver start: error: max_lease_s must be positive")
