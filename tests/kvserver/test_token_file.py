"""The default token's files: private directory and files, loopback addresses only, a new
token picked up when the file is replaced. Token files of one's own (``--auth-token-file``,
``kvserver keys token``): private, checked, read by the daemon and by clients."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument, KVServerError
from kvserver.token_file import (
    TokenFile,
    client_auth_token,
    make_token_file,
    read_token_file,
    reap_stale_token_files,
    token_dir,
    token_path,
    write_token_files,
)


def test_written_private_and_read_by_port(tmp_path: Path) -> None:
    files = write_token_files("t0k3n", [9471, 9470], str(tmp_path))
    assert stat.S_IMODE(os.stat(token_dir(str(tmp_path))).st_mode) == 0o700
    for path in files.paths:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for address in ("tcp://127.0.0.1:9471", "127.0.0.1:9470", "localhost:9470", "[::1]:9471"):
        assert TokenFile(address, str(tmp_path)).token() == "t0k3n"
    files.close()
    assert os.listdir(token_dir(str(tmp_path))) == []
    assert TokenFile("127.0.0.1:9470", str(tmp_path)).token() == ""


@pytest.mark.parametrize(
    "address", ["tcp://10.0.0.5:9471", "kv-host:9470", "ipc:///tmp/x", "tcp://0.0.0.0:9471"]
)
def test_never_looked_up_for_another_host(tmp_path: Path, address: str) -> None:
    """A token of this host is never sent elsewhere (same port, other host)."""
    write_token_files("t0k3n", [9471, 9470], str(tmp_path))
    assert TokenFile(address, str(tmp_path)).path is None
    assert TokenFile(address, str(tmp_path)).token() == ""


def test_a_replaced_file_is_read_again_on_reload(tmp_path: Path) -> None:
    """A restarted daemon writes a new token: the same TokenFile returns it once reloaded (a
    client reloads at connect and after a refusal), the old one until then (no system call
    per request)."""
    first = write_token_files("first", [9471], str(tmp_path))
    source = TokenFile("tcp://127.0.0.1:9471", str(tmp_path))
    assert source.token() == "first"
    first.close()
    second = write_token_files("second", [9471], str(tmp_path))
    assert source.token() == "first"
    assert source.reload() == "second" == source.token()
    second.close()
    assert source.reload() == "" == source.token()


def test_a_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    directory = Path(token_dir(str(tmp_path)))
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    with pytest.raises(KVServerError, match="not a private directory"):
        write_token_files("t0k3n", [9471], str(tmp_path))


# ------------------------------------------------------------------ files of killed servers


@pytest.fixture
def unused_port() -> Iterator[int]:
    """A loopback port bound (so no one else takes it) but listened on by no one."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def write_and_die(shm_dir: Path, port: int) -> str:
    """The token file a real server process wrote for ``port`` before it was SIGKILLed."""
    code = (
        "import sys; from kvserver.token_file import write_token_files\n"
        f"files = write_token_files('t0k3n-of-a-dead-one', [{port}], {str(shm_dir)!r})\n"
        "print(files.paths[0], flush=True); sys.stdin.read()"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        path = proc.stdout.readline().strip()
        proc.send_signal(signal.SIGKILL)
    assert os.path.exists(path)
    return path


def test_the_file_of_a_killed_server_is_reaped(tmp_path: Path, unused_port: int) -> None:
    """A server SIGKILLed leaves its file; the next start removes it, and only it."""
    path = write_and_die(tmp_path, unused_port)
    others = [Path(token_dir(str(tmp_path))) / name for name in ("notes", "port-x.token")]
    for other in others:
        other.write_text("kept")
    assert reap_stale_token_files(str(tmp_path)) == [path]
    assert not os.path.exists(path)
    assert all(other.exists() for other in others)


def test_the_file_of_a_running_server_is_kept(tmp_path: Path, unused_port: int) -> None:
    """Its writer holds the lock while it runs (even when its port looks free)."""
    files = write_token_files("t0k3n", [unused_port], str(tmp_path))
    assert reap_stale_token_files(str(tmp_path)) == []
    assert TokenFile(f"127.0.0.1:{unused_port}", str(tmp_path)).token() == "t0k3n"
    files.close()


def test_an_unlocked_file_of_a_listening_port_is_kept(tmp_path: Path) -> None:
    """A server that predates the lock still owns the file of the port it listens on."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    path = Path(token_dir(str(tmp_path))) / f"port-{port}.token"
    path.parent.mkdir(mode=0o700)
    path.write_text("t0k3n")  # as written before the lock: nobody holds one
    try:
        assert reap_stale_token_files(str(tmp_path)) == []
    finally:
        listener.close()
    assert reap_stale_token_files(str(tmp_path)) == [token_path(port, str(tmp_path))]
    assert not path.exists()


def test_the_tests_run_in_a_shm_dir_of_their_own() -> None:
    """tests/support/shm.py: what the session's processes leave goes with its directory."""
    session = os.environ["KVSERVER_SHM_DIR"]
    assert os.path.basename(session).startswith(f"kvserver-tests-{os.getpid()}-")
    assert os.path.isdir(session) and token_dir().startswith(session)


# ----------------------------------------------------------------------------- token files


def test_keys_token_makes_a_private_random_token_and_never_overwrites(tmp_path: Path) -> None:
    """``kvserver keys token DIR`` (docs/security.md): NAME.token, 0600, a fresh token."""
    run = [sys.executable, "-m", "kvserver.cli", "keys", "token"]
    out = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert path == str(tmp_path / "auth.token")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token = read_token_file(path)
    assert len(token) >= 32
    again = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    assert read_token_file(path) == token
    other = make_token_file(str(tmp_path), "router")
    assert read_token_file(other) != token


@pytest.mark.parametrize(
    ("content", "mode", "error"),
    [
        ("a-long-enough-token-0123", 0o604, "accessible to other users"),
        ("short", 0o600, "shorter than 16"),
        (b"\xff" * 20, 0o600, "not text"),
        ("x" * 5000, 0o600, "too large"),
    ],
)
def test_a_bad_token_file_is_refused_naming_it(
    tmp_path: Path, content: str | bytes, mode: int, error: str
) -> None:
    path = tmp_path / "t.token"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    path.chmod(mode)
    with pytest.raises(InvalidArgument, match=error) as info:
        read_token_file(str(path), "auth_token_file")
    assert str(path) in str(info.value) and str(info.value).startswith("auth_token_file: ")
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_token_file(str(tmp_path / "missing"))


#: what a `kvserver start` refused at once would have started with: ports of its own, an arena
#: in the test's directory (the last argument)
START_ALONE = ("--grpc-port", "0", "--zmq-port", "0", "--pub-port", "-1", "--metrics-port", "-1",
               "--shm-dir")  # fmt: skip


@pytest.mark.parametrize("command", ["status", "start"])
def test_a_missing_or_empty_token_file_is_one_line_saying_so(tmp_path: Path, command: str) -> None:
    """Were: "cannot read token file PATH: [Errno 2] No such file or directory: 'PATH'" (the
    path twice) and, for an empty file, "the token in PATH is shorter than 16 characters"."""
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    empty.chmod(0o600)
    missing = tmp_path / "missing.token"
    for path, said in ((missing, "cannot read token file {}: No such file or directory"),
                       (empty, "token file {} is empty")):  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "kvserver.cli", command, "--auth-token-file", str(path),
             *((*START_ALONE, str(tmp_path)) if command == "start" else ())],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [
            f"kvserver {command}: error: auth_token_file: {said.format(path)}"
        ]


def test_a_client_takes_the_token_file_over_the_token(tmp_path: Path) -> None:
    path = make_token_file(str(tmp_path))
    assert client_auth_token(Namespace(auth_token="flag-token", auth_token_file=path)) == (
        read_token_file(path)
    )
    assert client_auth_token(Namespace(auth_token="flag-token", auth_token_file="")) == "flag-token"
    assert client_auth_token(Namespace()) == ""


def test_the_daemon_reads_its_token_from_a_file_and_excludes_a_second_source(
    tmp_path: Path,
) -> None:
    path = make_token_file(str(tmp_path))
    cfg = DaemonConfig.load(env={}, overrides={"auth_token_file": path})
    assert cfg.auth_token == read_token_file(path) and cfg.auth_token_file == path
    env = {"KVSERVER_AUTH_TOKEN_FILE": path}
    assert DaemonConfig.load(env=env).auth_token == cfg.auth_token
    for other in ({"auth_token": "x" * 20}, {"no_auth": True}):
        with pytest.raises(InvalidArgument, match="auth_token_file excludes"):
            DaemonConfig.load(env={}, overrides={"auth_token_file": path, **other})
    assert cfg.replace(dram=1 << 20).auth_token == cfg.auth_token


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "command",
    [
        ["start", "--dram", "64MiB", "--zmq-port", "0", "--grpc-port", "0", "--pub-port", "-1",
         "--metrics-port", "-1", "--auth-token-file"],
        ["scheduler", "--synthetic-workers", "1", "--grpc-port", "0", "--metrics-port", "-1",
         "--engine-auth-token-file"],
    ],
    ids=["daemon", "scheduler"],
)  # fmt: skip
def test_a_token_file_that_never_ends_is_refused_not_waited_on_for_ever(
    tmp_path: Path, command: list[str]
) -> None:
    """A FIFO nobody writes as the token file (a mistyped path, a pipe whose writer died).
    Before: ``open`` waited for a writer for ever, and SIGTERM did not end the wait (Python
    retries an interrupted ``open`` after running its handler): ``kvserver start`` hung."""
    fifo = tmp_path / "token.fifo"
    os.mkfifo(fifo, 0o600)
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", *command, str(fifo)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "KVSERVER_SHM_DIR": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode in (1, 2), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"cannot read token file {fifo}: no end of file within" in last, proc.stderr[-3000:]
