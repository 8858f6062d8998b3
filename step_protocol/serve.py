"""The worker end of the step protocol: one ROUTER socket, one message at a time.

Runs in a worker process (worker/process.py's model worker, scheduler/synthetic.py's synthetic
one); :func:`serve_steps` is the process's main loop and owns its signals (SIGTERM and SIGINT
end it). The scheduler's WorkerGroup is the other end (DEALER sockets). Requests are served
in arrival order; a malformed or failing one gets a ``KIND_ERROR`` reply and the loop goes on.
``zmq`` is imported on call, so that the step protocol's messages stay importable without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvserver.crypto import CurveServer
from kvserver.errors import InvalidArgument, KVServerError
from kvserver.files import write_atomic
from step_protocol.codec import decode, encode_body
from step_protocol.limits import DEFAULT_WORKER_LIMIT_BYTES, mib
from step_protocol.step import (
    KIND_ERROR,
    KIND_HELLO,
    KIND_RESULT,
    KIND_STEP,
    KIND_STOP,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerInfo,
)

logger = logging.getLogger(__name__)

#: how often (ms) the loop wakes without a message, to notice a signal or an orphaning
POLL_MS = 200


class StepWorker(Protocol):
    """What :func:`serve_steps` drives: one rank's ``hello`` and ``execute``."""

    @property
    def rank(self) -> int: ...

    def hello(self, msg: WorkerHello) -> WorkerInfo: ...

    def execute(self, plan: StepPlan) -> StepResult: ...


def handle_message(worker: StepWorker, data: bytes, max_message_bytes: int = 0) -> bytes | None:
    """One message → its reply; None for ``stop``. A hello's reply carries
    ``max_message_bytes`` when > 0 (the plans this worker takes, ``step_protocol/limits.py``).
    A ``KVServerError`` raised by the worker
    or by decoding becomes a ``KIND_ERROR`` reply carrying the step (or hello seq); so does
    any other exception (logged with its traceback: a bug, or input no check foresaw), which
    ended the worker process before (an IndexError from a negative position)."""
    kind = ""
    body: dict[str, Any] = {}
    try:
        kind, body = decode(data)
        if kind == KIND_STEP:
            return encode_body(KIND_RESULT, worker.execute(StepPlan.from_wire(body)).to_wire())
        if kind == KIND_HELLO:
            info = worker.hello(WorkerHello.from_wire(body)).to_wire()
            if max_message_bytes > 0:
                info["max_message_bytes"] = max_message_bytes
            return encode_body(KIND_HELLO, {**info, "seq": body.get("seq")})
        if kind == KIND_STOP:
            return None
        raise InvalidArgument("unknown message kind", kind=kind)
    except KVServerError as exc:
        logger.warning("rank %d: %s failed: %s", worker.rank, kind or "message", exc)
        return _error(kind, body, str(exc))
    except Exception as exc:  # the worker serves on: the scheduler's hello resets its state
        logger.exception("rank %d: %s failed unexpectedly", worker.rank, kind or "message")
        return _error(kind, body, f"internal error in the worker: {type(exc).__name__}: {exc}")


def _error(kind: str, body: dict[str, Any], message: str) -> bytes:
    seq = body.get("step", body.get("seq", -1)) if kind else -1
    if type(seq) is not int or not -(1 << 63) <= seq < 1 << 64:
        seq = -1  # the error reply must encode whatever the request carried
    return encode_body(KIND_ERROR, {"step": seq, "message": message})


def receive_frames(sock: Any, keep: int) -> tuple[list[bytes], int]:
    """One whole message of ``sock`` (ready: ZMQ delivers whole messages), frame by frame
    (``kvserver/zmq_frames.py``): all its frames when it has at most ``keep``, else its first
    one only, and its frame count; the others are received and dropped one at a time. Not
    ``recv_multipart``: a peer the handshake admitted (any one without a token, with
    ``--step-no-auth`` or over ``ipc://``) could send a message of a million empty frames, and
    ``recv_multipart`` made a ``bytes`` of each (see ``receive_frames`` in the tests)."""
    from kvserver.zmq_frames import Incoming

    first = sock.recv(copy=False)
    if not first.more:
        return [first.bytes], 1
    incoming = Incoming(first, keep)
    incoming.take(sock)
    return [frame.bytes for frame in incoming.frames], incoming.count


def _log_dropped(monitor: Any, rank: int, limit: int) -> None:
    """Log each connection the ROUTER lost (its monitor's events, all read). ZMQ tells a
    connection dropped for a frame over ``MAXMSGSIZE`` with the same event as one its peer
    closed, so the line names both."""
    while monitor.poll(0):
        monitor.recv_multipart()  # libzmq's own monitor (inproc): no peer writes it
        logger.warning(
            "rank %d: a scheduler's connection closed: it went away or reconnected, or sent a "
            "message over this worker's limit of %s (--step-max-message-mib), which is "
            "refused unread; serving on", rank, mib(limit),
        )  # fmt: skip


def serve_steps(
    worker: StepWorker,
    bind: str,
    *,
    ready_file: str | None,
    ready_info: Mapping[str, Any] | None = None,
    parent_pid: int | None = None,
    on_exit: Callable[[], None] | None = None,
    curve: CurveServer | None = None,
    no_auth: bool = False,
    max_message_bytes: int = DEFAULT_WORKER_LIMIT_BYTES,
) -> None:
    """Serve the step protocol for ``worker`` on a ROUTER bound at ``bind`` until ``stop``,
    SIGTERM/SIGINT, or (with ``parent_pid``) the parent process going away. ``curve``: the
    ROUTER is a CURVE server, and with its ``clients_dir`` a ZAP handler (a thread) admits
    only the scheduler keys listed there (step_protocol/security.py). Without ``curve`` a
    ``tcp://`` ROUTER requires a random token at the handshake, left for this user's scheduler
    in the token file of its port (``step_protocol/step_auth.py``), unless ``no_auth``.
    ``max_message_bytes``: the ROUTER's ``MAXMSGSIZE`` (ZMQ drops a connection announcing a
    longer frame, unread; the loop logs each dropped connection with the limit, and serves
    on), told to the scheduler in the hello's reply (``step_protocol/limits.py``).
    Once bound, writes
    ``{"pid", "endpoint", **ready_info}`` to ``ready_file`` atomically. On the way out (also
    on an error) closes the socket, then calls ``on_exit`` (the worker's own cleanup), then
    removes ``ready_file``. Raises zmq.ZMQError when ``bind`` cannot be bound."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    from step_protocol.step_auth import StepGate, unpublish_stale

    ctx = zmq.Context()
    gate = StepGate.for_worker(ctx, bind, curve=curve is not None, no_auth=no_auth)
    zap: ThreadAuthenticator | None = None
    if curve is not None and curve.clients_dir:
        zap = ThreadAuthenticator(ctx)
        zap.start()
        zap.configure_curve(domain="*", location=curve.clients_dir)
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    dropped = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    if bind.startswith("tcp://["):  # tcp://[::1]:P binds (was: "No such device"); not set for
        sock.setsockopt(zmq.IPV6, 1)  # IPv4, whose endpoint would read tcp://[::ffff:127.0.0.1]
    if curve is not None:
        curve.apply(sock)
    if gate is not None:
        gate.guard(sock)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(dropped, zmq.POLLIN)
    if gate is not None:
        poller.register(gate.socket, zmq.POLLIN)
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        sock.bind(bind)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if gate is not None:
            gate.publish(endpoint)
        else:
            unpublish_stale(endpoint)
        if ready_file:
            info = {"pid": os.getpid(), "endpoint": endpoint, **(ready_info or {})}
            write_atomic(ready_file, json.dumps(info))
        security = " (CURVE)" if curve is not None else " (token)" if gate is not None else ""
        logger.info("rank %d (pid %d) serving on %s%s", worker.rank, os.getpid(), endpoint,
                    security)  # fmt: skip
        while not stopping:
            ready = dict(poller.poll(POLL_MS))
            if gate is not None and gate.socket in ready:
                gate.drain()
            if dropped in ready:
                _log_dropped(dropped, worker.rank, max_message_bytes)
            if sock not in ready:
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.info("parent %d is gone: exiting", parent_pid)
                    break
                continue
            frames, count = receive_frames(sock, 2)
            if count < 2:
                continue
            ident = frames[0]
            if count == 2:
                reply = handle_message(worker, frames[1], max_message_bytes)
            else:  # answered rather than dropped: the sender would wait for its timeout
                message = f"a step message is one frame, not {count - 1}"
                reply = encode_body(KIND_ERROR, {"step": -1, "message": message})
            if reply is None:
                break
            sock.send_multipart([ident, reply])
    finally:
        sock.disable_monitor()
        dropped.close(0)
        sock.close(0)
        if zap is not None:
            zap.stop()
        if gate is not None:
            gate.close()
        ctx.term()
        try:
            if on_exit is not None:
                on_exit()
        finally:
            if ready_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ready_file)
