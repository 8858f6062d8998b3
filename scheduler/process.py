"""The scheduler process: one asyncio event loop running the step loop and the gRPC front door.

The only scheduler module that knows it is a process (event loop, children, signals: the stop
signals' handler is ``kvserver/stop_signals.py``, the daemon's too).

Start-up: remove what schedulers killed without cleaning up left (token files, temp
directories: ``ipc_dir.py``) → spawn synthetic workers if asked (``ipc://`` sockets in a
private temp directory, ``ipc_dir.py``) → connect and hello every worker (their KV layout names
the kvserver namespace) → build the kvserver connector if ``--kvserver`` is given and probe its
daemon (hello and register the namespace, on a thread of its own: blocking calls of up to
``--kvserver-op-timeout-s`` each; a daemon that does not answer is logged, and the scheduler
serves without it) → start the step loop → start gRPC (its token: the configured one or a
random one, written to this user's token file of the gRPC port, ``kvserver/token_file.py``, so
that same-user clients find it) → serve Prometheus ``/metrics`` (``metrics.py``; a port that
cannot be bound is logged, not fatal) → log the start-up line (``scheduler serving HOST:PORT,
metrics URL|off: ...``) → write the ready file.

The step loop is :class:`~scheduler.engine_core.EngineCore` (``engine_core.py``), a plain
object this module starts and stops.

Shutdown on SIGTERM/SIGINT/SIGHUP, in order: metrics stop → gRPC stops accepting and in-flight
streams get a short grace (the loop still serves them) → remaining streams are cancelled (their
requests aborted) → the step loop stops → workers are told to stop and synthetic children reaped
→ the connector's leases are released → the trace is closed → the token file and the ready file
are removed → exit 0. A stop signal while the workers' hello is awaited (up to
``--hello-timeout-s``) cancels it and does the same at once; so does one while the kvserver
daemon is probed (the probe's thread is left to end on its own). A second stop signal exits at
once, 128 + the signal, after killing synthetic children and removing those files and the
ipc:// directory; a repeat within a second of the first is the same request, not a second one
(``kvserver/stop_signals.py``). What a forced exit skips: streams are cut (clients get
UNAVAILABLE), workers given by ``--workers`` are not told to stop, the connector's daemon leases
are not released (they expire on the daemon), the trace's last records may be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvserver.daemon.auth import Authenticator
from kvserver.errors import InvalidArgument, KVServerError
from kvserver.files import write_atomic
from kvserver.netaddr import host_port
from kvserver.prometheus import serve_metrics
from kvserver.stop_signals import Leaving, StopSignals
from kvserver.token_file import (
    TokenFiles,
    reap_stale_token_files,
    remove_token_files,
    server_token,
    token_path,
    write_token_files,
)
from scheduler.config import ProcessConfig
from scheduler.engine_core import EngineCore
from scheduler.engine_service import EngineService
from scheduler.ipc_dir import IpcDir, reap_stale_ipc_dirs
from scheduler.metrics import SchedulerCollector
from scheduler.scheduler import Scheduler
from scheduler.workers import WorkerGroup
from step_protocol import WorkerHello, WorkerInfo
from step_protocol.limits import MIB, derived_limit

if TYPE_CHECKING:
    from scheduler.kv_connector import KVServerSchedulerConnector

logger = logging.getLogger("scheduler.process")
T = TypeVar("T")

#: what the warning of a forced exit (a later stop signal) says
FORCED_EXIT_NOTE = (
    "(streams cut, daemon leases left to expire); synthetic workers killed, token and ready "
    "files removed"
)


def _spawn_synthetic(config: ProcessConfig, ipc_dir: IpcDir) -> tuple[list[str], list[Any]]:
    """Start the synthetic worker children; their ipc:// addresses and Popen objects. Each
    takes plans up to a multiple of the largest these settings send (step_protocol/limits.py)."""
    addresses, children = [], []
    plan_limit = derived_limit(config.plan_bytes_bound)
    paths = [ipc_dir.socket_path(f"w{rank}.sock") for rank in range(config.synthetic_workers)]
    for path in paths:
        address = f"ipc://{path}"
        args = [
            sys.executable, "-m", "scheduler.synthetic", "--bind", address,
            "--delay-ms", str(config.synthetic_delay_ms), "--parent-pid", str(os.getpid()),
            "--step-max-message-mib", repr(plan_limit / MIB),
        ]  # fmt: skip
        children.append(subprocess.Popen(args, stdin=subprocess.DEVNULL))
        addresses.append(address)
    return addresses, children


async def _unless_stopped(aw: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``aw``'s result, or None (``aw`` cancelled) once ``stop`` is set first: the first stop
    signal while the workers' hello (up to ``--hello-timeout-s``) or the kvserver daemon's
    probe (``--kvserver-op-timeout-s``) is awaited stops at once."""
    task = asyncio.ensure_future(aw)
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _make_connector(
    config: ProcessConfig, infos: list[WorkerInfo]
) -> KVServerSchedulerConnector | None:
    """The kvserver connector over the namespace the workers' KV layout describes (not yet
    probed: :func:`_probe`)."""
    if config.kvserver is None:
        return None
    from kvserver.namespace import NamespaceSpec
    from scheduler.kv_connector import KVServerSchedulerConnector
    from scheduler.kv_connector_types import KVConnectorConfig

    layout = infos[0].kv_layout
    if not layout:
        raise InvalidArgument("the workers report no KV layout; cannot use --kvserver")
    sched = config.scheduler
    spec = NamespaceSpec(
        model=config.model,
        dtype=layout["dtype"],
        num_layers=layout["num_layers"],
        num_kv_heads=layout["num_kv_heads"],
        head_dim=layout["head_dim"],
        block_size=sched.block_size,
        chunk_blocks=config.chunk_blocks,
        hash_algo=sched.hash_algo,
        hash_seed=sched.hash_seed,
        tp_world_size=len(infos),
    )
    return KVServerSchedulerConnector(
        KVConnectorConfig(config.kvserver, spec, auth_token=config.kvserver_auth_token,
                          curve=config.kvserver_curve,
                          lookup_timeout_s=config.kvserver_lookup_timeout_s,
                          op_timeout_s=config.kvserver_op_timeout_s)
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Probed:
    """What the start-up probe of the kvserver daemon found: None when it answered."""

    problem: str | None


def _probe(connector: KVServerSchedulerConnector) -> asyncio.Future[_Probed]:
    """``connector.probe()`` on a thread of its own, off the event loop, whose stop signals
    are then handled at once: the probe is blocking and waits up to ``--kvserver-op-timeout-s``
    per call for a daemon that does not answer. The thread owns the connector until the
    returned future is settled on the loop; if the future was cancelled meanwhile (stopped),
    the connector is closed there, or by the thread itself once the loop is gone. A daemon
    thread: a process that stops meanwhile exits without waiting for it."""
    loop = asyncio.get_running_loop()
    probed: asyncio.Future[_Probed] = loop.create_future()

    def settle(result: _Probed | BaseException) -> None:  # on the loop
        if probed.cancelled():  # stopped: nobody takes the connector
            with contextlib.suppress(KVServerError):
                connector.close()
        elif isinstance(result, BaseException):
            probed.set_exception(result)
        else:
            probed.set_result(result)

    def run() -> None:  # on the probe's thread
        result: _Probed | BaseException
        try:
            result = _Probed(connector.probe())
        except BaseException as exc:  # handed to the loop, raised there
            result = exc
        try:
            loop.call_soon_threadsafe(settle, result)
        except RuntimeError:  # the loop is closed: the scheduler has stopped
            with contextlib.suppress(KVServerError):
                connector.close()

    threading.Thread(target=run, name="kvserver-probe", daemon=True).start()
    return probed


async def serve(
    config: ProcessConfig, stop: asyncio.Event | None = None, leaving: Leaving | None = None
) -> None:
    """Run the scheduler process until ``stop`` is set (SIGTERM/SIGINT under :func:`main`);
    what a forced exit must clean up is added to ``leaving`` as it is made."""
    stop = stop or asyncio.Event()
    leaving = leaving or Leaving()
    ipc_dir: IpcDir | None = None
    children: list[Any] = []
    workers: WorkerGroup | None = None
    scheduler: Scheduler | None = None
    service: EngineService | None = None
    core: EngineCore | None = None
    loop_task: asyncio.Task[None] | None = None
    metrics_server = None
    token_files: TokenFiles | None = None
    token = server_token(config.engine_auth_token, config.engine_no_auth)
    stale_tokens = reap_stale_token_files()
    if stale_tokens:
        logger.info("removed %d token files left by servers that are no longer running",
                    len(stale_tokens))  # fmt: skip
    stale_dirs = reap_stale_ipc_dirs()
    if stale_dirs:
        logger.info("removed %d temporary directories left by schedulers that are no longer "
                    "running", len(stale_dirs))  # fmt: skip
    try:
        addresses = list(config.workers)
        if config.synthetic_workers:
            ipc_dir = IpcDir()
            leaving.dirs.append(ipc_dir.path)
            addresses, children = _spawn_synthetic(config, ipc_dir)
            leaving.children.extend(children)
        workers = WorkerGroup(
            addresses, step_timeout_s=config.step_timeout_s,
            hello_timeout_s=config.hello_timeout_s, curve=config.step_curve,
            max_message_bytes=config.reply_limit_bytes, plan_bytes_bound=config.plan_bytes_bound,
        )  # fmt: skip
        sched = config.scheduler
        logger.info("waiting for %d workers to answer hello (at most %g s)", len(addresses),
                    config.hello_timeout_s)  # fmt: skip
        hello = WorkerHello(0, len(addresses), sched.block_size, sched.num_gpu_blocks, config.model)
        infos = await _unless_stopped(workers.start(hello), stop)
        if infos is None:
            logger.info("stopped before the workers answered hello")
            return
        connector = _make_connector(config, infos)
        if connector is not None:
            logger.info("reaching the kvserver daemon at %s (at most %g s a call)",
                        config.kvserver, config.kvserver_op_timeout_s)  # fmt: skip
            probed = await _unless_stopped(_probe(connector), stop)
            if probed is None:
                logger.info("stopped before the kvserver daemon answered")
                return
            if probed.problem is None:
                logger.info("kvserver daemon at %s answers; namespace %s", config.kvserver,
                            connector.ns_id)  # fmt: skip
            else:
                logger.warning(
                    "kvserver daemon at %s is unreachable (%s): serving without it, prompts "
                    "are computed until it answers (retried on later lookups)",
                    config.kvserver, probed.problem,
                )  # fmt: skip
        scheduler = Scheduler(sched, connector=connector)
        core = EngineCore(scheduler, workers, probe_interval_s=config.probe_interval_s)
        loop_task = asyncio.create_task(core.run(), name="step-loop")
        service = EngineService(
            core, config.host, config.grpc_port, tls=config.tls,
            auth=Authenticator.single(token),
            per_address=config.grpc_max_connections_per_address,
        )  # fmt: skip
        port = await service.start()
        if token:  # the front door's token for this user's clients (docs/security.md)
            token_files = write_token_files(token, {port})
            leaving.files.extend(str(p) for p in token_files.paths)
            service.token_hint = (
                f"clients of its user on this host read {token_files.paths[0]}; others present "
                "the token it was given, --engine-auth-token-file (docs/security.md)"
            )
        else:  # a file left for this port by a SIGKILLed scheduler is stale now
            remove_token_files([token_path(port)])
        collector = SchedulerCollector(core, asyncio.get_running_loop())
        metrics_port, metrics_server = serve_metrics(collector, config.host, config.metrics_port)
        info = {
            "pid": os.getpid(),
            "host": config.host,
            "grpc_port": port,
            "metrics_port": metrics_port,
            "workers": addresses,
        }
        logger.info(
            "scheduler serving %s, metrics %s: %d workers, %d GPU blocks of %d tokens, "
            "kvserver %s",
            host_port(config.host, port), _metrics_url(config.host, metrics_port), len(addresses),
            sched.num_gpu_blocks, sched.block_size, config.kvserver or "off",
        )  # fmt: skip
        if config.ready_file:  # after that line: whoever waits for the file finds it logged
            leaving.files.append(str(config.ready_file))
            write_atomic(config.ready_file, json.dumps(info))
        stop_wait = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stop_wait, loop_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if loop_task.done():
            loop_task.result()  # the loop never returns on its own: surface its error
        logger.info("shutting down")
    finally:
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.shutdown)  # a scrape in flight needs the loop
            metrics_server.server_close()
        if service is not None:
            await service.stop(config.shutdown_grace_s)
        if core is not None:
            core.stop()
        if loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(loop_task, config.shutdown_grace_s + 1.0)
        if workers is not None:
            await workers.close(stop_workers=bool(children))
        for child in children:
            try:
                child.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if scheduler is not None:
            close = getattr(scheduler.connector, "close", None)
            if callable(close):
                with contextlib.suppress(KVServerError):
                    close()
            scheduler.close()
        if token_files is not None:
            token_files.close()
        if config.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config.ready_file)
        if ipc_dir is not None:
            ipc_dir.close()
        logger.info("stopped")


def main(config: ProcessConfig) -> int:
    """Run the scheduler in this process; returns the exit code (0 on orderly shutdown)."""
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvloop

    async def _main() -> None:
        stop = asyncio.Event()
        leaving = Leaving()
        signals = StopSignals(stop)
        signals.arm(leaving, FORCED_EXIT_NOTE)  # from the first signal on: a later one exits
        signals.install(asyncio.get_running_loop())
        await serve(config, stop, leaving)

    uvloop.run(_main())
    return 0


def _metrics_url(host: str, port: int) -> str:
    """Where ``/metrics`` is served (``off``: -1, turned off or not bound)."""
    if port < 0:
        return "off"
    return f"http://{host_port(host, port)}/metrics"
