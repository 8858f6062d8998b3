"""deploy/run-local.sh run for real up to its first step: its keys script needs the
``cryptography`` package (``kvserver keys tls``, the ``tls`` extra), checked before anything is
made or started, and a failed key command stops the script there (docs/deploy.md, "Without
Docker").

The kvserver command is this tree's (``KVSERVER_CMD``: this interpreter ``-m kvserver.cli``);
a Python without the package is this one with a stand-in ``cryptography`` module first on
``PYTHONPATH`` whose import fails, as it does where the package is not installed. The script
runs in a session of its own, so what it leaves running is what runs in that session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.compose import ROOT, RUN_LOCAL
from tests.support.ports import free_port

pytestmark = pytest.mark.multiprocess

#: the script's local ports (docs/deploy.md): each a free one, should it start something
PORTS = ("KVSERVER_GRPC", "KVSERVER_ZMQ", "KVSERVER_PUB", "KVSERVER_METRICS", "WORKER0_LISTEN",
         "WORKER1_LISTEN", "DIST_INIT", "SCHEDULER_GRPC", "SCHEDULER_METRICS")  # fmt: skip


def in_session(sid: int) -> list[int]:
    """The running processes of session ``sid`` (``/proc/*/stat``'s session field)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # the fields follow the last ")": state, ppid, pgrp, session
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def run_local(tmp_path: Path, *, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    """Run the script (its files in ``tmp_path/local``, its temporary files in
    ``tmp_path/tmp``) and check it left no process running."""
    (tmp_path / "tmp").mkdir()
    env = {
        **os.environ,
        **{name: str(free_port()) for name in PORTS},
        "KVSERVER_CMD": f"{sys.executable} -m kvserver.cli",
        "KVSERVER_LOCAL_DIR": str(tmp_path / "local"),
        "TMPDIR": str(tmp_path / "tmp"),
        "PYTHONPATH": os.pathsep.join(str(p) for p in (*pythonpath, ROOT)),
    }
    proc = subprocess.Popen(["bash", str(RUN_LOCAL)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert in_session(proc.pid) == [], "run-local.sh left processes running"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_without_cryptography_it_says_so_in_one_line_before_making_or_starting_anything(
    tmp_path: Path,
) -> None:
    """Before: the keys step went on past its failed ``kvserver keys tls`` (its ``set -e``
    ignored: the next test's fault) and the daemon was started, to fail for want of its
    certificate (exit 1, "kvserver did not start" and its log)."""
    stub = tmp_path / "no-cryptography"
    stub.mkdir()
    (stub / "cryptography.py").write_text(
        "raise ImportError(\"No module named 'cryptography' (a test's stand-in)\")\n"
    )
    result = run_local(tmp_path, pythonpath=[stub])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("run-local.sh: error: "), line
    assert "'cryptography' package" in line and "'.[torch,tls]'" in line, line
    assert result.stdout == ""
    assert not (tmp_path / "local" / "keys").exists()  # no key was made
    assert list((tmp_path / "tmp").iterdir()) == []  # its throwaway check left nothing


def test_with_cryptography_it_goes_on_to_the_keys_step_whose_failure_stops_it(
    tmp_path: Path,
) -> None:
    """The check passes where the package imports: the script goes on to its keys step, made
    to fail here (its keys directory a file), which stops it at its first failed command,
    exit status 1, nothing started. Before: the steps after the failed one ran anyway (bash
    ignores ``set -e`` inside a command ``if`` tests) and the script exited 0 (its exit trap
    exited with the services' status: none, 0)."""
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "keys").write_text("not a directory\n")
    result = run_local(tmp_path, pythonpath=[])
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("making the keys failed"), result.stderr
    assert lines[1:] == [
        f"kvserver keys: error: {tmp_path / 'local' / 'keys'} is a file, not a directory",
        "stopping the cluster",
    ]
    assert list((tmp_path / "tmp").iterdir()) == []
