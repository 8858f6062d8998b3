"""``kvserver start``'s checks before the arena (kvserver/daemon/preflight.py): a mistake the
daemon would find only after the pre-fault, or once serving, is one line naming its setting,
exit 1, before a byte of ``--dram`` is committed, and nothing is left behind; so is an
arena directory (``--shm-dir``) that cannot take the arena (kvserver/arena.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon import start_daemon
from tests.support.tmpfs import mount_tmpfs, unmount

pytestmark = pytest.mark.multiprocess


def start(shm: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``kvserver start`` on ephemeral ports with a small arena in ``shm``, then ``extra``."""
    shm.mkdir(exist_ok=True)
    cmd = [
        sys.executable, "-m", "kvserver.cli", "start", "--grpc-port", "0", "--zmq-port", "0",
        "--pub-port", "-1", "--metrics-port", "-1", "--dram", "4MiB", "--shm-dir", str(shm),
        *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def refused(result: subprocess.CompletedProcess[str], shm: Path) -> str:
    """The one line of a start refused before the arena (asserted), returned."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "pre-faulting" not in result.stderr  # before the arena
    (line,) = result.stderr.splitlines()
    assert [p.name for p in shm.iterdir() if not p.is_dir()] == []
    return line


def test_a_ready_file_that_cannot_be_written_is_one_line_before_the_arena(tmp_path: Path) -> None:
    """``--ready-file`` in a directory that does not exist: the daemon started, served, then
    failed writing it with a 40-line traceback and stopped."""
    ready = tmp_path / "missing" / "ready.json"
    line = refused(start(tmp_path / "shm", "--ready-file", str(ready)), tmp_path / "shm")
    expected = f"kvserver start: error: cannot write --ready-file {ready}: No such file"
    assert line.startswith(expected)
    assert "its directory must exist and be writable" in line
    assert not (tmp_path / "missing").exists()


def test_a_ready_file_that_is_a_directory_is_one_line_before_the_arena(tmp_path: Path) -> None:
    """The probe beside it passed; the rename over the directory failed once serving."""
    line = refused(start(tmp_path / "shm", "--ready-file", str(tmp_path)), tmp_path / "shm")
    assert line == (
        f"kvserver start: error: cannot write --ready-file {tmp_path}: it is a directory; "
        "name a file"
    )


def test_the_ready_file_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    """The probe file beside the ready file is removed before the daemon serves."""
    d = start_daemon(tmp_path, "--dram", "4MiB", "--shm-dir", str(tmp_path))
    try:
        assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []
    finally:
        assert d.terminate() == 0, d.log()


def test_a_missing_curve_key_file_is_one_line_before_the_arena(tmp_path: Path) -> None:
    """It was read after the pre-fault: ``--dram 64GiB`` committed 64 GiB before being told."""
    key = tmp_path / "server.key_secret"
    line = refused(start(tmp_path / "shm", "--curve-secret-key-file", str(key)), tmp_path / "shm")
    assert line.startswith(f"kvserver start: error: cannot read CURVE key file {key}"), line


def test_a_host_that_is_not_this_machines_is_one_line_before_the_arena(tmp_path: Path) -> None:
    """With ephemeral ports the port probe binds nothing: the ZMQ bind found it, after the
    pre-fault."""
    shm = tmp_path / "shm"
    line = refused(start(shm, "--host", "192.0.2.1", "--insecure-remote"), shm)  # TEST-NET-1
    assert line.startswith("kvserver start: error: cannot bind 192.0.2.1: Cannot assign"), line
    assert "check --host (an address of this machine" in line


def test_a_shm_dir_that_is_a_file_is_called_so(tmp_path: Path) -> None:
    """``--shm-dir`` naming a file was said not to exist (errno 2)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    afile = tmp_path / "a-file"
    afile.touch()
    line = refused(start(shm, "--shm-dir", str(afile)), shm)
    assert line == (
        f"kvserver start: error: the arena's directory {afile} is not a directory: give another "
        "--shm-dir (errno=20)"
    )


def test_a_read_only_shm_dir_names_the_setting(tmp_path: Path) -> None:
    """A read-only tmpfs (a container's /dev/shm mounted so) said "cannot create arena:
    Read-only file system (path=.../kvserver-PID-HEX)": no word of the directory's setting."""
    ro = tmp_path / "ro"
    if not mount_tmpfs(ro, "4m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, timeout=30)
        result = start(tmp_path / "shm", "--shm-dir", str(ro))
    finally:
        unmount(ro)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(
        f"kvserver start: error: cannot create the arena in {ro}: Read-only file system; give a "
        "directory this user may write (a tmpfs) with --shm-dir"
    ), last


def test_localhost_resolving_to_an_ipv6_address_first_is_no_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a host without IPv6, ``localhost`` resolves to ``::1`` first (/etc/hosts) and the
    probe's bind fails (EADDRNOTAVAIL) where the listeners bind 127.0.0.1: the port probe
    refused the start ("cannot bind localhost:9470: Cannot assign requested address"). The
    resolver's answer is the one thing faked (this host has IPv6); an address the probe
    cannot bind stands for the missing ``::1``; a port taken on 127.0.0.1 is still said."""
    import socket

    from kvserver.daemon import listening, preflight
    from kvserver.daemon.config import DaemonConfig
    from kvserver.errors import KVServerError
    from tests.support.ports import free_port

    def resolve(host: str, port: int, *args: object, **kwargs: object) -> list[object]:
        assert host == "localhost"
        tcp = (socket.SOCK_STREAM, socket.IPPROTO_TCP, "")
        return [(socket.AF_INET6, *tcp, ("2001:db8::1", port, 0, 0)),
                (socket.AF_INET, *tcp, ("127.0.0.1", port))]  # fmt: skip

    monkeypatch.setattr(listening.socket, "getaddrinfo", resolve)
    monkeypatch.setattr(preflight.socket, "getaddrinfo", resolve)
    config = DaemonConfig(host="localhost", grpc_port=free_port(), zmq_port=0, pub_port=-1,
                          metrics_port=-1, peer_stream_port=-1)  # fmt: skip
    preflight.preflight(config)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", config.grpc_port))
        taken.listen()
        with pytest.raises(KVServerError, match=f"cannot bind localhost:{config.grpc_port}: "
                           "Address already in use; .* --grpc-port PORT"):  # fmt: skip
            preflight.preflight(config)
