"""The asyncio kvserver client (workers, schedulers and the daemon's peer fetches).

Runs in any client process, on the loop where it is first used (zmq.asyncio; uvloop works).
Calls may be awaited concurrently from several tasks of that loop; they are pipelined: each is
sent at once and its reply matched by request id (:mod:`kvserver.client.aio_transport`), and
the daemon applies them in the order they were sent. The operations, their signatures and the
session behaviour (timeouts, renewal after a restart, shared memory and the local channel when
co-located) are those of :class:`~kvserver.client.sync.KVClient`, defined once in
:mod:`kvserver.client.ops`; the arena helpers (``write``/``read``/``readinto``) are plain
memcpy and stay synchronous.

Usage::

    async with AsyncKVClient("tcp://127.0.0.1:9471") as kv:
        ns = await kv.register_namespace(spec)
        await kv.store(ns.ns_id, keys, parts)
        parts = await kv.load(ns.ns_id, keys)

Pipelining without tasks: ``p = await kv.submit_prepare_store(...)`` returns once the request
is sent, with an :class:`asyncio.Task` for its value (``await p``; ``p.cancel()`` forgets the
reply, the daemon still carries the request out).

Completions sent without waiting (``await kv.complete_store_nowait(...)`` /
``complete_load_nowait``): as :class:`~kvserver.client.sync.KVClient`'s (a later call,
``flush()`` or ``close()`` raises a failed one's error).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Coroutine, Sequence
from functools import wraps
from typing import Any, Concatenate, ParamSpec

from kvserver.client import ops
from kvserver.client.aio_transport import AioSlot, AioTransport
from kvserver.client.calls import Answer, Call, Proc, PutResult, T
from kvserver.client.common import DEFAULT_TIMEOUT_S, Session
from kvserver.client.ops import ClientBase
from kvserver.client.parts import Parts
from kvserver.client.stream import StreamLink
from kvserver.client.stream_put import StreamPut
from kvserver.client.stream_use import StreamUse, get_call
from kvserver.crypto import CurveClient
from kvserver.errors import KVServerError, Unauthenticated, UnknownNamespace
from kvserver.namespace import NamespaceSpec

P = ParamSpec("P")

logger = logging.getLogger(__name__)


def awaiting(
    op: Callable[Concatenate[Session, P], Proc[T]],
) -> Callable[Concatenate[AsyncKVClient, P], Coroutine[Any, Any, T]]:
    """The coroutine method of operation ``op``: renew the session, drive ``op``."""

    @wraps(op)
    async def method(self: AsyncKVClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(op(self._s, *args, **kwargs))

    return method


def submitting(
    op: Callable[Concatenate[Session, P], Proc[T]],
) -> Callable[Concatenate[AsyncKVClient, P], Coroutine[Any, Any, asyncio.Task[T]]]:
    """The pipelined method of operation ``op``: returns once its first call is sent."""

    @wraps(op)
    async def method(self: AsyncKVClient, /, *args: P.args, **kwargs: P.kwargs) -> asyncio.Task[T]:
        return await self._submit(op(self._s, *args, **kwargs))

    method.__doc__ = f":meth:`{op.__name__}`, sent now; a Task for its value."
    return method


class AsyncKVClient(ClientBase):
    """Asyncio client; see the module docstring. ``colocated``: None = auto, False = never
    use shared memory, True = require it. ``local``: send requests over the daemon's local
    channel (a Unix socket) when co-located and it announces one (``docs/wire.md`` §1).
    ``max_frame_bytes`` > 0: the largest reply frame taken over ZMQ; the daemon (a peer, for
    a daemon's network tier) sending a larger one loses the connection before its bytes are
    received, and the requests outstanding on it fail with Unavailable; over the stream, a
    get's reply announcing larger parts of a namespace the client does not know is refused
    (InvalidArgument). ``stream``: as ``KVClient``'s (its calls run in a worker thread, one
    at a time)."""

    _t: AioTransport

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        client_id: str | None = None,
        auth_token: str = "",
        colocated: bool | None = None,
        curve: CurveClient | None = None,
        local: bool = True,
        max_frame_bytes: int = 0,
        stream: bool = True,
        stream_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.timeout = timeout
        self._s = Session(
            address, client_id=client_id, auth_token=auth_token, colocated=colocated, curve=curve
        )
        self._t = AioTransport(self._s, local=local, max_frame_bytes=max_frame_bytes)
        self._renew_lock = asyncio.Lock()
        self._stream = StreamUse(stream, stream_tls, max_frame_bytes)
        #: completions sent without waiting, their replies not collected yet (oldest first).
        self._nowait: list[asyncio.Task[Any]] = []

    # ------------------------------------------------------------------ lifetime

    @property
    def outstanding(self) -> int:
        """Requests sent whose replies have not come yet (pipelined)."""
        return self._t.outstanding

    async def close(self) -> None:
        """:meth:`flush` (at most the client's timeout when the daemon does not answer), then
        close the links and unmap the arena (also when the flush raises: its error is raised
        once closed). Leases are not released (see release());
        requests still outstanding fail with Unavailable."""
        try:
            await self.flush()
        finally:
            await self._t.close("the client was closed")
            self._stream.close()
            self._s.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            await self.close()
            return
        try:  # an exception is on its way out: a completion's error must not replace it
            await self.close()
        except KVServerError as error:
            logger.warning("a completion sent without waiting failed: %s", error)

    # ------------------------------------------------------------------ driver

    async def _exchange(self, call: Call) -> Answer:
        slot = await self._t.send(call, self.timeout)
        return await self._t.wait(slot, self.timeout)

    async def _exchange_renewing(self, call: Call, sent: AioSlot | None = None) -> Answer:
        """Exchange (or wait for ``sent``, already sent); after a daemon restart renew the
        session, retrying a namespace miss and a refused token once."""
        try:
            if sent is None:
                answer = await self._exchange(call)
            else:
                answer = await self._t.wait(sent, self.timeout)
        except UnknownNamespace:
            spec = self._s.specs.get(call.args.get("ns_id", ""))
            if spec is None:
                raise
            if self._s.needs_hello:
                await self._renew()  # the daemon restarted: re-registers every namespace
            else:
                await self._drive(self._s.register_namespace(spec))
            answer = await self._exchange(call)
        except Unauthenticated:
            if not self._s.token_changed():
                raise
            await self._renew()  # a restarted daemon with a new token: retry once with it
            answer = await self._exchange(call)
        await self._renew()
        return answer

    async def _renew(self) -> None:
        async with self._renew_lock:
            if self._s.needs_hello:
                await self._drive(self._s.hello())
                for spec in list(self._s.specs.values()):
                    await self._drive(self._s.register_namespace(spec))

    async def _drive(
        self, proc: Proc[T], *, renewing: bool = False, sent: tuple[Call, AioSlot] | None = None
    ) -> T:
        try:
            call = next(proc) if sent is None else sent[0]
            while True:
                try:
                    if sent is not None:
                        answer = await self._exchange_renewing(call, sent[1])
                        sent = None
                    elif renewing:
                        answer = await self._exchange_renewing(call)
                    else:
                        answer = await self._exchange(call)
                except KVServerError as exc:
                    call = proc.throw(exc)
                else:
                    call = proc.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _run(self, proc: Proc[T]) -> T:
        if self._nowait:
            self._collect_nowait()
        await self._renew()
        return await self._drive(proc, renewing=True)

    async def _submit(self, proc: Proc[T], *, collect: bool = True) -> asyncio.Task[T]:
        """Renew the session if needed, send the first call of ``proc``; a Task for the rest.
        ``collect``: first collect the completions sent without waiting (False for those)."""
        if collect and self._nowait:
            self._collect_nowait()
        await self._renew()
        call = next(proc)
        try:
            slot = await self._t.send(call, self.timeout)
        except BaseException:
            proc.close()
            raise
        return asyncio.ensure_future(self._drive(proc, renewing=True, sent=(call, slot)))

    # ------------------------------------------------------------------ operations
    # defined once in kvserver/client/ops.py (signatures, defaults, contracts)

    hello = awaiting(ops.hello)
    register_namespace = awaiting(ops.register_namespace)
    namespaces = awaiting(ops.namespaces)
    stats = awaiting(ops.stats)
    release = awaiting(ops.release)
    lookup = awaiting(ops.lookup)
    lookup_tokens = awaiting(ops.lookup_tokens)
    touch = awaiting(ops.touch)
    pin = awaiting(ops.pin)
    unpin = awaiting(ops.unpin)
    prepare_store = awaiting(ops.prepare_store)
    prepare_store_completing = awaiting(ops.prepare_store_completing)
    complete_store = awaiting(ops.complete_store)
    prepare_load = awaiting(ops.prepare_load)
    complete_load = awaiting(ops.complete_load)

    async def put(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
    ) -> PutResult:
        """:func:`kvserver.client.ops.put`; a payload over ``ops.PUT_WINDOW_BYTES`` goes as
        several puts sent back to back, each stored or rejected on its own. Raises the first
        window's error (after every window's reply is in). Over the stream: windows one after
        the other when the daemon announces its quota for them; the windows the stream does
        not store (one answered ``capacity``, the link failing, ...) go over ZMQ, those stored
        stay stored (:mod:`kvserver.client.stream_put`)."""
        call = StreamPut(self._s, ns_id, keys, parts, lease_s, self.timeout)
        if await self._over_stream(len(keys), call) is not None:
            zmq = None
        else:
            rest_keys, rest_parts = call.rest()
            try:
                zmq = await self._put_zmq(ns_id, rest_keys, rest_parts, lease_s)
            except KVServerError:
                if call.error is None:
                    raise
                zmq = None
        if call.error is not None:
            raise call.error
        return call.merge(zmq)

    async def _put_zmq(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, lease_s: float | None
    ) -> PutResult:
        """``put`` over ZMQ, in ``ops.put_windows``."""
        windows = ops.put_windows(keys, parts)
        if len(windows) == 1 or len(keys) != len(parts):  # a mismatch: the daemon says so
            return await self._run(ops.put(self._s, ns_id, keys, parts, lease_s=lease_s))
        sent = [await self.submit_put(ns_id, k, p, lease_s=lease_s) for k, p in windows]
        results = await asyncio.gather(*sent, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return ops.merge_puts([r for r in results if isinstance(r, PutResult)])

    async def get(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        ranks: Sequence[int] | None = None,
        leading: bool = False,
        spec: NamespaceSpec | None = None,
    ) -> list[list[memoryview]]:
        """:func:`kvserver.client.ops.get` (over the stream when it is used and not
        ``leading``)."""
        if not leading:
            call = get_call(self._s, ns_id, keys, ranks, spec, self.timeout)
            got = await self._over_stream(len(keys), call)
            if got is not None:
                return got
        return await self._run(
            ops.get(self._s, ns_id, keys, ranks=ranks, leading=leading, spec=spec)
        )

    async def _over_stream(self, num_keys: int, fn: Callable[[StreamLink], T]) -> T | None:
        """``fn``'s value over the stream, or None: send over ZMQ (``StreamUse``)."""
        if self._nowait:
            self._collect_nowait()
        await self._renew()
        address = self._stream.wanted(self._s, num_keys)
        if address is None:
            return None
        return await self._stream.call_async(self._s, address, self.timeout, fn)

    write_parts = awaiting(ops.write_parts)
    read_parts = awaiting(ops.read_parts)
    store = awaiting(ops.store)
    load = awaiting(ops.load)

    # pipelined: sent now, collected later (a Task)
    submit_lookup = submitting(ops.lookup)
    submit_put = submitting(ops.put)
    submit_prepare_store = submitting(ops.prepare_store)
    submit_prepare_store_completing = submitting(ops.prepare_store_completing)
    submit_complete_store = submitting(ops.complete_store)
    submit_prepare_load = submitting(ops.prepare_load)
    submit_complete_load = submitting(ops.complete_load)

    # completions sent without waiting (see the module docstring)

    async def complete_store_nowait(
        self,
        lease_id: int,
        *,
        success: bool = True,
        ranks: Sequence[int] | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """:meth:`complete_store` once sent, its reply collected by a later call,
        :meth:`flush` or :meth:`close` (which raise its error)."""
        proc = ops.complete_store(self._s, lease_id, success=success, ranks=ranks, keys=keys)
        self._nowait.append(await self._submit(proc, collect=False))

    async def complete_load_nowait(self, lease_id: int) -> None:
        """:meth:`complete_load`, its reply collected as :meth:`complete_store_nowait`'s."""
        self._nowait.append(await self._submit(ops.complete_load(self._s, lease_id), collect=False))

    async def flush(self) -> None:
        """Wait for the reply of every completion sent without waiting; raises the first
        error among them (after collecting every one)."""
        nowait, self._nowait = self._nowait, []
        outcomes = await asyncio.gather(*nowait, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _collect_nowait(self) -> None:
        """Collect the completions whose replies are in, in order; raise the first error."""
        done = 0
        while done < len(self._nowait) and self._nowait[done].done():
            done += 1
        collected, self._nowait = self._nowait[:done], self._nowait[done:]
        errors = [e for task in collected if (e := task.exception()) is not None]
        if errors:
            raise errors[0]
