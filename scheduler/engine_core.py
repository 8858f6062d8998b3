"""The step loop: :class:`EngineCore` drives one ``Scheduler`` with one ``WorkerGroup``, and is
the ``EngineBackend`` of the gRPC front door (``engine_service.py``).

Runs on the scheduler process's event loop (started and stopped by ``process.py``, which alone
knows it is a process); not thread-safe. Call order: ``EngineCore(scheduler, workers)`` →
``run()`` as a task → ``submit`` / ``abort`` / ``stats`` from the front door any time →
``stop()``: ``run`` returns, every open stream ends UNAVAILABLE.

The loop runs ``schedule()`` → every worker → ``update_from_output()`` while there is work, and
sleeps on an event otherwise. A worker that dies, errs or times out fails the requests holding
KV (clients get UNAVAILABLE naming the worker); requests still queued stay queued while the
loop tries to bring the workers back every ``probe_interval_s`` (a fresh hello, which also
resets them) and fail if it cannot; while the workers are down new requests are refused at
once. The loop never dies on a bad step: an unexpected exception is logged and fails the
requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvserver.errors import InvalidArgument, Unavailable
from scheduler.engine_service import GenerateParams
from scheduler.request import RequestOutput, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.workers import WorkerFailure, WorkerGroup

logger = logging.getLogger(__name__)

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
