"""The blocking kvserver client (scheduler, workers, tools).

Runs in any client process. Not thread-safe: use one ``KVClient`` per thread (each has its own
DEALER socket, and its own connection to the daemon's local channel when co-located: see
:mod:`kvserver.client.transport`). Every call waits at most ``timeout`` seconds and raises
:class:`~kvserver.errors.Unavailable` after that — or at once when the connection to the
daemon is lost while it waits (the daemon exited: its reply cannot come); the socket is then
replaced by a fresh one (new routing id) and the next call renews the session transparently
(hello, arena mapping, namespace re-registration) — also when the daemon was restarted on the
same address. No request is sent twice.

Usage::

    with KVClient("tcp://127.0.0.1:9471") as kv:
        ns = kv.register_namespace(spec)
        kv.store(ns.ns_id, keys, parts)          # shared memory when co-located, else frames
        hits = kv.lookup(ns.ns_id, keys).hit_chunks
        parts = kv.load(ns.ns_id, keys[:hits])

``address`` is the daemon's ZMQ data endpoint, ``tcp://HOST:PORT`` (``HOST[:PORT]`` is read as
that, 9471 by default: :func:`~kvserver.client.common.data_address`). A call that gets no reply
says why when it can: a failed handshake (the token, CURVE keys), nothing listening there, or a
port that is not a ZMQ data port (``docs/security.md``, :mod:`kvserver.client.handshake`).

Low-level co-located flow: ``prepare_store`` → ``write(extents, data)`` per part →
``complete_store``; ``prepare_load`` → ``read``/``readinto`` → ``complete_load``. The two
completions need no reply before the next call: ``complete_store_nowait`` /
``complete_load_nowait`` send them and return, and a later call collects the reply (see
"Completions sent without waiting" below).

The operations (signatures, defaults, contracts) are defined once in :mod:`kvserver.client.ops`
and shared with :class:`~kvserver.client.aio.AsyncKVClient`; this module is their blocking
driver.

Pipelining: ``submit_*`` send a request and return a :class:`~kvserver.client.pending.Pending`
at once; its ``result()`` is collected later, in any order, while other calls (blocking or
submitted) go on over the same socket. A timeout replaces the socket, failing every request
still outstanding on it with ``Unavailable`` (see :mod:`kvserver.client.pending`).

Completions sent without waiting (``*_nowait``): the daemon applies a connection's requests in
arrival order, so the next call (a ``prepare_load`` of the keys just completed) sees their
effect; the client does not block on their replies, which a busy machine makes cost a
scheduler wake-up each (docs/benchmarks.md, session 14). Errors are never lost: every call
first collects the completions whose replies are in and raises the first failure among them
(that call is then not sent; a completion sent without waiting is always sent, its
predecessors collected by the next other call); :meth:`KVClient.flush` waits for all of them, and
:meth:`KVClient.close` flushes before it closes.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, Concatenate, ParamSpec

from kvserver.client import ops
from kvserver.client.calls import Answer, Call, Proc, PutResult, T
from kvserver.client.common import DEFAULT_TIMEOUT_S, Session
from kvserver.client.ops import ClientBase
from kvserver.client.parts import Parts
from kvserver.client.pending import Pending
from kvserver.client.stream import StreamLink
from kvserver.client.stream_put import StreamPut
from kvserver.client.stream_use import StreamUse, get_call
from kvserver.client.transport import Slot, Transport
from kvserver.crypto import CurveClient
from kvserver.errors import KVServerError, Unauthenticated, UnknownNamespace
from kvserver.namespace import NamespaceSpec

P = ParamSpec("P")

logger = logging.getLogger(__name__)


def blocking(
    op: Callable[Concatenate[Session, P], Proc[T]],
) -> Callable[Concatenate[KVClient, P], T]:
    """The blocking method of operation ``op``: renew the session, drive ``op`` to its value."""

    @wraps(op)
    def method(self: KVClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(op(self._s, *args, **kwargs))

    return method


def submitting(
    op: Callable[Concatenate[Session, P], Proc[T]],
) -> Callable[Concatenate[KVClient, P], Pending[T]]:
    """The pipelined method of operation ``op``: send its first call now; a Pending."""

    @wraps(op)
    def method(self: KVClient, /, *args: P.args, **kwargs: P.kwargs) -> Pending[T]:
        return self._submit(op(self._s, *args, **kwargs))

    method.__doc__ = f":meth:`{op.__name__}`, sent without waiting for the reply."
    return method


class KVClient(ClientBase):
    """Blocking client; see the module docstring. ``colocated``: None = auto, False = never
    use shared memory, True = require it. ``local``: send requests over the daemon's local
    channel (a Unix socket) when co-located and it announces one (``docs/wire.md`` §1).
    ``stream`` (on by default: 1.1-1.3x raw ZMQ where ZMQ is 0.7-0.9x, ``docs/benchmarks.md``):
    send a remote ``put`` and ``get`` over the daemon's stream port when it announces one for
    them (``docs/wire.md`` §6; :mod:`kvserver.client.stream_use`), else ZMQ; ``stream_tls`` (the
    daemon's CA): over its TLS stream port, never a plain one."""

    _t: Transport

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
        stream: bool = True,
        stream_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.timeout = timeout
        self._s = Session(
            address, client_id=client_id, auth_token=auth_token, colocated=colocated, curve=curve
        )
        self._t = Transport(self._s, local=local)
        self._stream = StreamUse(stream, stream_tls)
        #: completions sent without waiting, their replies not collected yet (oldest first).
        self._nowait: list[Pending[Any]] = []

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """:meth:`flush` (at most the client's timeout when the daemon does not answer), then
        close the socket and unmap the arena (also when the flush raises: its error is raised
        once closed). Leases are not released (see release());
        outstanding submitted requests fail with Unavailable."""
        try:
            self.flush()
        finally:
            self._t.drop("the client was closed")
            self._stream.close()
            self._s.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way out: a completion's error must not replace it
            self.close()
        except KVServerError as error:
            logger.warning("a completion sent without waiting failed: %s", error)

    # ------------------------------------------------------------------ driver

    def _exchange(self, call: Call) -> Answer:
        _, slot = self._t.send(call, self.timeout)
        return self._t.wait(slot, self.timeout)

    def _read_arrived(self) -> None:
        """Route every reply already received, without blocking (for Pending.done)."""
        self._t.read_arrived(self.timeout)

    def _forget(self, req_id: int) -> None:
        """Its reply will be dropped (kept in order until then: see the id 0 rule)."""
        self._t.forget(req_id)

    def _retry_in_namespace(self, call: Call) -> Answer | None:
        """After ``unknown_namespace`` for a namespace this client registered: register it
        again (the whole session when the daemon restarted) and send ``call`` once more.
        None when the namespace is not one of ours."""
        spec = self._s.specs.get(call.args.get("ns_id", ""))
        if spec is None:
            return None
        if self._s.needs_hello:
            self._renew()  # the daemon restarted: re-registers every namespace
        else:
            self._drive(self._s.register_namespace(spec))
        return self._exchange(call)

    def _exchange_renewing(self, call: Call) -> Answer:
        """Exchange; after a daemon restart renew the session, retrying a namespace miss."""
        try:
            answer = self._exchange(call)
        except UnknownNamespace:
            retried = self._retry_in_namespace(call)
            if retried is None:
                raise
            answer = retried
        except Unauthenticated:
            if not self._s.token_changed():
                raise
            self._renew()  # a restarted daemon with a new token: retry once with it
            answer = self._exchange(call)
        self._renew()
        return answer

    def _renew(self) -> None:
        if self._s.needs_hello:
            self._drive(self._s.hello())
            for spec in list(self._s.specs.values()):
                self._drive(self._s.register_namespace(spec))

    def _drive(self, proc: Proc[T], *, renewing: bool = False) -> T:
        exchange = self._exchange_renewing if renewing else self._exchange
        try:
            call = next(proc)
            while True:
                try:
                    answer = exchange(call)
                except KVServerError as exc:
                    call = proc.throw(exc)
                else:
                    call = proc.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _run(self, proc: Proc[T]) -> T:
        if self._nowait:
            self._collect_nowait()
        self._renew()
        return self._drive(proc, renewing=True)

    def _submit(self, proc: Proc[T], *, collect: bool = True) -> Pending[T]:
        """Renew the session if needed (blocking), then send the first call of ``proc``.
        ``collect``: first collect the completions sent without waiting (False for those)."""
        if collect and self._nowait:
            self._collect_nowait()
        self._renew()
        call = next(proc)
        try:
            req_id, slot = self._t.send(call, self.timeout)
        except BaseException:
            proc.close()
            raise
        return Pending(self, proc, slot, req_id)

    def _finish(self, proc: Proc[T], slot: Slot, timeout: float) -> T:
        """Wait for ``slot`` (the first call of ``proc``), then drive ``proc`` to its value;
        a later call of a multi-call proc is a blocking exchange."""
        try:
            try:
                try:
                    answer = self._t.wait(slot, timeout)
                except UnknownNamespace:
                    retried = self._retry_in_namespace(slot.call)
                    if retried is None:
                        raise
                    answer = retried
                except Unauthenticated:
                    if not self._s.token_changed():
                        raise
                    self._renew()  # a restarted daemon with a new token: retry once with it
                    answer = self._exchange(slot.call)
            except KVServerError as exc:
                call = proc.throw(exc)
            else:
                call = proc.send(answer)
            while True:
                try:
                    answer = self._exchange_renewing(call)
                except KVServerError as exc:
                    call = proc.throw(exc)
                else:
                    call = proc.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ operations
    # defined once in kvserver/client/ops.py (signatures, defaults, contracts)

    hello = blocking(ops.hello)
    register_namespace = blocking(ops.register_namespace)
    namespaces = blocking(ops.namespaces)
    stats = blocking(ops.stats)
    release = blocking(ops.release)
    lookup = blocking(ops.lookup)
    lookup_tokens = blocking(ops.lookup_tokens)
    touch = blocking(ops.touch)
    pin = blocking(ops.pin)
    unpin = blocking(ops.unpin)
    prepare_store = blocking(ops.prepare_store)
    prepare_store_completing = blocking(ops.prepare_store_completing)
    complete_store = blocking(ops.complete_store)
    prepare_load = blocking(ops.prepare_load)
    complete_load = blocking(ops.complete_load)

    def put(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
    ) -> PutResult:
        """:func:`kvserver.client.ops.put`; a payload over ``ops.PUT_WINDOW_BYTES`` goes as
        several puts sent back to back, each stored or rejected on its own. Raises the first
        window's error (after every window's reply is in). Over the stream: windows one after
        the other when the daemon announces its quota for them; the windows the stream does
        not store (one answered ``capacity``, the link failing, ...) go over ZMQ, those stored
        stay stored (:mod:`kvserver.client.stream_put`)."""
        call = StreamPut(self._s, ns_id, keys, parts, lease_s, self.timeout)
        if self._over_stream(len(keys), call) is not None:
            zmq = None
        else:
            rest_keys, rest_parts = call.rest()
            try:
                zmq = self._put_zmq(ns_id, rest_keys, rest_parts, lease_s)
            except KVServerError:
                if call.error is None:
                    raise
                zmq = None
        if call.error is not None:
            raise call.error
        return call.merge(zmq)

    def _put_zmq(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, lease_s: float | None
    ) -> PutResult:
        """``put`` over ZMQ, in ``ops.put_windows``."""
        windows = ops.put_windows(keys, parts)
        if len(windows) == 1 or len(keys) != len(parts):  # a mismatch: the daemon says so
            return self._run(ops.put(self._s, ns_id, keys, parts, lease_s=lease_s))
        sent = [self.submit_put(ns_id, k, p, lease_s=lease_s) for k, p in windows]
        results: list[PutResult] = []
        error: KVServerError | None = None
        for pending in sent:
            try:
                results.append(pending.result())
            except KVServerError as exc:
                error = error or exc
        if error is not None:
            raise error
        return ops.merge_puts(results)

    def get(
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
            got = self._over_stream(len(keys), call)
            if got is not None:
                return got
        return self._run(ops.get(self._s, ns_id, keys, ranks=ranks, leading=leading, spec=spec))

    def _over_stream(self, num_keys: int, fn: Callable[[StreamLink], T]) -> T | None:
        """``fn``'s value over the stream, or None: send over ZMQ (``StreamUse``)."""
        if self._nowait:
            self._collect_nowait()
        self._renew()
        address = self._stream.wanted(self._s, num_keys)
        if address is None:
            return None
        return self._stream.call(self._s, address, self.timeout, fn)

    write_parts = blocking(ops.write_parts)
    read_parts = blocking(ops.read_parts)
    store = blocking(ops.store)
    load = blocking(ops.load)

    # pipelined: sent now, collected later (Pending)
    submit_lookup = submitting(ops.lookup)
    submit_put = submitting(ops.put)
    submit_prepare_store = submitting(ops.prepare_store)
    submit_prepare_store_completing = submitting(ops.prepare_store_completing)
    submit_complete_store = submitting(ops.complete_store)
    submit_prepare_load = submitting(ops.prepare_load)
    submit_complete_load = submitting(ops.complete_load)

    # completions sent without waiting (see the module docstring)

    def complete_store_nowait(
        self,
        lease_id: int,
        *,
        success: bool = True,
        ranks: Sequence[int] | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """:meth:`complete_store`, its reply collected by a later call, :meth:`flush` or
        :meth:`close` (which raise its error)."""
        proc = ops.complete_store(self._s, lease_id, success=success, ranks=ranks, keys=keys)
        self._nowait.append(self._submit(proc, collect=False))

    def complete_load_nowait(self, lease_id: int) -> None:
        """:meth:`complete_load`, its reply collected as :meth:`complete_store_nowait`'s."""
        self._nowait.append(self._submit(ops.complete_load(self._s, lease_id), collect=False))

    def flush(self) -> None:
        """Wait for the reply of every completion sent without waiting; raises the first
        error among them (after collecting every one)."""
        nowait, self._nowait = self._nowait, []
        _raise_first(nowait)

    def _collect_nowait(self) -> None:
        """Collect the completions whose replies are in, in order; raise the first error."""
        done = 0
        while done < len(self._nowait) and self._nowait[done].done():
            done += 1
        collected, self._nowait = self._nowait[:done], self._nowait[done:]
        _raise_first(collected)


def _raise_first(pendings: list[Pending[Any]]) -> None:
    """``result()`` of each of ``pendings``; then raise the first error, if any."""
    error: KVServerError | None = None
    for pending in pendings:
        try:
            pending.result()
        except KVServerError as exc:
            error = error or exc
    if error is not None:
        raise error
