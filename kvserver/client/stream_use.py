"""When a client uses the daemon's stream port for a ``put`` or ``get``, and what a failure
there does (``docs/wire.md`` §6, "Client ops"; the link is :mod:`kvserver.client.stream`).

Runs in client processes, owned by one ``KVClient`` / ``AsyncKVClient``: :func:`stream_address`
says whether this session may use the stream at all, :class:`StreamUse` holds the client's one
link and its retry time and turns a stream failure into "send it over ZMQ" (or raises it, see
its docstring), and :func:`get_call` is a client's ``get`` as a call on the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvserver import wire, wire_stream
from kvserver.client.common import Session
from kvserver.client.stream import NotHere, StreamFailed, StreamLink
from kvserver.errors import Unauthenticated, UnknownNamespace
from kvserver.namespace import NamespaceSpec

#: after the stream failed, requests go over ZMQ for this long before it is tried again.
RETRY_S = 30.0

T = TypeVar("T")


def stream_address(s: Session, tls: bool = False) -> tuple[str, int] | None:
    """(host, port) of the daemon's stream port for this session's puts and gets, or None
    (module docstring). ``tls``: the client dials a TLS port (it has a CA for the daemon's
    certificate), never a plain one."""
    info = s.server
    port = info.get("peer_stream_tls_port" if tls else "peer_stream_port")
    if s.arena is not None or (s.curve is not None and not tls) or type(port) is not int:
        return None
    if wire.CAP_STREAM_OPS not in info.get("capabilities", ()):
        return None
    if not s.address.startswith("tcp://"):
        return None
    host = s.address[len("tcp://") :].rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def get_call(
    s: Session,
    ns_id: str,
    keys: Sequence[bytes],
    ranks: Sequence[int] | None,
    spec: NamespaceSpec | None,
    timeout: float,
) -> Callable[[StreamLink], list[list[memoryview]]]:
    """A client's ``get`` as a call on the link (both clients' :meth:`StreamUse.call`): the
    reply's head checked against the namespace's geometry when ``spec`` or the session knows
    it, else against the link's bound on a part (:meth:`StreamLink.get`)."""
    known = spec or s.specs.get(ns_id)
    size, tp = (known.part_bytes, known.tp_world_size) if known else (None, None)
    return lambda link: link.get(ns_id, keys, ranks, size, tp, timeout)


class StreamUse:
    """A client's use of the stream: its link, opened when first wanted, and when to try
    again after a failure. ``enabled`` False: never (``KVClient(stream=False)``).

    :meth:`call` / :meth:`call_async` run one op on the link and return its value, or None
    when it is to go over ZMQ instead: the stream is off or not announced, the request
    names no key or more than a stream request may, the link failed (closed, retried after
    :data:`RETRY_S`; a link that had served and was found closed, as after the daemon's
    restart or its idle timeout, is replaced at the next call instead), a put is larger
    than the daemon's ``max_message_bytes`` (a window of one, :mod:`kvserver.client.stream_put`:
    that window and the rest), or the daemon answered ``unknown_namespace`` /
    ``unauthenticated`` (the ZMQ path renews the session and retries as it does for its own
    requests), or a put was answered ``capacity`` (the daemon's stream puts in flight already
    hold their share of DRAM; a get's ``capacity`` is raised, as over ZMQ). Other error
    replies are raised, and so is a reply that breaks its request's bounds (InvalidArgument,
    :func:`kvserver.client.stream.check_get_head`), the link closed and the stream not tried
    for :data:`RETRY_S`.
    ``max_frame_bytes`` > 0: the client's own bound on a part it receives (``AsyncKVClient``'s,
    as over ZMQ)."""

    def __init__(
        self, enabled: bool, tls: ssl.SSLContext | None = None, max_frame_bytes: int = 0
    ) -> None:
        self.enabled = enabled
        self._tls = tls
        self._max_part = max_frame_bytes
        self._link: StreamLink | None = None
        self._retry_at = 0.0
        self._lock: asyncio.Lock | None = None

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def wanted(self, s: Session, num_keys: int) -> tuple[str, int] | None:
        """The stream's address when this request is to try it."""
        if not self.enabled or not 1 <= num_keys <= wire_stream.MAX_KEYS:
            return None
        address = stream_address(s, tls=self._tls is not None)
        if address is None or time.monotonic() < self._retry_at:
            self.close()
            return None
        return address

    def call(
        self, s: Session, address: tuple[str, int], timeout: float, fn: Callable[[StreamLink], T]
    ) -> T | None:
        """Run ``fn`` on the link (opened when needed); see the class docstring."""
        link = None
        try:
            link = self._link
            if link is None or link.sid != s.sid:
                self.close()
                link = self._link = StreamLink.open(
                    address, s.token(), timeout, s.sid, self._tls, s.max_message_bytes,
                    self._max_part,
                )  # fmt: skip
            return fn(link)
        except NotHere:
            return None
        except StreamFailed as exc:
            self.close()
            if not (exc.closed and link is not None and link.used):  # not just a stale link
                self._retry_at = time.monotonic() + RETRY_S
            if exc.error is not None:
                raise exc.error from None
            return None
        except (UnknownNamespace, Unauthenticated):
            return None

    async def call_async(
        self, s: Session, address: tuple[str, int], timeout: float, fn: Callable[[StreamLink], T]
    ) -> T | None:
        """:meth:`call` in a worker thread, one at a time. A cancelled caller shuts the link
        down and waits for the thread before the cancellation goes on (the next call opens
        a new link: a cancellation is not the stream failing)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            fut = asyncio.get_running_loop().run_in_executor(
                None, self.call, s, address, timeout, fn
            )
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                link = self._link
                if link is not None:
                    link.shutdown()
                with contextlib.suppress(BaseException):
                    await asyncio.wait([fut])
                self.close()
                # the link failed because we shut it down, not the stream: the next call
                # opens another (not ZMQ for RETRY_S)
                self._retry_at = 0.0
                raise
