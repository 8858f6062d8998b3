"""``kvserver start`` as a newcomer meets it: config errors (an unknown policy too) exit 2
before any start-up work, in one line naming the setting, misspelt KVSERVER_* variables are
warned about, a port in use names the flag that moves it, the start-up line says where the
daemon listens and with what, the arena's pre-fault is announced with progress on a terminal,
and SIGHUP gets the ordered shutdown."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.config_sources import MAX_CONFIG_BYTES, unknown_env
from kvserver.policies import policy_names
from kvserver.token_file import token_path
from tests.support.daemon import start_daemon, wait_for_ready_file
from tests.support.tmpfs import mount_tmpfs, unmount

pytestmark = pytest.mark.multiprocess


def test_an_unknown_policy_exits_2_before_start_up(tmp_path: Path) -> None:
    env = {**os.environ, "KVSERVER_DRAMM": "1GiB", "KVSERVER_SERVER": "x"}
    cmd = [
        sys.executable, "-m", "kvserver.cli", "start", "--policy", "fifo",
        "--shm-dir", str(tmp_path), "--metrics-port", "-1",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    names = ", ".join(policy_names())  # every registered policy, in order
    assert f"unknown eviction policy 'fifo'; choose one of: {names}" in result.stderr
    assert "arc" in names and "lru" in names
    assert "unknown environment variable KVSERVER_DRAMM (did you mean KVSERVER_DRAM?)" in (
        result.stderr
    )
    assert "KVSERVER_SERVER" not in result.stderr  # the CLI's own variable
    assert list(tmp_path.iterdir()) == []  # no arena was created


def test_unknown_env_names_every_typo_and_nothing_else() -> None:
    env = {"KVSERVER_DRAM": "1GiB", "KVSERVER_POLICYY": "lru", "KVSERVER_XYZZY": "1", "HOME": "/",
           "KVSERVER_ENGINE_AUTH_TOKEN_FILE": "f", "KVSERVER_TAIL_PROBE": "p"}  # fmt: skip
    assert unknown_env(env, DaemonConfig.settings()) == [
        "ignoring unknown environment variable KVSERVER_POLICYY (did you mean KVSERVER_POLICY?)",
        "ignoring unknown environment variable KVSERVER_XYZZY",
    ]


def start_cmd(tmp_path: Path, *extra: str) -> list[str]:
    """``kvserver start`` on ephemeral ports, a small arena in ``tmp_path``, then ``extra``."""
    return [
        sys.executable, "-m", "kvserver.cli", "start", "--grpc-port", "0", "--zmq-port", "0",
        "--pub-port", "-1", "--metrics-port", "-1", "--dram", "4MiB", "--shm-dir", str(tmp_path),
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--dram", "-5GiB"), "dram: size must be positive: '-5GiB'"),  # was: "expected one
        # argument", under the whole usage
        (("--dram", "1KiB"), "dram (1024 bytes) is smaller than one page (page_size 65536"),
        (("--log-level", "LOUD"), "log_level must be one of DEBUG, INFO, WARNING"),  # was: ran
        # were: refused by the engine after the pre-fault line, exit 1
        (("--store-threshold", "-3"), "store_threshold must be >= 0 (value=-3)"),
        (("--page-size", "3KiB"), "page_size must be a power of two >= 4096 (value=3072)"),
        # was: served, "metrics not served" in the log (--grpc-port too: the arena made, ZMQ
        # bound, then gRPC's "Failed to bind", exit 1)
        (
            ("--zmq-port", "39777", "--metrics-port", "39777"),
            "zmq_port and metrics_port are the same port; give each its own (value=39777)",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_the_setting_and_exit_2(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    result = subprocess.run(start_cmd(tmp_path, *flags), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"kvserver start: error: {message}"), line
    assert list(tmp_path.iterdir()) == []  # no arena was created


@pytest.mark.parametrize(
    ("variable", "message"),
    [
        ("KVSERVER_EVENT_CAPACITY", "event_capacity must be >= 1"),  # was: exit 1, arena left
        ("KVSERVER_LOCAL_MAX_CONNECTIONS", "local_max_connections must be >= 1"),  # was: served,
        # closing every local connection
        ("KVSERVER_MAX_TRACKER_SIZE", "max_tracker_size must be >= 1"),  # was: after pre-fault
    ],
)
def test_a_count_the_daemon_cannot_use_is_refused_before_start_up(
    tmp_path: Path, variable: str, message: str
) -> None:
    env = {**os.environ, variable: "0"}
    result = subprocess.run(start_cmd(tmp_path), capture_output=True, text=True, timeout=60,
                            env=env)  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line == f"kvserver start: error: {message} (value=0)", line
    assert list(tmp_path.iterdir()) == []  # no arena was created


def test_a_config_file_with_an_unknown_key_or_a_wrong_type_is_one_line(tmp_path: Path) -> None:
    """A misspelt key gets the closest one (was: the bare key); a wrong type names its key
    (a list or a boolean too, which were taken as text or as 1)."""
    for toml, message in (
        ('dramm = "1GiB"\n', "unknown config keys: dramm (did you mean dram?); the keys are"),
        ('grpc_port = "abc"\n', "config grpc_port must be a whole number, got 'abc'"),
        ("grpc_port = 1.5\n", "config grpc_port must be a whole number, got 1.5"),  # was: "a
        # number, got 1.5"
        ("no_auth = 3\n", "config no_auth must be true or false"),
        # were: served, its SSD tier in a directory named "['a']" in the working directory
        ('ssd_dir = ["a"]\n', "config ssd_dir must be a string (quoted in TOML), got ['a']"),
        ("grpc_port = true\n", "config grpc_port must be a whole number, got true"),  # were:
        # port 1, then "got True"
    ):
        config = tmp_path / "kvserver.toml"
        config.write_text(toml)
        cmd = start_cmd(tmp_path / "shm", "--config", str(config))
        cmd.remove("--grpc-port")
        cmd.remove("0")  # the first "0" was --grpc-port's: the file's grpc_port must count
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"kvserver start: error: {message}"), line


@pytest.mark.parametrize(
    ("flag", "given", "said"),
    [
        ("--config", "missing.toml", "cannot read config file {}: No such file or directory"),
        ("--config", "a-dir", "cannot read config file {}: Is a directory"),
        ("--keys-dir", "a-file", "keys_dir: {} is a file, not a directory"),
    ],
)
def test_a_config_file_or_keys_dir_that_cannot_be_used_is_one_line_with_the_reason(
    tmp_path: Path, flag: str, given: str, said: str
) -> None:
    """Were: "...: [Errno 2] No such file or directory: 'PATH'" (the path twice), "[Errno 21]
    Is a directory", and for a keys directory that is a file "keys_dir: cannot make keys in
    PATH: [Errno 17] File exists: 'PATH'"."""
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("")
    path = tmp_path / given
    result = subprocess.run(
        start_cmd(tmp_path / "shm", flag, str(path)), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"kvserver start: error: {said.format(path)}"]
    assert not (tmp_path / "shm").exists()  # nothing was made


@pytest.mark.parametrize("source", ["/dev/zero", "endless fifo", "2 MiB file"])
def test_a_config_file_past_its_size_limit_is_one_line_naming_it_and_the_limit(
    tmp_path: Path, source: str
) -> None:
    """``--config /dev/zero`` (or a FIFO fed without end) was read until memory ran out."""
    feeding = threading.Event()
    writer = None
    if source == "/dev/zero":
        config = source
    elif source == "2 MiB file":
        config = str(tmp_path / "huge.toml")
        Path(config).write_bytes(b"# comment\n" * (200 << 10))
    else:
        config = str(tmp_path / "fifo")
        os.mkfifo(config)

        def feed() -> None:
            with contextlib.suppress(BrokenPipeError), open(config, "wb") as fh:
                while not feeding.is_set():
                    fh.write(b"# more\n" * 4096)

        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
    try:
        result = subprocess.run(
            start_cmd(tmp_path / "shm", "--config", config), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        feeding.set()
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line == (
        f"kvserver start: error: cannot read config file {config}: larger than {MAX_CONFIG_BYTES} "
        "bytes (a config file is a few KiB of TOML)"
    )
    if writer is not None:
        writer.join(60)


@pytest.mark.parametrize("flag", ["--grpc-port", "--zmq-port", "--pub-port", "--peer-stream-port"])
def test_a_port_in_use_is_one_line_naming_the_flag_that_moves_it(tmp_path: Path, flag: str) -> None:
    """Another program listens on the port: exit 1, what to do, no traceback (was: a
    traceback for the peer stream port, no hint for the others)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cmd = start_cmd(tmp_path, flag, port)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("kvserver start: error: cannot bind") and f":{port}" in last, last
    assert f"Stop it, or choose another with {flag} PORT (0: any free port)" in last
    assert "pre-faulting" not in result.stderr  # found before the arena (was: after it)


def test_the_start_up_line_says_where_and_with_what(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--pub-port", "-1", "--metrics-port", "-1",
                     "--ssd-dir", str(tmp_path / "ssd"), "--ssd", "64MiB")  # fmt: skip
    try:
        line = next(x for x in d.log().splitlines() if "kvserver listening:" in x)
    finally:
        assert d.terminate() == 0, d.log()
    assert f"gRPC 127.0.0.1:{d.info['grpc_port']}, ZMQ data {d.zmq_address}, " in line
    assert "events off, metrics off, DRAM " in line  # was: "tcp://127.0.0.1:off"
    assert f"SSD 64 MiB (lru) in {tmp_path / 'ssd'}: ok" in line
    assert "auth token required (this user's clients find it in" in line
    assert line.endswith(", standalone")


def test_an_arena_directory_not_in_memory_is_warned_about_at_start(tmp_path: Path) -> None:
    """--shm-dir given a data directory: the "DRAM" tier was a disk file, said nowhere. Here
    tmp_path's filesystem (a disk unless this machine's /tmp is a tmpfs, as `stat -f` says)
    beside the session's directory in /dev/shm (a tmpfs)."""
    on = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                        text=True, check=True, timeout=30).stdout.strip()  # fmt: skip
    for shm_dir, on_disk in ((tmp_path, on != "tmpfs"), (None, False)):
        flags = ("--shm-dir", str(shm_dir)) if shm_dir else ()
        d = start_daemon(tmp_path, "--pub-port", "-1", "--metrics-port", "-1", *flags)
        assert d.terminate() == 0, d.log()
        warned = [line for line in d.log().splitlines() if "not in memory" in line]
        if on_disk:
            (line,) = warned
            assert f"WARNING kvserver.daemon: the arena's directory {shm_dir} is on " in line
            assert line.endswith("give a tmpfs with --shm-dir (the default, /dev/shm, is one)")
        else:
            assert warned == []


def test_prefault_is_announced_with_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24x100
    cmd = [
        sys.executable, "-m", "kvserver.cli", "start", "--dram", "768MiB", "--grpc-port", "0",
        "--zmq-port", "0", "--pub-port", "-1", "--metrics-port", "-1",
        "--ready-file", str(ready),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # the terminal must be read or the daemon blocks writing to it
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        wait_for_ready_file(ready, proc, time.monotonic() + 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
        os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert "pre-faulting the DRAM arena: 768 MiB" in out
    assert "pre-faulting the DRAM arena: 100%" in out, out  # tqdm's bar reached the end


def test_every_port_of_the_ready_file_is_listening_when_the_file_appears(
    tmp_path: Path,
) -> None:
    """The ready file means serving. The daemon is stopped (SIGSTOP) as soon as its file is
    seen, and every port the file names still completes a TCP connection: the kernel does
    that for a socket already listening, whereas one bound after the file would refuse while
    the daemon is stopped. A guard of the start-up order (process.py: every listener, the
    start-up line, then the file), written when a holder daemon of test_peer_faults seemed to
    refuse connections for 30 s after its ready file."""
    ready = tmp_path / "ready.json"
    cmd = [
        sys.executable, "-m", "kvserver.cli", "start", "--host", "127.0.0.1", "--dram", "16MiB",
        "--grpc-port", "0", "--zmq-port", "0", "--pub-port", "0", "--metrics-port", "0",
        "--ready-file", str(ready),
    ]  # fmt: skip
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        wait_for_ready_file(ready, proc, time.monotonic() + 90)
        proc.send_signal(signal.SIGSTOP)
        info = json.loads(ready.read_text())
        for name in ("zmq_port", "grpc_port", "pub_port", "peer_stream_port", "metrics_port"):
            assert int(info[name]) > 0, (name, info)
            with socket.create_connection(("127.0.0.1", int(info[name])), timeout=30):
                pass  # connected: listening
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)


def test_sighup_gets_the_ordered_shutdown(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--ssd-dir", str(tmp_path / "ssd"))
    arena = Path(d.arena_path)
    assert arena.exists()
    d.proc.send_signal(signal.SIGHUP)
    assert d.proc.wait(30) == 0, d.log()
    assert "stopped; shared-memory arena removed" in d.log()
    assert not arena.exists()


def test_a_dram_tier_larger_than_the_shm_filesystem_exits_1_with_the_reason(
    tmp_path: Path,
) -> None:
    """``--dram`` over what the shared-memory filesystem can hold (a real 1 MiB tmpfs: a
    container's /dev/shm at its default): exit 1, the reason and the sizes on stderr, no arena
    left; was: killed by SIGBUS during the pre-fault (exit 135 from a shell), no word why."""
    tiny = tmp_path / "shm"
    if not mount_tmpfs(tiny, "1m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        cmd = [
            sys.executable, "-m", "kvserver.cli", "start", "--dram", "8MiB", "--page-size",
            "4KiB", "--shm-dir", str(tiny), "--metrics-port", "-1", "--zmq-port", "0",
            "--grpc-port", "0", "--pub-port", "-1",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, (result.returncode, result.stderr)
        assert "cannot commit the arena's memory" in result.stderr
        assert "8 MiB asked" in result.stderr
        assert not [p for p in tiny.iterdir() if p.name.startswith("kvserver-")]
    finally:
        unmount(tiny)


def test_a_dram_tier_that_cannot_fit_is_refused_before_the_pre_fault(tmp_path: Path) -> None:
    """``--dram`` over the free room of the shared-memory filesystem (a real 1 MiB tmpfs) is
    refused before the pre-fault begins, naming the sizes and the fix; was: pre-faulted until
    the filesystem was full (``--dram 40GiB`` on a 24 GiB /dev/shm: 19 s and all of it, the
    host's RAM, committed), then failed."""
    tiny = tmp_path / "shm"
    if not mount_tmpfs(tiny, "1m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        cmd = [
            sys.executable, "-m", "kvserver.cli", "start", "--dram", "64MiB", "--shm-dir",
            str(tiny), "--metrics-port", "-1", "--zmq-port", "0", "--grpc-port", "0",
            "--pub-port", "-1",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, (result.returncode, result.stderr)
        last = result.stderr.splitlines()[-1]
        assert last.startswith(
            "kvserver start: error: cannot commit the arena's memory: it does not fit"
        )
        assert "64 MiB asked" in last and "give a smaller --dram" in last
        assert "pre-faulting" not in result.stderr
        assert list(tiny.iterdir()) == []
    finally:
        unmount(tiny)


def test_a_restart_after_sigkill_removes_what_the_killed_daemon_left(tmp_path: Path) -> None:
    """kill -9 leaves the arena, its local-channel socket and the token files in the
    shared-memory directory; the next ``kvserver start`` there removes them, saying which
    (the socket was called an "arena" in that line)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"KVSERVER_SHM_DIR": str(shm)}
    first = start_daemon(tmp_path / "a", "--shm-dir", str(shm), "--dram", "4MiB", env=env)
    arena = first.arena_path
    tokens = [token_path(first.info[p], str(shm)) for p in ("zmq_port", "grpc_port")]
    first.kill()
    assert os.path.exists(arena) and os.path.exists(f"{arena}.sock")
    assert all(os.path.exists(t) for t in tokens)
    second = start_daemon(tmp_path / "b", "--shm-dir", str(shm), "--dram", "4MiB", env=env)
    try:
        log = second.log()
        assert f"removed the arena {arena} left by a daemon that is no longer running" in log
        assert f"removed the local-channel socket {arena}.sock left by a daemon" in log
        assert not os.path.exists(arena) and not os.path.exists(f"{arena}.sock")
        assert not any(os.path.exists(t) for t in tokens)
    finally:
        assert second.terminate() == 0, second.log()
    assert [p.name for p in shm.iterdir() if not p.is_dir()] == []


def test_an_ssd_tier_larger_than_its_disk_is_warned_about_at_start(tmp_path: Path) -> None:
    """``--ssd`` over what the SSD directory's filesystem has room for starts (the disk may
    be shared or grow) but says so at once, with the figure to give; was: silence until the
    disk filled, hours later, and the tier went degraded."""
    st = os.statvfs(tmp_path)
    too_big = ((st.f_bavail * st.f_frsize) >> 30) + 1024  # GiB: a TiB more than is free
    d = start_daemon(tmp_path, "--dram", "4MiB", "--ssd-dir", str(tmp_path / "ssd"),
                     "--ssd", f"{too_big}GiB")  # fmt: skip
    try:
        assert d.info["ssd_condition"] == "ok"
        assert f"SSD tier: --ssd {too_big << 10} MiB, but its filesystem has room for" in d.log()
        assert "give --ssd" in d.log()
    finally:
        assert d.terminate() == 0, d.log()
    fits = start_daemon(tmp_path, "--dram", "4MiB", "--ssd-dir", str(tmp_path / "ssd"),
                        "--ssd", "8MiB")  # fmt: skip
    try:
        assert "filesystem has room for" not in fits.log()
    finally:
        assert fits.terminate() == 0, fits.log()
