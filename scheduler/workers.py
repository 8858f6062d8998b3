"""ZMQ fan-out of StepPlans to the workers and gather of their StepResults.

Runs in the scheduler process on its asyncio event loop (zmq.asyncio); used by the step loop
only, one call at a time. Each worker binds a ROUTER socket; this side holds one DEALER per
worker (``ZMQ_IMMEDIATE``: nothing is queued for a worker that is not connected).

Call order: ``await start(hello)`` (connect, hello every worker within ``hello_timeout_s``) →
``await step(plan)`` per engine step → ``await close()``. A step goes to every worker (tensor
parallel: every rank runs every request) and succeeds only when every worker answered within
``step_timeout_s``; otherwise it raises :class:`WorkerFailure` naming the first worker that
failed. After a failure the group is *down* (:attr:`WorkerGroup.failure`): :meth:`recover`
replaces the sockets of every worker (dropping anything queued for a dead peer) and says hello
again, which makes every worker forget its requests; until it succeeds ``step`` refuses at
once. Replies to an older step or hello (a slow worker catching up) are recognised by their
step number and dropped.

With ``curve`` every DEALER is a CURVE client of its worker (step_protocol/security.py);
without it, a DEALER to a loopback ``tcp://`` worker presents the worker's step token, read
from the token file the worker left for its user each time the socket is made
(``step_protocol/step_auth.py``). A security handshake that fails (a wrong key on either side,
CURVE on one side only, a refused or missing token) makes a hello fail at once with the
reason, in the step channel's option names (each socket's monitor events, read by
:class:`~kvserver.client.links.ConnectionWatch`), instead of waiting out
``hello_timeout_s``.

Message size (``step_protocol/limits.py``): every DEALER takes replies up to
``max_message_bytes`` (ZMQ ``MAXMSGSIZE``: a longer one's connection is dropped at its length
prefix, unread); a connection that breaks while a step waits for its reply fails that step at
once naming the worker and both limits (was: the step timeout, then "no reply"). A plan over
the limit a worker told in its hello is not sent: its step fails naming the worker, the plan's
size and the limit; a ``plan_bytes_bound`` over that limit is warned about at hello.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import zmq
import zmq.asyncio

from kvserver.client.links import ConnectionWatch
from kvserver.crypto import CurveClient
from kvserver.errors import InvalidArgument, KVServerError, Unavailable
from kvserver.netaddr import is_ipv6_endpoint
from step_protocol import (
    KIND_ERROR,
    KIND_HELLO,
    KIND_RESULT,
    KIND_STEP,
    KIND_STOP,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerInfo,
    decode,
    encode_body,
    step_auth,
)
from step_protocol.limits import FLOOR_BYTES, mib

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: how often a hello in flight looks at its socket's handshake, and a step at its connection (s)
HANDSHAKE_CHECK_S = 0.05


class WorkerFailure(Unavailable):
    """A worker died, timed out or reported an error; the step's requests cannot go on."""

    def __init__(self, message: str, *, rank: int, address: str) -> None:
        super().__init__(message, rank=rank, address=address)
        self.rank = rank
        self.address = address


@dataclass(slots=True)
class _Worker:
    rank: int
    address: str
    sock: zmq.asyncio.Socket | None = None
    watch: ConnectionWatch | None = None
    #: the DEALER's security ("null", "plain": the step token, "curve") and the token file
    #: it read (None: no token file applies to this address)
    mechanism: str = "null"
    token_path: str | None = None
    info: WorkerInfo | None = None


class WorkerGroup:
    """The scheduler's view of its N workers; see the module docstring."""

    def __init__(
        self,
        addresses: list[str],
        *,
        step_timeout_s: float = 10.0,
        hello_timeout_s: float = 30.0,
        context: zmq.asyncio.Context | None = None,
        curve: CurveClient | None = None,
        max_message_bytes: int = FLOOR_BYTES,
        plan_bytes_bound: int = 0,
    ) -> None:
        if not addresses:
            raise KVServerError("a worker group needs at least one worker")
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._workers = [_Worker(rank, address) for rank, address in enumerate(addresses)]
        self.step_timeout_s = step_timeout_s
        self.hello_timeout_s = hello_timeout_s
        self.curve = curve
        #: the replies' limit (MAXMSGSIZE) and the largest plan these settings can send
        self.max_message_bytes = max_message_bytes
        self.plan_bytes_bound = plan_bytes_bound
        self._hello: WorkerHello | None = None
        self._hello_seq = 0
        #: why the group is down (None: healthy)
        self.failure: WorkerFailure | None = WorkerFailure(
            "workers not started", rank=0, address=addresses[0]
        )

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self._workers]

    @property
    def infos(self) -> list[WorkerInfo]:
        """What each worker said in its last hello (REQUIRES: started)."""
        return [w.info for w in self._workers if w.info is not None]

    # ------------------------------------------------------------------ lifecycle

    async def start(self, hello: WorkerHello, timeout_s: float | None = None) -> list[WorkerInfo]:
        """Connect and hello every worker (``hello.rank`` is set per worker). Raises
        WorkerFailure if one does not answer within ``timeout_s`` (default hello_timeout_s)."""
        self._hello = hello
        await self._connect_and_hello(timeout_s or self.hello_timeout_s)
        return self.infos

    async def recover(self, timeout_s: float) -> bool:
        """Try to bring a down group back (fresh sockets, hello = reset); True on success."""
        if self.failure is None:
            return True
        try:
            await self._connect_and_hello(timeout_s)
        except WorkerFailure as exc:
            self.failure = exc
            return False
        logger.info("all %d workers answer again", self.world_size)
        return True

    def mark_down(self, reason: str) -> None:
        """Take the group down although every worker answered (the scheduler failed a step
        of its own and forgot its requests): ``step`` refuses until :meth:`recover`, whose
        hello makes every worker forget its requests and transfers too."""
        self.failure = WorkerFailure(reason, rank=-1, address="")
        logger.error("workers reset: %s", reason)

    async def close(self, *, stop_workers: bool = False) -> None:
        """Close every socket (optionally telling the workers to exit first). Idempotent."""
        for worker in self._workers:
            sock, worker.sock = worker.sock, None
            if sock is None:
                continue
            self._unwatch(worker)
            if stop_workers:  # a refusal (the worker gone) is in the future, done at once
                with contextlib.suppress(zmq.ZMQError):
                    await sock.send(encode_body(KIND_STOP, {}), flags=zmq.NOBLOCK)
            sock.close(linger=100 if stop_workers else 0)
        if self._own_ctx:
            self._ctx.term()

    async def _connect_and_hello(self, timeout_s: float) -> None:
        assert self._hello is not None, "start() first"
        for worker in self._workers:
            if worker.sock is not None:
                self._unwatch(worker)
                worker.sock.close(linger=0)
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            if is_ipv6_endpoint(worker.address):  # ZMQ connects to IPv6 only when told
                sock.setsockopt(zmq.IPV6, 1)
            if self.curve is not None:
                self.curve.apply(sock)
                mechanism = "curve"
            else:
                token, worker.token_path = step_auth.scheduler_token(worker.address, None)
                mechanism = step_auth.present_token(sock, token)
            worker.mechanism = mechanism
            worker.watch = ConnectionWatch(
                sock, mechanism=mechanism, peer="worker", option_prefix="step_"
            )
            sock.connect(worker.address)
            worker.sock = sock
        self._hello_seq -= 1  # hellos use negative sequence numbers, steps positive ones
        seq = self._hello_seq
        deadline = time.monotonic() + timeout_s
        results = await asyncio.gather(
            *(self._hello_one(w, seq, deadline) for w in self._workers), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                self.failure = (
                    result
                    if isinstance(result, WorkerFailure)
                    else WorkerFailure(f"hello failed: {result}", rank=0, address="?")
                )
                raise self.failure
        self.failure = None

    async def _hello_one(self, worker: _Worker, seq: int, deadline: float) -> None:
        assert self._hello is not None and worker.sock is not None
        hello = WorkerHello(
            worker.rank,
            self.world_size,
            self._hello.block_size,
            self._hello.num_gpu_blocks,
            self._hello.model,
        )
        body = {**hello.to_wire(), "seq": seq}
        try:
            await self._watched(worker, worker.sock.send(encode_body(KIND_HELLO, body)), deadline)
            reply = await self._watched(worker, self._recv(worker, KIND_HELLO, seq, deadline),
                                        deadline)  # fmt: skip
        except TimeoutError:
            why = worker.watch.why_silent() if worker.watch is not None else None
            raise WorkerFailure(
                f"worker {worker.rank} at {worker.address} did not answer hello in time"
                + (f": {why}" if why is not None else ""),
                rank=worker.rank,
                address=worker.address,
            ) from None
        worker.info = WorkerInfo.from_wire(reply)
        limit = worker.info.max_message_bytes
        if limit and self.plan_bytes_bound > limit:
            logger.warning(
                "worker %d at %s takes step plans up to %s; these batch settings allow plans "
                "up to %s: a step whose plan is over it fails; raise the worker's "
                "--step-max-message-mib", worker.rank, worker.address, mib(limit),
                mib(self.plan_bytes_bound),
            )  # fmt: skip

    async def _watched(self, worker: _Worker, aw: Awaitable[T], deadline: float) -> T:
        """``aw``'s result; TimeoutError past ``deadline``; WorkerFailure, at once, when the
        worker's security handshake failed (the reason from its socket's monitor)."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(HANDSHAKE_CHECK_S,
                                                                 _left(deadline)))  # fmt: skip
                if done:
                    return task.result()
                why = worker.watch.failure() if worker.watch is not None else None
                if why is not None:
                    said = step_auth.explain(worker.mechanism, str(why), worker.token_path)
                    raise WorkerFailure(
                        f"worker {worker.rank} at {worker.address}: {said}",
                        rank=worker.rank, address=worker.address,
                    )  # fmt: skip
                if _left(deadline) <= 0:
                    raise TimeoutError
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _broke(self, worker: _Worker, step: int) -> WorkerFailure:
        told = worker.info.max_message_bytes if worker.info is not None else 0
        plans = f"the worker's for plans, {mib(told)}" if told else "the worker's for plans"
        return self._fail(
            worker,
            f"its connection broke during step {step}: ZMQ drops a connection carrying a "
            f"message over the limit (this scheduler's for replies, "
            f"{mib(self.max_message_bytes)}, --step-max-message-mib; {plans}), as it does "
            "when the worker exits",
        )

    @staticmethod
    def _unwatch(worker: _Worker) -> None:
        watch, worker.watch = worker.watch, None
        if watch is not None:
            watch.close()

    # ------------------------------------------------------------------ steps

    async def step(
        self, plan: StepPlan, sent: Callable[[], None] | None = None
    ) -> list[StepResult]:
        """Send ``plan`` to every worker; their results in rank order. ``sent``: called once
        the plan went to every worker, before waiting for them. Raises WorkerFailure (and the
        group is down) if a worker is disconnected, errs or misses the deadline."""
        if self.failure is not None:
            raise self.failure
        data = encode_body(KIND_STEP, plan.to_wire())
        for worker in self._workers:
            limit = worker.info.max_message_bytes if worker.info is not None else 0
            if limit and len(data) > limit:  # the worker would drop the connection, unread
                raise self._fail(
                    worker,
                    f"step {plan.step}'s plan is {len(data)} bytes, over the worker's limit of "
                    f"{mib(limit)} (its --step-max-message-mib): not sent",
                )
        deadline = time.monotonic() + self.step_timeout_s
        for worker in self._workers:
            assert worker.sock is not None
            try:  # zmq.asyncio never raises ZMQ's refusal (EAGAIN: not connected) here: it
                # returns a future holding it, done at once, which must be awaited to be read
                await worker.sock.send(data, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise self._fail(worker, f"not connected (step {plan.step})") from None
        if sent is not None:
            sent()
        results = await asyncio.gather(
            *(self._recv(w, KIND_RESULT, plan.step, deadline, step=True) for w in self._workers),
            return_exceptions=True,
        )
        out = []
        for worker, result in zip(self._workers, results, strict=True):
            if isinstance(result, TimeoutError):
                raise self._fail(
                    worker, f"no reply to step {plan.step} within {self.step_timeout_s:g}s"
                )
            if isinstance(result, WorkerFailure):
                self.failure = result
                raise result
            if isinstance(result, BaseException):
                raise self._fail(worker, f"bad reply to step {plan.step}: {result}")
            try:
                out.append(StepResult.from_wire(result))
            except InvalidArgument as exc:  # the worker's fault, not the scheduler's
                raise self._fail(worker, f"malformed result of step {plan.step}: {exc}") from None
        return out

    def _fail(self, worker: _Worker, what: str) -> WorkerFailure:
        self.failure = WorkerFailure(
            f"worker {worker.rank} at {worker.address}: {what}",
            rank=worker.rank,
            address=worker.address,
        )
        logger.error("%s", self.failure)
        return self.failure

    async def _recv(
        self, worker: _Worker, kind: str, seq: int, deadline: float, *, step: bool = False
    ) -> dict[str, object]:
        """The reply of ``kind`` to message ``seq``; older replies are dropped. TimeoutError
        past ``deadline``; WorkerFailure for an error reply to ``seq``, and with ``step``
        (``seq`` is a step) at once when the worker's connection broke while waiting: its
        reply can never come (checked every :data:`HANDSHAKE_CHECK_S`)."""
        sock = worker.sock
        assert sock is not None
        while True:
            # one frame at a time (never recv_multipart): a reply of many frames costs no more
            # than ZMQ's queue of it; its second frame fails decoding like any bad reply
            if not step:
                data = await asyncio.wait_for(sock.recv(), _left(deadline))
            else:  # the same wait in slices: a reply within one costs what one wait does
                # (a task and asyncio.wait around it cost ~20 us of CPU per worker and step)
                try:
                    data = await asyncio.wait_for(
                        sock.recv(), min(HANDSHAKE_CHECK_S, _left(deadline))
                    )
                except TimeoutError:
                    if worker.watch is not None and worker.watch.broke():
                        raise self._broke(worker, seq) from None
                    if _left(deadline) <= 0:
                        raise
                    continue
            got_kind, body = decode(data)
            got_seq = body.get("seq", body.get("step"))
            if got_seq != seq:
                logger.debug("dropping a stale %s from worker %d", got_kind, worker.rank)
                continue
            if got_kind == KIND_ERROR:
                raise WorkerFailure(
                    f"worker {worker.rank} at {worker.address} failed step {seq}: "
                    f"{body.get('message')}",
                    rank=worker.rank,
                    address=worker.address,
                )
            if got_kind != kind:
                raise KVServerError(f"expected {kind!r}, got {got_kind!r}")
            return body


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
