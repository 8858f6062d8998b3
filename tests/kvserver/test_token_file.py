"""The default token's files: private directory and files, loopback addresses only, a new
token picked up when the file is replaced."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvserver.errors import KVServerError
from kvserver.token_file import TokenFile, remove_token_files, token_dir, write_token_files


def test_written_private_and_read_by_port(tmp_path: Path) -> None:
    paths = write_token_files("t0k3n", [9471, 9470], str(tmp_path))
    assert stat.S_IMODE(os.stat(token_dir(str(tmp_path))).st_mode) == 0o700
    for path in paths:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for address in ("tcp://127.0.0.1:9471", "127.0.0.1:9470", "localhost:9470", "[::1]:9471"):
        assert TokenFile(address, str(tmp_path)).token() == "t0k3n"
    remove_token_files(paths)
    assert TokenFile("127.0.0.1:9470", str(tmp_path)).token() == ""


@pytest.mark.parametrize(
    "address", ["tcp://10.0.0.5:9471", "kv-host:9470", "ipc:///tmp/x", "tcp://0.0.0.0:9471"]
)
def test_never_looked_up_for_another_host(tmp_path: Path, address: str) -> None:
    """A token of this host is never sent elsewhere (same port, other host)."""
    write_token_files("t0k3n", [9471, 9470], str(tmp_path))
    assert TokenFile(address, str(tmp_path)).path is None
    assert TokenFile(address, str(tmp_path)).token() == ""


def test_a_replaced_file_is_read_again(tmp_path: Path) -> None:
    """A restarted daemon writes a new token: the same TokenFile returns it."""
    write_token_files("first", [9471], str(tmp_path))
    source = TokenFile("tcp://127.0.0.1:9471", str(tmp_path))
    assert source.token() == "first"
    write_token_files("second", [9471], str(tmp_path))
    assert source.token() == "second"


def test_a_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    directory = Path(token_dir(str(tmp_path)))
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    with pytest.raises(KVServerError, match="not a private directory"):
        write_token_files("t0k3n", [9471], str(tmp_path))
