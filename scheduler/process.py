"""The scheduler process: one asyncio event loop running the step loop and the gRPC front door.

The only scheduler module that knows it is a process (event loop, children, signals: the stop
signals' handler is ``kvserver/stop_signals.py``, the daemon's too).

Start-up: spawn synthetic workers if asked (``ipc://`` sockets in a private temp directory) →
connect and hello every worker (their KV layout names the kvserver namespace) → build the
kvserver connector if ``--kvserver`` is given → start the step loop → start gRPC (its token:
the configured one or a random one, written to this user's token file of the gRPC port,
``kvserver/token_file.py``, so that same-user clients find it) → serve Prometheus ``/metrics``
(``metrics.py``; a port that cannot be bound is logged, not fatal) → log the start-up line
(``scheduler serving HOST:PORT, metrics URL|off: ...``) → write the ready file.

The step loop (:class:`EngineCore`) runs ``schedule()`` → every worker → ``update_from_output()``
while there is work, and sleeps on an event otherwise. A worker that dies, errs or times out
fails the requests holding KV (clients get UNAVAILABLE naming the worker); requests still
queued stay queued while the loop tries to bring the workers back every ``probe_interval_s``
(a fresh hello, which also resets them) and fail if it cannot; while the workers are down new
requests are refused at once. The loop never dies on a bad step: an unexpected exception is
logged and fails the requests in flight.

Shutdown on SIGTERM/SIGINT/SIGHUP, in order: metrics stop → gRPC stops accepting and in-flight
streams get a short grace (the loop still serves them) → remaining streams are cancelled (their
requests aborted) → the step loop stops → workers are told to stop and synthetic children reaped
→ the connector's leases are released → the trace is closed → the token file and the ready file
are removed → exit 0. A stop signal while the workers' hello is awaited (up to
``--hello-timeout-s``) cancels it and does the same at once. A second stop signal exits at once,
128 + the signal, after killing synthetic children and removing those files and the ipc://
directory; a repeat within a second of the first is the same request, not a second one
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
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from kvserver.daemon.auth import Authenticator
from kvserver.errors import InvalidArgument, KVServerError, Unavailable
from kvserver.files import write_atomic
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
from scheduler.connector_base import SchedulerConnector
from scheduler.engine_service import EngineService, GenerateParams
from scheduler.metrics import SchedulerCollector
from scheduler.request import RequestOutput, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.workers import WorkerFailure, WorkerGroup
from step_protocol import WorkerHello, WorkerInfo

logger = logging.getLogger("scheduler.process")

#: what the warning of a forced exit (a later stop signal) says
FORCED_EXIT_NOTE = (
    "(streams cut, daemon leases left to expire); synthetic workers killed, token and ready "
    "files removed"
)
#: empty steps (only transfers in flight) are paced from this up to IDLE_WAIT_MAX_S
IDLE_WAIT_MIN_S = 0.0005
IDLE_WAIT_MAX_S = 0.02


class _Stream:
    """The outputs of one request, fed by the step loop (implements RequestStream)."""

    def __init__(self, core: EngineCore, request_id: str) -> None:
        self.request_id = request_id
        self._core = core
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.done = False

    def put(self, output: RequestOutput) -> None:
        if output.finished:
            self.done = True
        self._queue.put_nowait(output)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self._queue.get()
            yield output
            if output.finished:
                return

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._core.abort(self.request_id)


class EngineCore:
    """Drives one Scheduler with one WorkerGroup; see the module docstring."""

    def __init__(
        self, scheduler: Scheduler, workers: WorkerGroup, *, probe_interval_s: float = 1.0
    ) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.probe_interval_s = probe_interval_s
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self.num_connector_events = 0

    # ------------------------------------------------------------------ EngineBackend

    def _check_vocabulary(self, token_ids: list[int]) -> None:
        """Refuse a prompt token the workers' model does not have (their hello told its
        vocabulary): a model worker's embedding raised IndexError on it, failing the step and
        with it every request in flight (each rank ended before the step protocol answered
        errors; now the step fails, all the same)."""
        vocab = min((info.vocab_size for info in self.workers.infos), default=0)
        if vocab > 0 and token_ids and max(token_ids) >= vocab:
            raise InvalidArgument(
                "token_ids: a token id is outside the model's vocabulary",
                token_id=max(token_ids),
                vocab_size=vocab,
            )

    def submit(self, params: GenerateParams) -> _Stream:
        failure = self.workers.failure
        if failure is not None:
            raise Unavailable(f"workers are down: {failure}")
        if self._stopping:
            raise Unavailable("the scheduler is shutting down")
        req_id = params.request_id or uuid.uuid4().hex
        if req_id in self._streams:
            raise InvalidArgument("duplicate request id", request=req_id)
        self.scheduler.check_prompt_tokens(len(params.token_ids))  # before any pass over it
        self._check_vocabulary(params.token_ids)
        request = self.scheduler.make_request(
            req_id,
            params.token_ids,
            max_tokens=params.max_tokens,
            cache_salt=params.cache_salt,
            priority=params.priority,
            stop_token_ids=params.stop_token_ids,
            greedy=params.greedy,
            seed=params.seed,
        )
        self.scheduler.add_request(request)
        stream = self._streams[req_id] = _Stream(self, req_id)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: end the request and free its blocks."""
        self._streams.pop(request_id, None)
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        failure = self.workers.failure
        down_rank = failure.rank if failure is not None else -1
        s["workers"] = [
            {"rank": rank, "address": address, "up": failure is None or rank != down_rank}
            for rank, address in enumerate(self.workers.addresses)
        ]
        s["workers_error"] = str(failure) if failure is not None else ""
        s["kvserver_connector"] = self.scheduler.connector is not None
        return s

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Step until :meth:`stop`."""
        idle_wait = IDLE_WAIT_MIN_S
        while not self._stopping:
            if self.workers.failure is not None:
                await self._recover()
                continue
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                busy = await self._step()
            except Exception:  # a bug: keep serving, fail what was in flight
                logger.exception("scheduler step failed")
                self._deliver(
                    self.scheduler.fail_all("internal scheduler error; see its log", release=False)
                )
                # the connector forgot the transfers and released their leases: the
                # workers must drop theirs (a hello) before they run another step
                self.workers.mark_down("internal scheduler error")
                busy = True
            if busy:
                idle_wait = IDLE_WAIT_MIN_S
                await asyncio.sleep(0)  # let gRPC handlers run between steps
            else:  # only transfers in flight: poll the workers, gently
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), idle_wait)
                idle_wait = min(idle_wait * 2, IDLE_WAIT_MAX_S)

    async def _step(self) -> bool:
        scheduler = self.scheduler
        plan = scheduler.schedule()
        try:
            results = await self.workers.step(plan, sent=scheduler.dispatched)
        except WorkerFailure as exc:
            # a worker that is only slow may still copy for the forgotten transfers: their
            # leases are released once every worker answered the recovery's hello
            self._deliver(scheduler.fail_all(str(exc), release=False))
            return True
        outputs = scheduler.update_from_output(plan, results)
        if scheduler.connector is not None:
            self.num_connector_events += len(scheduler.connector.take_events())
        self._deliver(outputs)
        return bool(plan.num_scheduled_tokens or outputs)

    async def _recover(self) -> None:
        """Workers down: try a fresh hello; if they do not answer, fail what is queued and
        wait ``probe_interval_s`` (or until stopped) before trying again."""
        recovered = await self.workers.recover(self.probe_interval_s)
        if self.scheduler.connector is not None:
            # the leases of the failed step's transfers: every worker that answered the hello
            # has finished its copies for them, a dead one copies nothing, one that did not
            # answer had the hello's timeout more (waiting longer would hold them until they
            # expire on the daemon)
            self.scheduler.connector.release_forgotten()
        if recovered:
            return
        reason = f"workers are down: {self.workers.failure}"
        queued = list(self.scheduler.requests)
        for request in self.scheduler.finish_requests(queued, RequestStatus.FINISHED_ERROR):
            self._deliver([RequestOutput(request.request_id, [], True, "error", error=reason)])
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.probe_interval_s)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del streams[output.request_id]

    def stop(self) -> None:
        """Ask :meth:`run` to return; every open stream ends UNAVAILABLE."""
        self._stopping = True
        self._wake.set()
        for req_id, stream in list(self._streams.items()):
            stream.put(RequestOutput(req_id, [], True, "error", error="scheduler shutting down"))
        self._streams.clear()


# ---------------------------------------------------------------------------- the process


def _spawn_synthetic(config: ProcessConfig, tmpdir: str) -> tuple[list[str], list[Any]]:
    """Start the synthetic worker children; their ipc:// addresses and Popen objects."""
    addresses, children = [], []
    for rank in range(config.synthetic_workers):
        address = f"ipc://{tmpdir}/worker-{rank}.sock"
        args = [
            sys.executable, "-m", "scheduler.synthetic", "--bind", address,
            "--delay-ms", str(config.synthetic_delay_ms), "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        children.append(subprocess.Popen(args, stdin=subprocess.DEVNULL))
        addresses.append(address)
    return addresses, children


async def _unless_stopped(
    aw: Awaitable[list[WorkerInfo]], stop: asyncio.Event
) -> list[WorkerInfo] | None:
    """``aw``'s result, or None (``aw`` cancelled) once ``stop`` is set first: the first stop
    signal while the workers' hello is awaited (up to ``--hello-timeout-s``) stops at once."""
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


def _make_connector(config: ProcessConfig, infos: list[WorkerInfo]) -> SchedulerConnector | None:
    """The kvserver connector over the namespace the workers' KV layout describes."""
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
    connector = KVServerSchedulerConnector(
        KVConnectorConfig(config.kvserver, spec, auth_token=config.kvserver_auth_token,
                          curve=config.kvserver_curve)
    )  # fmt: skip
    problem = connector.probe()
    if problem is None:
        logger.info("kvserver daemon at %s answers; namespace %s", config.kvserver, spec.ns_id)
    else:
        logger.warning(
            "kvserver daemon at %s is unreachable (%s): serving without it, prompts are "
            "computed until it answers (retried on later lookups)",
            config.kvserver, problem,
        )  # fmt: skip
    return connector


async def serve(
    config: ProcessConfig, stop: asyncio.Event | None = None, leaving: Leaving | None = None
) -> None:
    """Run the scheduler process until ``stop`` is set (SIGTERM/SIGINT under :func:`main`);
    what a forced exit must clean up is added to ``leaving`` as it is made."""
    stop = stop or asyncio.Event()
    leaving = leaving or Leaving()
    tmpdir = tempfile.mkdtemp(prefix="kvserver-sched-")
    leaving.dirs.append(tmpdir)
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
    try:
        addresses = list(config.workers)
        if config.synthetic_workers:
            addresses, children = _spawn_synthetic(config, tmpdir)
            leaving.children.extend(children)
        workers = WorkerGroup(
            addresses, step_timeout_s=config.step_timeout_s,
            hello_timeout_s=config.hello_timeout_s, curve=config.step_curve,
        )  # fmt: skip
        sched = config.scheduler
        logger.info("waiting for %d workers to answer hello (at most %g s)", len(addresses),
                    config.hello_timeout_s)  # fmt: skip
        hello = WorkerHello(
            0, len(addresses), sched.block_size, sched.num_gpu_blocks, config.model
        )
        infos = await _unless_stopped(workers.start(hello), stop)
        if infos is None:
            logger.info("stopped before the workers answered hello")
            return
        scheduler = Scheduler(sched, connector=_make_connector(config, infos))
        core = EngineCore(scheduler, workers, probe_interval_s=config.probe_interval_s)
        loop_task = asyncio.create_task(core.run(), name="step-loop")
        service = EngineService(
            core, config.host, config.grpc_port, tls=config.tls,
            auth=Authenticator.single(token),
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
            "scheduler serving %s:%d, metrics %s: %d workers, %d GPU blocks of %d tokens, "
            "kvserver %s",
            config.host, port, _metrics_url(config.host, metrics_port), len(addresses),
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
        shutil.rmtree(tmpdir, ignore_errors=True)
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
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
