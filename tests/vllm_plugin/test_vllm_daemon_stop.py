"""The daemon stops under a co-located worker (shared-memory arena), through the plug-in.

vLLM's own Scheduler drives KVServerConnector in both roles (tests/vllm_plugin/harness.py)
against real ``kvserver start`` processes. When the daemon is stopped with SIGTERM (its arena
file is removed) or killed and restarted (the new daemon reaps the old arena file), the
worker's mapping goes stale: the transfers it is given then fail (vLLM recomputes those
tokens, with identical output), nothing raises into vLLM, and a later transfer maps the
restarted daemon's arena, which serves again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.vllm_plugin.vllm_env import require_vllm

require_vllm()

from kvserver.errors import KVServerError  # noqa: E402
from tests.support.daemon import DaemonProc, port_kept, start_daemon, wait_until  # noqa: E402
from tests.vllm_plugin.harness import MiniEngine, write_tiny_model  # noqa: E402
from tests.vllm_plugin.test_vllm_scheduler import (  # noqa: E402
    assert_recomputed,
    engine,
    ns_hits,
    prompt,
    reference_outputs,
)

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model"))


def colocated_engine(model_dir: Path, daemon: DaemonProc) -> MiniEngine:
    eng = engine(model_dir, daemon.zmq_address, transfer_timeout_s=1.0, op_timeout_s=0.5,
                 lookup_timeout_s=0.1, down_backoff_s=0.01)  # fmt: skip
    worker = eng.worker.worker_half if eng.worker is not None else None
    assert worker is not None and worker.arena is not None
    assert worker.arena.path == daemon.arena_path  # the shared-memory path
    return eng


def reaches(eng: MiniEngine, daemon: DaemonProc) -> bool:
    """The scheduler connector would call ``daemon`` now: its client gets an answer from
    ``daemon``, and its circuit breaker is closed. (While the breaker is open, after a call
    timed out, a request is admitted with no lookup and its stores are not sent: a short
    request then finishes without a single store, and the worker, which maps the new arena
    on its first transfer, never gets one.)"""
    half = eng.connector.scheduler_half
    assert half is not None
    try:
        answered = half.client.hello().get("arena_path") == daemon.arena_path
    except KVServerError:
        return False
    return bool(answered) and not half.is_daemon_down


def stop_with_a_load_in_flight(
    model_dir: Path, tmp_path: Path, stop: Callable[[DaemonProc], DaemonProc]
) -> None:
    """A hit is pinned by the scheduler, then ``stop(daemon)`` (returning the daemon that
    listens on the same port afterwards) runs before the worker starts the load. The load
    fails and is recomputed; the next request is stored in the daemon listening then."""
    daemon = start_daemon(tmp_path / "d1", "--dram", "16MiB", *port_kept())
    shared, later = prompt(8, 100), prompt(9, 64)
    eng = colocated_engine(model_dir, daemon)
    restarted = daemon
    try:
        eng.run_requests([("first", shared)], max_tokens=2)
        assert ns_hits(eng, daemon, shared) == 3
        assert eng.scheduler.reset_prefix_cache()
        eng.add("second", [*shared, 4], max_tokens=2)

        def stop_daemon(_: object) -> None:
            nonlocal restarted
            restarted = stop(daemon)

        record = eng.step(before_worker=stop_daemon)  # pinned, then the daemon stops
        assert not os.path.exists(daemon.arena_path)
        assert "second" in record.finished_recving and record.invalid_block_ids
        assert_recomputed(eng, [record, *eng.run()], "second")
        if restarted is daemon:  # stopped for good: start it again on the same port
            port = daemon.zmq_address.rsplit(":", 1)[1]
            restarted = start_daemon(tmp_path / "d3", "--dram", "16MiB", "--zmq-port", port)
        # a call made while the daemon was away timed out (SIGTERM: it is started only now)
        # and opened the scheduler connector's breaker: let it reach the daemon listening
        # now, so that the request's stores are reserved (else they are retried only while
        # the request runs)
        wait_until(lambda: reaches(eng, restarted))
        eng.run_requests([("later", later)], max_tokens=2)
        assert ns_hits(eng, restarted, later) == 2  # stored through the daemon there now
        worker = eng.worker.worker_half if eng.worker is not None else None
        assert worker is not None and worker.arena is not None
        assert worker.arena.path == restarted.arena_path  # remapped on a later transfer
        outputs = dict(eng.outputs)
    finally:
        eng.close()
        daemon.kill()
        restarted.terminate()
    prompts = [("first", shared), ("second", [*shared, 4]), ("later", later)]
    assert outputs == reference_outputs(model_dir, prompts, 2)


def test_daemon_stopped_with_sigterm(model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM: the daemon's ordered shutdown removes its arena file."""

    def sigterm(daemon: DaemonProc) -> DaemonProc:
        assert daemon.terminate() == 0
        return daemon

    stop_with_a_load_in_flight(model_dir, tmp_path, sigterm)


def test_daemon_restarted_after_sigkill(model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL, then a new daemon on the same port (it reaps the dead one's arena file): the
    pinned load's extents belong to the dead arena and must not be read from the new one
    (the stand-in model checks every byte it reads)."""

    def sigkill_and_restart(daemon: DaemonProc) -> DaemonProc:
        daemon.kill()
        port = daemon.zmq_address.rsplit(":", 1)[1]
        return start_daemon(daemon.log_path.parent.parent / "d2", "--dram", "16MiB",
                            "--zmq-port", port)  # fmt: skip

    stop_with_a_load_in_flight(model_dir, tmp_path, sigkill_and_restart)
