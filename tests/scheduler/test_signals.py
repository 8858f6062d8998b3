"""A real ``kvserver scheduler`` whose ordered shutdown is held up (a stream in flight, its
worker stopped with SIGSTOP so no step is answered, a long ``--shutdown-grace-s``): the first
stop signal starts the shutdown and does not end it; a second, past the repeat window, ends it
at once with 128 + the signal, as the daemon does (``kvserver/stop_signals.py``), leaving no
token file, ready file, ipc:// directory or synthetic worker behind. A repeat milliseconds after
the first is the same request: the ordered shutdown, exit 0. The first stop signal while the
scheduler waits for its workers' hello, or for its kvserver daemon's start-up probe, stops it at
once and cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvserver.token_file import token_path
from tests.scheduler.builders import tokens
from tests.scheduler.procs import EngineClient, Proc, start_scheduler, start_worker
from tests.support.daemon import wait_until
from tests.support.ports import free_port
from tests.support.stop_signals import (
    assert_stopped_in_order,
    send_burst,
    wait_past_repeat_window,
)

pytestmark = pytest.mark.multiprocess

HELD_S = "120"  # the grace and step timeout: far longer than the test waits for anything


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # exited, not yet reaped


@pytest.mark.parametrize(
    ("sig", "synthetic"), [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["TERM", "INT"]
)
def test_a_second_stop_signal_ends_a_held_up_shutdown_at_once(
    tmp_path: Path, sig: signal.Signals, synthetic: bool
) -> None:
    worker: Proc | None = None
    if synthetic:  # the scheduler's own child; it polls for its parent, unless stopped
        workers = ["--synthetic-workers", "1", "--synthetic-delay-ms", "20"]
    else:
        worker = start_worker(tmp_path, "w", "tcp://127.0.0.1:0", "--delay-ms", "20")
        workers = ["--workers", worker.info["endpoint"]]
    sched = start_scheduler(
        tmp_path, *workers, "--num-gpu-blocks", "64", "--block-size", "16",
        "--shutdown-grace-s", HELD_S, "--step-timeout-s", HELD_S,
    )  # fmt: skip
    port = sched.info["grpc_port"]
    ready = Path(sched.args[sched.args.index("--ready-file") + 1])
    (worker_pid,) = children_of(sched.proc.pid) if worker is None else (worker.proc.pid,)
    ipc_dir = Path(sched.info["workers"][0].removeprefix("ipc://")).parent if synthetic else None
    try:
        with EngineClient(port) as c:
            stream = c.stream(tokens(32), 1000)  # 20 s of steps at least
            assert next(stream).token_ids
            os.kill(worker_pid, signal.SIGSTOP)  # no step is answered from now on
            sched.proc.send_signal(sig)
            wait_until(lambda: "shutting down" in sched.log())
            took_first = time.monotonic()  # after the scheduler took the first signal
            with pytest.raises(subprocess.TimeoutExpired):  # the stream's grace holds it
                sched.proc.wait(1.0)

            wait_past_repeat_window(took_first)  # else it is the same request
            sched.proc.send_signal(sig)
            assert sched.proc.wait(10) == 128 + sig, sched.log()
            assert "a second stop signal: exiting now" in sched.log()
            assert not Path(token_path(port)).exists() and not ready.exists()
            with pytest.raises(grpc.RpcError) as cut:
                for _ in stream:
                    pass
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        if synthetic:  # stopped, it could not have noticed its parent go: it was killed
            wait_until(lambda: gone(worker_pid))
            assert ipc_dir is not None and not ipc_dir.exists()
    finally:
        sched.kill()
        if not gone(worker_pid):
            os.kill(worker_pid, signal.SIGCONT)
        if worker is not None:
            worker.kill()


def test_a_stop_signal_while_the_workers_hello_is_awaited_stops_at_once_and_cleanly(
    tmp_path: Path,
) -> None:
    """The worker is stopped (SIGSTOP: its hello is never answered) and the hello may take
    600 s: the first SIGTERM was left unanswered until the hello timed out, then the scheduler
    failed with a traceback. Now it exits 0 at once, leaving no private directory behind."""
    worker = start_worker(tmp_path, "w", "tcp://127.0.0.1:0")
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        text = _sigterm_while(
            tmp_path,
            ["--workers", worker.info["endpoint"], "--hello-timeout-s", "600"],
            "waiting for 1 workers to answer hello",
        )
        assert "stopped before the workers answered hello" in text, text
        assert "Traceback" not in text, text
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
        worker.kill()


def test_a_stop_signal_while_the_kvserver_daemon_is_probed_stops_at_once_and_cleanly(
    tmp_path: Path,
) -> None:
    """Nothing answers at the --kvserver address (a port nobody listens on) and each call
    may take 600 s: the start-up probe of the daemon blocked the event loop, so the first
    SIGTERM was handled only once it gave up (hello and register: up to 1,200 s), and the
    scheduler started serving before it shut down. Now the probe runs off the loop and the
    scheduler exits 0 at once, leaving no ready file or private directory behind."""
    text = _sigterm_while(
        tmp_path,
        ["--synthetic-workers", "1", "--num-gpu-blocks", "17", "--block-size", "16",
         "--kvserver", f"tcp://127.0.0.1:{free_port()}", "--kvserver-op-timeout-s", "600"],
        "reaching the kvserver daemon at",
    )  # fmt: skip
    assert "stopped before the kvserver daemon answered" in text, text
    assert "scheduler serving" not in text and "Traceback" not in text, text


def _sigterm_while(tmp_path: Path, extra: list[str], waiting: str) -> str:
    """A scheduler started with ``extra`` flags, SIGTERMed once its log says ``waiting``:
    it exits 0 within 60 s leaving no ready file and an empty private (TMPDIR) directory;
    its log."""
    own_tmp = tmp_path / "t"  # the scheduler's tempfile directory (short: its ipc:// paths)
    own_tmp.mkdir()
    log = tmp_path / "scheduler.log"
    ready = tmp_path / "scheduler.ready"
    args = [
        sys.executable, "-m", "kvserver.cli", "scheduler", "--host", "127.0.0.1",
        "--grpc-port", "0", "--metrics-port", "0", "--ready-file", str(ready), *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(own_tmp)})  # fmt: skip
    try:
        wait_until(lambda: waiting in log.read_text(), 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not ready.exists() and list(own_tmp.iterdir()) == []
    return log.read_text()


def test_a_repeat_milliseconds_after_the_first_stop_signal_is_the_same_request(
    tmp_path: Path,
) -> None:
    """Two SIGTERMs a few milliseconds apart (``timeout`` forwarding its signal while a
    supervisor's ``pkill`` sends its own): the ordered shutdown, exit 0, its files removed. Was:
    the second exited at once (143), without the shutdown."""
    sched = start_scheduler(
        tmp_path, "--synthetic-workers", "1", "--num-gpu-blocks", "64", "--block-size", "16"
    )
    port = sched.info["grpc_port"]
    ready = Path(sched.args[sched.args.index("--ready-file") + 1])
    try:
        with EngineClient(port) as c:
            assert c.generate(tokens(32), 4)
        send_burst(sched.proc, signal.SIGTERM)
        assert sched.proc.wait(60) == 0, sched.log()
        assert_stopped_in_order(sched.log(), "scheduler.process: stopped")
        assert not Path(token_path(port)).exists() and not ready.exists()
    finally:
        sched.kill()
