"""deploy/run-local.sh run for real up to its first step: its keys script needs the
``cryptography`` package (``kvserver keys tls``, the ``tls`` extra), checked before anything is
made or started, and a failed key command stops the script there (docs/deploy.md, "Without
Docker").

The kvserver command is this tree's (``KVSERVER_CMD``: this interpreter ``-m kvserver.cli``);
a Python without the package is this one with a stand-in ``cryptography`` module first on
``PYTHONPATH`` whose import fails, as it does where the package is not installed. The script
runs in a session of its own, so what it leaves running is what runs in that session.

And as a user runs it after ``pip install -e .``: ``kvserver`` on PATH (a wrapper that runs the
program as its child, as a pyenv shim does), no ``KVSERVER_CMD``, up to the daemon, then
Ctrl-C (SIGINT to the script alone: the services run in process groups of their own).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.arena import pid_alive
from tests.deploy.compose import ROOT, RUN_LOCAL
from tests.support.daemon import wait_until
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


#: a `kvserver` that runs the program as its child, as pyenv's shims do (not `exec`): a TERM
#: kills the wrapper and not the program
WRAPPER = '#!/usr/bin/env bash\n"{python}" -m kvserver.cli "$@"\n'


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return not pid_alive(pid)


def _user_env(tmp_path: Path) -> dict[str, str]:
    """The script's environment: `kvserver` on PATH (:data:`WRAPPER`, this tree), free ports,
    its temporary directory made in ``tmp_path``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "kvserver"
    wrapper.write_text(WRAPPER.format(python=sys.executable))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k not in ("KVSERVER_CMD", "KVSERVER_LOCAL_DIR")}
    env.update({var: str(free_port()) for var in PORTS})
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", TMPDIR=str(tmp_path))
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_ctrl_c_stops_every_program_a_wrapper_on_path_started(tmp_path: Path) -> None:
    """Was: with `kvserver` on PATH the keys step called its own shell function again and
    again until bash crashed ("Segmentation fault", no keys, exit 0); past that, Ctrl-C sent
    TERM to the wrappers only: the daemon kept running on its ports and its SSD directory was
    removed under it, and the script exited 143."""
    env = _user_env(tmp_path)
    script = subprocess.Popen(
        ["bash", str(RUN_LOCAL)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    daemon_pid = 0
    try:
        ready = wait_until(
            lambda: (
                script.poll() is not None or list(tmp_path.glob("kvserver-local.*/kvserver.ready"))
            ),
            timeout=120,
        )
        assert script.poll() is None, script.communicate()
        info = json.loads(ready[0].read_text())
        daemon_pid = info["pid"]
        script.send_signal(signal.SIGINT)  # a terminal's Ctrl-C: the script's group only
        _, err = script.communicate(timeout=120)
        assert script.returncode == 0, err
        assert "stopping the cluster" in err
        assert _zombie_or_gone(daemon_pid), f"the daemon {daemon_pid} still runs"
        assert in_session(script.pid) == [], "run-local.sh left processes running"
        assert not Path(info["arena_path"]).exists()  # it stopped in order
        assert not list(tmp_path.glob("kvserver-local.*"))  # the script's directory is removed
    finally:
        if script.poll() is None:
            script.kill()
            script.communicate()
        if daemon_pid and not _zombie_or_gone(daemon_pid):
            os.kill(daemon_pid, signal.SIGTERM)
